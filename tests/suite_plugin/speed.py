"""Speed checks of the kernels assignment: a learner's kernel timed against the reference kernel and torch's own, on
a GPU, with points for reaching stated fractions of the reference kernel's throughput.

What is timed, and by whom. Every time is read on this (the trusted) process's clock, never taken from the learner's
process: the learner's function runs ``repeat`` times in one operation of the adapter (``op_timed``, which waits for
the GPU at its end), and its cost per call is the difference between an operation of 1 + N calls and one of 1 call,
divided by N: what moving the inputs and the result costs is in both and cancels. The reference kernel and torch's
operation are timed the same way in this process (the reference through a LocalBackend of its own, never the
reference fixture's memo). Each figure is the median of ROUNDS such differences, after a first call that compiles the
kernels (Triton's do_bench measures the same: a warm-up, then medians; it is not used for the learner's side because
its number would come from the learner's process). A kernel whose output is wrong gets no speed points.

Where no GPU can time kernels (no CUDA device, or learner kernels that run in Triton's interpreter: a grading box has
no GPU, see docs/kernels-sandbox.md), a speed check is NOT RUN, and says why. Whether such a check counts is the
course's choice (``--speed-checks``, or the environment variable ATTNKIT_SPEED_CHECKS): "skip" (the default) leaves it
out of the stage's count, as a CUDA case on a machine without CUDA is; "count" fails it, so that a grade made without
a GPU cannot reach full marks. A course sets it once (``attnkit course build --speed-checks``, the ``speed_checks``
of attnkit-course.json), and every grading path passes it to the grading worker's pytest as ``--speed-checks``.
"""
from __future__ import annotations

import os
import statistics
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from suite_runtime import SPEED_CHECK_POLICIES
from suite_runtime.adapters import LocalBackend

from . import ROOT

FRACTIONS = (0.25, 0.5, 0.8)  # of the reference kernel's throughput (its time / the learner's): one check each
ROUNDS, CALLS = 5, 10  # medians of ROUNDS differences of 1 + CALLS calls and 1 call
POLICIES = SPEED_CHECK_POLICIES  # "skip" (the default) or "count"
# Each stage module's timings, once per submission (its Stage, one per test file and submission): the fractions'
# checks share them.
_TIMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ids(fraction: float) -> str:
    """The check's parameter: its device (so that graders treat it as a CUDA check) and the fraction."""
    return f"cuda-{fraction:g}x"


def policy(config) -> str:
    chosen = config.getoption("speed_checks", None) or os.environ.get("ATTNKIT_SPEED_CHECKS", "skip")
    if chosen not in POLICIES:
        raise pytest.UsageError(f"--speed-checks / ATTNKIT_SPEED_CHECKS must be one of {', '.join(POLICIES)}, "
                                f"not {chosen!r}")
    return chosen


