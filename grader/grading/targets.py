"""What ``attnkit grade`` grades, and where the grades go: a ``Target``, here of a plain folder of submissions
(an nbgrader course's: grader.course.targets)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote
from typing import Protocol

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks
from suite_runtime.stage_names import module_files

from ..errors import TargetError
from ..kit import assignment_of, assignments, module_patterns, plan_points
from ..sandbox.limits import TEST_TIMEOUT
from .contracts import Record


class Gradebook(Protocol):
    """Where a run's stage scores go besides its records: nbgrader's gradebook (grader.course.gradebook)."""

    def check(self): ...  # fails early, saying what to do, where the scores cannot go
    def open(self): ...
    def write(self, records: Sequence[Record], timestamps: dict[str, str], progress=None) -> int: ...
    def close(self): ...
    def state(self) -> object: ...  # what changes whenever anything writes the gradebook (None: not knowable)


@dataclass
class Target:
    """Where the submissions are and where their grades go."""
    submissions: dict[str, Path]  # student -> submission folder
    assignment: str
    out: Path  # the per-student records, grades.csv, grades.json
    points: dict[str, float]  # stage module -> points, teaching order
    test_timeout: float = TEST_TIMEOUT  # CPU seconds per check
    time_budget: float | None = None  # CPU seconds per submission (None: derived from test_timeout)
    gradebook: Gradebook | None = None  # where the stage scores go besides the records (an nbgrader course's)
    timestamps: dict[str, str] = field(default_factory=dict)
    course_root: Path | None = None  # the nbgrader course (None: a plain folder of submissions)
    where: str = "the target"  # where the submissions were looked for, and how they get there (said if none)
    allow_plain: bool = False  # grade where no confinement holds (learner code unconfined: the instructor's choice)
    # the speed checks that cannot run where grading runs: "skip" (not counted) or "count"
    speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS
    submissions_root: Path | None = None  # (a plain folder of submissions) that folder
    chosen: str = ""  # how the assignment was chosen when none was named and there was a choice (said at the start)

    @property
    def private(self) -> list[Path]:
        """What learner code must not reach besides the kit: the course (gradebook, submissions, records), or
        the folder of submissions and the records."""
        return [self.course_root] if self.course_root else [p for p in (self.submissions_root, self.out) if p]


def chosen_assignment(found: dict[str, int], what: str, command: str) -> tuple[str | None, str]:
    """When no assignment was named: the one of ``found`` (assignment -> how many of ``what`` it has) with any,
    and, if there was a choice, a sentence saying why it was chosen; (None, "") when none has any. Several
    have some: a TargetError that asks which, since grading one as the other gives wrong grades."""
    have = {name: n for name, n in found.items() if n}
    if len(have) > 1:
        listed = ", ".join(f"{name} ({n})" for name, n in have.items())
        raise TargetError(f"there are {what} of {len(have)} assignments: {listed}; name the one to {command}, e.g. "
                          f"`attnkit {command} {quote(next(iter(have)))}`")
    if not have:
        return None, ""
    (name,) = have
    chosen = "" if len(found) == 1 else (
        f"{name}, the only assignment with {what} (of {', '.join(found)}); name one to choose: "
        f"`attnkit {command} ASSIGNMENT`")
    return name, chosen


def modules_by_assignment(folders) -> dict[str, int]:
    """assignment -> how many of the submission ``folders`` hold stage modules of it."""
    found: Counter[str] = Counter()
    for folder in folders:
        found.update({name for path in module_files(folder) if (name := assignment_of(path.stem)) is not None})
    return dict(found)


def folder_target(submissions_dir, out, assignment: str | None = None, points=None,
                  test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None, *, names=None,
                  points_of=None) -> Target:
    """A folder of submission folders, one per student (named after the student), graded on ``points`` (default:
    ``points_of(assignment)``, or the kit's plan of the assignment). No ``assignment`` (nor ``points``): the one
    of ``names`` (default: the kit's assignments) whose stage modules the submissions hold (see
    ``chosen_assignment``). (grader.course.targets.course_folder_target gives a course's names and points.)"""
    root = Path(submissions_dir).resolve()
    if not root.is_dir():
        raise TargetError(f"{quote(str(root))} is not a folder of submissions")
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise TargetError(f"--out {quote(str(out))} is a file: give a folder (new, or one graded before)")
    if out.is_relative_to(root):  # its folders would be graded as students' on the next run
        raise TargetError(f"--out {quote(str(out))} is inside --submissions {quote(str(root))}: "
                          "put the grades somewhere else")
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    chosen = ""
    if assignment is None and points is None:
        held = modules_by_assignment(found.values())
        assignment, chosen = chosen_assignment({name: held.get(name, 0) for name in (names or assignments())},
                                               f"stage modules in {quote(str(root))}", "grade")
    if points_of is not None and points is None:
        points = points_of(assignment)
    assignment = assignment or next(iter(assignments()))
    if points is None and assignment not in assignments():
        raise TargetError(f"the kit has no assignment {assignment!r}: its assignments are {', '.join(assignments())} "
                          "(or give --course, whose assignment's points are used)")
    return Target(submissions=found, assignment=assignment, out=out,
                  points=dict(points or plan_points(name=assignment)), test_timeout=test_timeout,
                  time_budget=time_budget, submissions_root=root, chosen=chosen,
                  where=f"{quote(str(root))} holds no submission folder (it should hold one folder per student, "
                        f"named after the student, with the student's stage modules, {module_patterns()})")
