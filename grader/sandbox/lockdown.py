"""What a box must not reach, made private to root where boxes are only other uids of this machine.

The ``container`` confinement (root without namespaces: Docker's default profile, as on Gradescope,
Kubernetes or a CI runner) gives each box a fresh uid, but the machine's own file system. Before its
first box starts, ``make_private`` takes every permission of group and others away from the kit's
solutions, graded suite, fixtures, grader and tests, and from what the grading run names (a course
folder with its gradebook, submissions and records; Gradescope's /autograder): root, the grader, reads
them as before; a box's uid cannot even list them. What boxes need stays reachable (the Python
installation, the sandbox's own folder): a folder that holds one of those keeps only the right
to pass through it, and its other entries are made private one by one. The system's own folders are
never touched.

Nothing is given back afterwards: another grading run may still be going, and leaving the kit's secrets
private to root is the safe state. ``witnesses`` are what a probe box must then fail to read (the sandbox
refuses to grade where it can): each private path, and a file inside each folder.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import sys
import urllib.parse
from pathlib import Path

from ..kit import ASSIGNMENTS_FOLDER, FIXTURES, KIT, SOLUTIONS, SUITE

# The kit's own files a learner must not reach, by their names in a kit's folder: the reference, the hidden tests and
# fixtures, the grader. (Names, not paths relative to this kit: the suite's runtime, which names the assignments'
# folder, may come from another copy of the kit than the grader, e.g. a checkout that is the working folder.)
KIT_FOLDERS = tuple(Path(path.name) for path in (SOLUTIONS, SUITE, FIXTURES, ASSIGNMENTS_FOLDER, KIT / "grader",
                                                 KIT / "kit_tests"))
SYSTEM = ("/", "/usr", "/usr/local", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev", "/proc",
          "/sys", "/tmp", "/var", "/run", "/home", "/root", "/opt", "/srv", "/mnt", "/media")  # never made private


def kit_private() -> list[Path]:
    """The kit's files a learner must not reach, in every copy of the kit this Python installation knows: the
    one running (its grader's and its suite's), and the one an editable install of it points to (Gradescope's copy
    of the kit runs from /autograder/source/kit while an instructor's checkout may sit elsewhere on the same
    machine)."""
    roots = {KIT, ASSIGNMENTS_FOLDER.parent}  # (the same kit, unless the suite's runtime came from another copy)
    for distribution in importlib.metadata.distributions(name="attention-kit"):  # (each place on sys.path that has one)
        try:
            url = json.loads(distribution.read_text("direct_url.json") or "{}").get("url", "")
        except (ValueError, AttributeError):
            continue
        if url.startswith("file://"):
            roots.add(Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)))
    return [root / folder for root in sorted(roots) for folder in KIT_FOLDERS]


def needed() -> list[Path]:
    """What every box must reach wherever it runs: the Python installation, at its real paths (the sandbox
    adds its own folder)."""
    return sorted({Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                         sys.base_exec_prefix)})


BOX_IMPORTS = ("torch", "numpy")  # what boxes import besides the standard library and the kit's runtime


def import_folders() -> list[str]:
    """The entries of this process's ``sys.path`` that boxes import from, in its order: those inside the Python
    installation, and those that hold torch, NumPy or a distribution they require (found through their metadata,
    and where Python finds them: a user site-packages folder, PYTHONPATH, a folder a .pth file names). Nothing
    else of ``sys.path`` (the working folder, a script's folder, another project's) is shown to a box."""
    import importlib.util
    import re

    prefixes = needed()
    folders, pending, seen = set(), list(BOX_IMPORTS), set()
    while pending:
        name = re.sub(r"[-_.]+", "-", pending.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        folders.add(os.path.realpath(distribution.locate_file("")))
        for requirement in distribution.requires or []:
            if "extra ==" not in requirement.replace("extra==", "extra =="):
                pending.append(re.match(r"[A-Za-z0-9._-]+", requirement).group())
    for name in BOX_IMPORTS:  # (installed without metadata: where the package itself is)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.add(os.path.realpath(Path(list(spec.submodule_search_locations)[0]).parent))
    script = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else None  # (a console
    # script's folder, the venv's bin/: on sys.path, inside the installation, and nothing to import)
    entries = [os.path.abspath(entry) for entry in sys.path if entry]
    return list(dict.fromkeys(entry for entry in entries if os.path.realpath(entry) in folders or (
        entry != script and any(_inside(Path(os.path.realpath(entry)), prefix) for prefix in prefixes))))


PYTHON_HINT = (" Boxes run as other users than root and import from the Python installation: it must be readable by "
               "every user, as in Docker's Python images (/usr/local) or a system Python (/usr); a Python installed "
               "under /root (pyenv), which is private to root, is not. Install Python elsewhere, or let other users "
               "through (chmod o+x on each folder above the installation).")


def python_witnesses() -> list[str]:
    """What boxes must be able to read of the Python installation: the standard library's folder and a
    module of it that no box has imported (a lazy import must work), and torch's package."""
    import encodings
    import importlib.util

    stdlib = Path(encodings.__file__).parent.parent
    found = [str(stdlib), str(stdlib / "encodings" / "idna.py")]
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.origin:
        found.append(torch.origin)
    return found


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def make_private(paths, keep=None) -> list[Path]:
    """Make ``paths`` (and everything below them) unreachable for other uids, keeping ``keep`` (default:
    ``needed()``) reachable; returns the paths made private (those that exist). A path that is a system
    folder, or lies inside a kept one, is left alone: the probe box then shows whether it was needed."""
    keep = [Path(os.path.realpath(p)) for p in (needed() if keep is None else keep)]
    done = []
    for path in dict.fromkeys(Path(os.path.realpath(p)) for p in paths):
        if str(path) in SYSTEM or any(_inside(path, kept) for kept in keep) or not path.exists():
            continue
        _private(path, keep)
        done.append(path)
    return done


def _private(path: Path, keep: list[Path]):
    mode = stat.S_IMODE(path.lstat().st_mode)
    if path.is_symlink():
        return  # (its mode means nothing; what it points to is made private where it is named)
    holds = [kept for kept in keep if _inside(kept, path) and kept != path]
    if not holds or not path.is_dir():
        os.chmod(path, mode & ~0o077)
        return
    # A folder on the way to something boxes need: others may pass through it, not list or change it.
    os.chmod(path, mode & ~0o066)
    for entry in path.iterdir():
        if entry.is_symlink():
            continue
        if any(_inside(kept, entry) for kept in holds):
            if entry not in holds:
                _private(entry, keep)
        else:
            os.chmod(entry, stat.S_IMODE(entry.lstat().st_mode) & ~0o077)


def witnesses(paths) -> list[str]:
    """What a probe box must fail to read: each of ``paths`` that exists, and the first file found inside
    each folder among them (a hidden fixture, a solution, a record ...)."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            continue
        found.append(str(path))
        if path.is_dir():
            inner = next((p for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()), None)
            if inner is not None:
                found.append(str(inner))
    return found