def why_not_run(impl) -> str | None:
    """Why kernels cannot be timed here (None: they can): the learner's kernels must run compiled on a CUDA GPU,
    in this process (a grading box has no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine: kernels run in Triton's interpreter, whose speed means nothing"
    if not isinstance(getattr(impl.backend, "backend", impl.backend), LocalBackend):
        return ("the learner's code runs in the grader's sandbox, which gives a box no GPU (its kernels run in "
                "Triton's interpreter)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: kernels run in Triton's interpreter, whose speed means nothing"
    return None


def _per_call(run) -> float:
    """Milliseconds per call of ``run(repeat)`` (which makes ``repeat`` calls and waits for the GPU)."""
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        run(1)
        once = time.perf_counter() - start
        start = time.perf_counter()
        run(1 + CALLS)
        many = time.perf_counter() - start
        samples.append(max(many - once, 0.0) / CALLS * 1e3)
    return statistics.median(samples)


def _in_process(fn, tensors):
    import torch

    def run(repeat):
        for _ in range(repeat):
            result = fn(*tensors)
        torch.cuda.synchronize()
        return result

    return run


def timings(stage, stage_name: str, function: str, args, kwargs, others: dict, dtype: str) -> dict:
    """{"yours", "reference", name of each of ``others``: ms per call, "result": the learner's output, "expected": the
    reference's}; computed once per stage module and function."""
    import torch

    key = (function, dtype)
    found = _TIMED.setdefault(stage, {})
    if key in found:
        return found[key]

    def learner(repeat):
        return stage.run("timed", func=function, args=args, kwargs=kwargs, device="cuda", dtype=dtype, repeat=repeat)

    reference = LocalBackend(Path(ROOT) / "solutions")

    def kit(repeat):
        return reference.run("timed", stage_name, func=function, args=args, kwargs=kwargs, device="cuda",
                             dtype=dtype, repeat=repeat)

    result, expected = learner(1), kit(1)  # the first calls compile the kernels: not timed
    figures = {"yours": _per_call(learner), "reference": _per_call(kit)}
    tensors = [torch.from_numpy(np.asarray(a)).to(device="cuda", dtype=getattr(torch, dtype)
                                                  if np.asarray(a).dtype.kind == "f" else None) for a in args]
    for name, fn in others.items():
        run = _in_process(fn, tensors)
        run(1)
        figures[name] = _per_call(run)
    found[key] = {**figures, "result": result, "expected": expected}
    return found[key]


def table(figures: dict, what: str) -> str:
    import torch

    lines = [f"speed on {torch.cuda.get_device_name()} ({what}), milliseconds per call (medians of {ROUNDS}):"]
    for name, ms in figures.items():
        if name in ("result", "expected"):
            continue
        ratio = figures["reference"] / ms if ms > 0 else float("inf")
        label = {"yours": "your kernel", "reference": "the reference kernel"}.get(name, name)
        lines.append(f"  {label:<24} {ms:9.4f} ms   {ratio:5.2f}x the reference kernel's throughput")
    return "\n".join(lines)


def require(impl, config):
    """The start of every speed check: where kernels cannot be timed, the check is not run (skipped, or failed if
    the course counts such checks: ``policy``), saying why, before any input is made."""
    __tracebackhide__ = True
    reason = why_not_run(impl)
    if reason is not None:
        if policy(config) == "count":
            pytest.fail(f"speed check not run: {reason}. This course counts speed checks that cannot run as failed.",
                        pytrace=False)
        pytest.skip(f"speed check not run: {reason}")


def check(stage, fraction: float, stage_name: str, function: str, args, kwargs=None, others=None,
          dtype: str = "bfloat16", what: str = "", rtol: float = 3e-2, atol: float = 3e-2):
    """A speed check (after ``require``): ``function`` of the learner's module at least ``fraction`` of the reference
    kernel's throughput on ``args`` (NumPy arrays, placed on the GPU in ``dtype``), its output right (rtol, atol
    against the reference's)."""
    __tracebackhide__ = True
    figures = timings(stage, stage_name, function, args, kwargs or {}, others or {}, dtype)
    # (a function returning several tensors, such as (o, lse), is judged by its first)
    result, expected = (np.asarray(figures[k][0] if isinstance(figures[k], tuple) else figures[k], dtype=np.float64)
                        for k in ("result", "expected"))
    if result.shape != expected.shape or not np.allclose(result, expected, rtol=rtol, atol=atol, equal_nan=False):
        pytest.fail(f"{function}'s output differs from the reference's at the speed check's size ({what}): speed "
                    "counts for a right output only (the checks above say what differs)", pytrace=False)
    reached = figures["reference"] / figures["yours"] if figures["yours"] > 0 else float("inf")
    if reached < fraction:
        pytest.fail(f"your kernel reaches {reached:.2f}x the reference kernel's throughput; this check needs "
                    f"{fraction:g}x.\n{table(figures, what)}", pytrace=False)
