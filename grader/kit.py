"""The kit's files, and its stages in teaching order."""
from __future__ import annotations

from pathlib import Path

from stage_names import marker, module_files, stage_of, stage_test_file

KIT = Path(__file__).resolve().parent.parent
SOLUTIONS = KIT / "solutions"  # the reference implementation
EXERCISES = KIT / "exercises"  # the stubs learners start from (attnkit stubs writes them)
FIXTURES = KIT / "fixtures"  # stored arrays: public/ ships to students, hidden/ never does
SUITE = KIT / "tests"  # the graded suite: stage tests and their support modules

__all__ = ["KIT", "SOLUTIONS", "EXERCISES", "FIXTURES", "SUITE", "marker", "stage_of", "stages", "suite_files",
           "stage_test_file"]


def stages() -> list[str]:
    """Stage module names in teaching order (s01_attention_scores, ...), from solutions/."""
    return [path.stem for path in module_files(SOLUTIONS)]


def suite_files() -> list[Path]:
    """The graded suite's test files, one per stage, in teaching order."""
    return [SUITE / stage_test_file(stage) for stage in stages()]
