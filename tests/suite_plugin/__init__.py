"""The graded suite's pytest plugin, one module per concern; tests/conftest.py names what each contributes.

    implementation  the implementation under test and the reference (the ``impl``, ``reference`` and ``stage``
                    fixtures), through the backend hook a grader answers
    inputs          the stored fixtures of a stage and the generator of its randomized cases
    devices         the CPU twin and the CUDA case of a batched test
    reports         a failure as a student reads it (tracebacks, parts not written yet, what an error means)
    time_limits     each check's time limit, worded for a student
    book            the book's printed numbers (no points), run after a stage's other checks
    summary         the stage summary at the end of a run
    speed           the kernels' speed checks (not a plugin: the stage test files call it)
"""
from __future__ import annotations

from pathlib import Path

SUITE = Path(__file__).resolve().parent.parent  # tests/: the stage test files and their support packages
ROOT = SUITE.parent  # the kit, or a student's release folder


def shown(path: Path) -> str:
    """``path`` as the student would type it: relative to the folder pytest runs in, when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
