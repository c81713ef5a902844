"""The fixture toolkit: what an assignment's fixtures.py fills, and ``attnkit fixtures``, which runs them all.

Two files per stage, named arrays in .npz form (loaded with allow_pickle=False):

* ``public/<stage>.npz``: the stage's worked example (for chapter 3, the book's running example: the journey
  inputs, the book's seeded weights, the outputs the chapter prints). Students get these.
* ``hidden/<stage>.npz``: other shapes and weights, for grading only.

Each assignment's ``fixtures.py`` (assignments/<name>/) has one generator per stage module,
``<module>(ref, public, hidden)``: it fills the two ``Arrays`` it is given from the reference implementation
``ref`` (``adapters.Implementation`` of solutions/), with the helpers below; ``NO_FIXTURE`` there says why a stage
has none (dropout's masks would differ across platforms: it is tested by its properties). Random inputs and
weights come from NumPy's PCG64 generator with fixed seeds (``rng``), which gives the same numbers on every
platform; weights drawn the book's way come from torch.manual_seed (``seeded_weights``). ``manifest.json``
describes every array.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import torch

from suite_runtime.adapters import Implementation, LocalBackend, load_stage_module

from ..errors import AssignmentError
from ..kit import FIXTURES, SOLUTIONS, assignments


class Arrays:
    """Named arrays with a description each, written as one .npz file."""

    def __init__(self):
        self.arrays, self.descriptions = {}, {}

    def add(self, name, value, description):
        value = np.asarray(value)
        if value.dtype == np.float64:
            value = value.astype(np.float32)
        self.arrays[name], self.descriptions[name] = value, description
        return value

    def add_init(self, prefix, init):
        for key, value in init.items():
            self.add(f"{prefix}init/{key}", np.asarray(value), f"constructor argument {key}")

    def add_weights(self, prefix, weights, owner):
        for key, value in weights.items():
            self.add(f"{prefix}weights/{key}", value, f"{owner} parameter {key}, injected with load_state_dict")
        return {key: self.arrays[f"{prefix}weights/{key}"] for key in weights}


def rng(seed):
    """NumPy's PCG64 generator with a fixed seed: the same numbers on every platform."""
    return np.random.default_rng(seed)


def seeded_weights(module, cls, seed, *args, **kwargs):
    """The weights a reference constructor draws right after ``torch.manual_seed(seed)``, as the book's code
    draws them: ``cls(*args, **kwargs)`` of the reference ``module`` (its parameters only, as arrays)."""
    mod = load_stage_module(SOLUTIONS, module)
    torch.manual_seed(seed)
    model = getattr(mod, cls)(*args, **kwargs)
    return {k: v.numpy().copy() for k, v in model.state_dict().items() if k in dict(model.named_parameters())}


def module_case(out, prefix, stage, cls, init, x, weights, owner, output=None):
    """Store a module case under ``prefix``: its constructor arguments, the input batch ``x``, the ``weights``
    (injected by name with load_state_dict; ``owner`` describes them) and the reference's eval-mode output
    (``output``: what it is, if not that). Returns the weights as stored."""
    out.add_init(prefix, init)
    x = out.add(f"{prefix}x", x, f"input batch {tuple(np.shape(x))}")
    weights = out.add_weights(prefix, weights, owner)
    out.add(f"{prefix}output", stage.forward(cls, init, x, weights), output or f"{cls} output in eval mode")
    return weights


def decoding_case(out, prefix, stage, cls, init, x, chunks, weights, output=None):
    """Store a sequence decoded in ``chunks`` (their lengths add up to x's tokens): the constructor arguments,
    ``x``, the chunk lengths, the weights, and the full causal forward that every cached step must match."""
    out.add_init(prefix, init)
    x = out.add(f"{prefix}x", x, f"input batch {x.shape}")
    out.add(f"{prefix}chunks", np.asarray(chunks, np.int64), "tokens per forward(use_cache=True) step, in order")
    weights = out.add_weights(prefix, weights, cls)
    out.add(f"{prefix}output", stage.forward(cls, init, x, weights), output or (
        f"{cls} full causal forward (use_cache=False): step k of the cached decoding gives its chunk's rows"))
    return weights


