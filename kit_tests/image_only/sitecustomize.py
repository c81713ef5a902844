"""The autograder's image, within this machine's Python: imported at start-up by every Python whose
PYTHONPATH holds this folder (kit_tests/outputs/test_gradescope.py runs ``run_autograder`` so), it makes every
installed distribution but those named in ATTNKIT_ONLY_INSTALLED (comma-separated) look absent, as in an
image that installs only those: their modules cannot be imported, and their metadata (pytest's plugins,
entry points) is not found. The sandbox's boxes (``python -I``) do not read it: they run learner code
with what their grading process already imported."""
import os
import re
import sys
import sysconfig
from importlib.machinery import PathFinder


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _hide_the_rest(names: str):
    import importlib.metadata

    allowed = {_canonical(name) for name in names.split(",")}
    site = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    finder = PathFinder
    everything = finder.find_distributions

    def installed(dist) -> bool:
        return _canonical(dist.metadata["Name"] or "") in allowed

    tops = {str(f).split("/")[0].split(".")[0] for dist in everything(importlib.metadata.DistributionFinder.Context())
            if installed(dist) for f in dist.files or [] if not str(f).startswith("..")}

    class Absent:
        """Refuses the top-level modules that only a hidden distribution provides."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if path is not None or name in tops:
                return None
            spec = finder.find_spec(name)
            origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
            if origin and any(os.path.realpath(origin).startswith(folder + os.sep) for folder in site):
                raise ModuleNotFoundError(f"No module named {name!r} (not in the autograder's image)", name=name)
            return None

    finder.find_distributions = staticmethod(lambda *a, **k: (d for d in everything(*a, **k) if installed(d)))
    sys.meta_path.insert(0, Absent)


if os.environ.get("ATTNKIT_ONLY_INSTALLED"):
    _hide_the_rest(os.environ["ATTNKIT_ONLY_INSTALLED"])
