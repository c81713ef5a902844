"""The kit's files, its assignments, and their stages in teaching order."""
from __future__ import annotations

from pathlib import Path

from stage_names import ASSIGNMENTS, assignment_of, marker, module_files, stage_of, stage_test_file

KIT = Path(__file__).resolve().parent.parent
SOLUTIONS = KIT / "solutions"  # the reference implementation
EXERCISES = KIT / "exercises"  # the stubs learners start from (attnkit stubs writes them)
FIXTURES = KIT / "fixtures"  # stored arrays: public/ ships to students, hidden/ never does
SUITE = KIT / "tests"  # the graded suite: stage tests and their support modules
# What a student installs to work on a release: its modules, tests and notebook import torch, numpy and pytest;
# pytest-timeout keeps each check's time limit (grader.course.build writes them into the release's requirements.txt).
STUDENT_PACKAGES = ("torch", "numpy", "pytest", "pytest-timeout")

__all__ = ["KIT", "SOLUTIONS", "EXERCISES", "FIXTURES", "SUITE", "STUDENT_PACKAGES", "ASSIGNMENTS", "assignment_of",
           "marker", "stage_of", "stages", "suite_files", "stage_test_file"]


def stages(assignment: str | None = None) -> list[str]:
    """Stage module names in teaching order (s01_attention_scores, ...), from solutions/: those of
    ``assignment`` (a name in ``ASSIGNMENTS``), or of every assignment."""
    if assignment is not None and assignment not in ASSIGNMENTS:
        raise ValueError(f"no assignment {assignment!r} in the kit: {', '.join(ASSIGNMENTS)}")
    return [path.stem for path in module_files(SOLUTIONS)
            if assignment is None or assignment_of(path.stem) == assignment]


def suite_files(chosen: list[str] | None = None) -> list[Path]:
    """The graded suite's test files, one per stage (of ``chosen``, or of every stage), in teaching order."""
    return [SUITE / stage_test_file(stage) for stage in (stages() if chosen is None else chosen)]