def generators() -> tuple[dict, dict]:
    """(stage module -> its generator, stage module -> why it has none), from every assignment's fixtures.py,
    in teaching order; a stage with neither is an AssignmentError saying where its generator goes."""
    found, none = {}, {}
    for a in assignments().values():
        module = a.module("fixtures")
        reasons = getattr(module, "NO_FIXTURE", {}) if module is not None else {}
        for stage in a.modules:
            make = getattr(module, stage, None)
            if callable(make):
                found[stage] = make
            elif stage in reasons:
                none[stage] = reasons[stage]
            else:
                raise AssignmentError(f"no fixture generator for {stage}: write {stage}(ref, public, hidden) in "
                                      f"{a.folder / 'fixtures.py'} (or say why it needs none in its NO_FIXTURE)")
    return found, none


# How close a regenerated array must come to the stored one to count as unchanged (and to pass the kit's test that
# the committed fixtures regenerate). The same float32 computation does not give the same bits on every machine:
# the BLAS library picks its kernels by CPU (vector width, fused multiply-add, blocking), so sums are added up in
# another order, and a result that is a small difference of large terms can move by a few float32 steps of those
# terms (seen: 1.6e-7 on a value of -0.0142 made from terms near 3). Learners are graded against these files at
# diagnosis.compare.assert_close's default tolerance (rtol 1e-4, atol 1e-6), so whatever the stored values are off
# by comes out of the learner's tolerance. A tenth of the rtol (about 80 float32 steps, eps = 1.2e-7) and half of
# the atol absorb any machine's rounding while a fixture that passes still leaves the learner 90 % of the relative
# and 50 % of the absolute tolerance. A real change (another seed, shape or formula) moves values by far more.
REGENERATED = dict(rtol=1e-5, atol=5e-7)


def unchanged(path: Path, arrays: dict) -> bool:
    """Whether the .npz at ``path`` holds the same arrays (names, dtypes, shapes) with values within REGENERATED."""
    if not path.is_file():
        return False
    with np.load(path, allow_pickle=False) as old:
        if sorted(old.files) != sorted(arrays):
            return False
        return all(old[k].dtype == a.dtype and old[k].shape == a.shape
                   and np.allclose(a, old[k], **REGENERATED, equal_nan=True) for k, a in arrays.items())


def generate(out_dir: Path = FIXTURES, stages=None) -> dict:
    """Write the fixture files of ``stages`` (stage modules; None: every stage) into out_dir and update its
    manifest.json; return the manifest, with ``written`` and ``kept`` (files left as they were: the same arrays
    within float noise, REGENERATED) besides. A file is rewritten only where its arrays really changed, so that
    a machine's rounding never shows up as a change."""
    out_dir = Path(out_dir)
    ref = Implementation(LocalBackend(SOLUTIONS))
    found, none = generators()
    unknown = sorted(set(stages or ()) - set(found) - set(none))
    if unknown:
        raise AssignmentError(f"no stage {', '.join(unknown)} has fixtures; the stages: {', '.join(found)}")
    chosen = [s for s in found if stages is None or s in stages]
    path = out_dir / "manifest.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    manifest = {
        "generator": "grader.authoring.fixtures.generate (attnkit fixtures), from solutions/ and assignments/",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "stages_without_fixtures": none,
        "files": {name: meta for name, meta in (before.get("files") or {}).items()
                  if name.split("/")[-1].removesuffix(".npz") in found},
    }
    written, kept = [], []
    for stage in chosen:
        public, hidden = Arrays(), Arrays()
        found[stage](ref, public, hidden)
        for visibility, arrays in (("public", public), ("hidden", hidden)):
            name = f"{visibility}/{stage}.npz"
            target = out_dir / name
            if unchanged(target, arrays.arrays):
                kept.append(name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                np.savez(target, **arrays.arrays)
                written.append(name)
            manifest["files"][name] = {
                name: {"shape": list(a.shape), "dtype": str(a.dtype), "description": arrays.descriptions[name]}
                for name, a in arrays.arrays.items()
            }
    if not written and before:  # nothing changed: keep the manifest's versions too
        manifest = {**manifest, **{k: before[k] for k in ("torch", "numpy", "python") if k in before}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return {**manifest, "written": written, "kept": kept}
