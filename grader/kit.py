"""The kit's files, its assignments, and their stages in teaching order."""
from __future__ import annotations

from pathlib import Path

from stage_names import ASSIGNMENTS, assignment_of, marker, module_files, stage_test_file

from .errors import CourseError

KIT = Path(__file__).resolve().parent.parent
SOLUTIONS = KIT / "solutions"  # the reference implementation
EXERCISES = KIT / "exercises"  # the stubs learners start from (attnkit stubs writes them)
FIXTURES = KIT / "fixtures"  # stored arrays: public/ ships to students, hidden/ never does
SUITE = KIT / "tests"  # the graded suite: stage tests and their support modules
# What a student installs to work on a release: its modules, tests and notebook import torch, numpy and pytest;
# pytest-timeout keeps each check's time limit (grader.course.build writes them into the release's requirements.txt).
STUDENT_PACKAGES = ("torch", "numpy", "pytest", "pytest-timeout")
# A reference solution marks the learner's parts with nbgrader's delimiters (attnkit stubs makes each a TODO).
SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"
ASSIGNMENT = "attention"  # the course's first assignment, where a command is given none

# Relative weights of the stages (harder stages weigh more); they add up to 100.
DEFAULT_WEIGHTS = {
    "attention_scores": 5, "normalization": 8, "context_vectors": 5, "trainable_projections": 8,
    "self_attention": 10, "causal_mask": 8, "dropout": 8, "causal_attention": 12,
    "multihead_wrapper": 8, "multihead_attention": 16, "other_forms": 12,
    "pytorch_attention": 12, "padding_and_cross": 14, "kv_cache": 16, "grouped_query": 14,
    "rotary_embeddings": 16, "sliding_window": 12, "tiled_attention": 16,
}



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


def plan_points(total: float | None = 100, overrides: dict[str, float] | None = None,
                assignment: str = ASSIGNMENT) -> dict[str, float]:
    """Points per stage module of ``assignment``. ``overrides`` (marker -> points) fixes some stages (those
    of other assignments are left to them); the others share what is left of ``total`` in proportion to
    DEFAULT_WEIGHTS. total=None: overrides + defaults as is."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {marker(s) for s in stages()})
    if unknown:
        raise CourseError(f"unknown stage(s) {', '.join(unknown)}; stages are: {', '.join(map(marker, stages()))}")
    all_stages = stages(assignment)
    overrides = {m: p for m, p in overrides.items() if m in {marker(s) for s in all_stages}}
    for m, p in overrides.items():
        if not p >= 0:
            raise CourseError(f"points for {m} must be >= 0, got {p}")
    free = [s for s in all_stages if marker(s) not in overrides]
    weights = {s: DEFAULT_WEIGHTS.get(marker(s), 8) for s in free}
    fixed = sum(overrides.values())
    if total is None:
        total = fixed + sum(weights.values())
    if fixed > total + 1e-9 or (not free and abs(fixed - total) > 1e-9):
        raise CourseError(f"the stage points given add up to {fixed:g}, which does not fit a total of {total:g}")
    left = total - fixed
    points, given = {}, 0.0
    for s in all_stages:
        if marker(s) in overrides:
            points[s] = float(overrides[marker(s)])
        elif s == free[-1]:
            points[s] = round(left - given, 2)  # absorbs the rounding
        else:
            points[s] = round(left * weights[s] / sum(weights.values()), 2)
            given += points[s]
    return points
