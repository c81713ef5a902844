"""An attnkit course's own settings, ``attnkit-course.json`` in its folder (``attnkit course build`` writes it):
its id, its assignments and their points, its time limits, where its gradebook and exchange are, whether plain
confinement is allowed, whether speed checks that cannot run count. Everything that reads a course reads it here:
the commands, and the course's nbgrader_config.py (the same file in every course, grader/course/templates/), which
nbgrader runs."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from suite_runtime import DEFAULT_SPEED_CHECKS, SPEED_CHECK_POLICIES, SpeedChecks

from .. import kit
from ..errors import CourseError
from ..sandbox.limits import ATTEMPTS, LOAD_FACTOR, READY_SECONDS, TEST_TIMEOUT, Limits

MARKER_FILE = "attnkit-course.json"


@dataclass
class Course:
    """A course and one of its assignments (``assignment``, with its ``points``): ``Course.load(root, name)``."""
    root: Path
    course_id: str = "attention-kit"
    assignment: str = ""  # (Course.load and build name it)
    points: dict = field(default_factory=dict)  # the assignment's stage modules -> points
    assignments: dict = field(default_factory=dict)  # every assignment of the course -> its points
    test_timeout: float = TEST_TIMEOUT  # CPU seconds per check (also the students' own limit per check)
    time_budget: float | None = None  # CPU seconds per submission when grading (None: from test_timeout)
    exchange_root: str | None = None
    db_url: str | None = None
    allow_plain: bool = False  # grade where no confinement holds, learner code unconfined (the instructor's choice)
    # the kernels' speed checks that cannot run where grading runs (no GPU): "skip" leaves them out of the stage's
    # count, "count" fails them (SPEED_CHECK_POLICIES; the grading worker's pytest gets it as --speed-checks)
    speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS

    @property
    def source(self) -> Path:
        return self.root / "source" / self.assignment

    @property
    def exchange(self) -> Path:
        """The exchange folder nbgrader_config.py names (release, fetch, submit and collect go through it)."""
        return Path(self.exchange_root).expanduser() if self.exchange_root else self.root / "exchange"

    @property
    def gradebook_url(self) -> str:
        """nbgrader's gradebook, as nbgrader_config.py names it: ``db_url``, else gradebook.db in the course."""
        return self.db_url or f"sqlite:///{self.root / 'gradebook.db'}"

    @property
    def notebook(self) -> str:
        """The assignment's notebook, named after it (attention.ipynb)."""
        return self.assignment

    @property
    def execute_timeout(self) -> int:
        """Seconds nbgrader gives a notebook cell: the first autograder cell starts a grading worker and grades
        the whole submission (a fresh one again if the first fails). Wall-clock time, a backstop only: the
        grading worker's own limits count waiting, less the time the machine kept it waiting for a processor,
        so this allows LOAD_FACTOR times those."""
        limits = Limits(check_seconds=self.test_timeout, budget_seconds=self.time_budget)
        return int(LOAD_FACTOR * ATTEMPTS * (READY_SECONDS + limits.run_wall) + 60)

    @property
    def exclude_overwriting(self) -> dict[str, list[str]]:
        """Per assignment, the files nbgrader's autograde must keep as the student submitted them (it overwrites
        every file with the source's otherwise): the stage modules."""
        return {name: [f"{s}.py" for s in points] for name, points in self.assignments.items()}

    @property
    def total(self) -> float:
        return round(sum(self.points.values()), 2)

    def stage_files(self) -> list[str]:
        return [f"{s}.py" for s in self.points]

    def of(self, assignment: str) -> Course:
        """The same course, describing ``assignment`` (one of ``assignments``)."""
        return replace(self, assignment=assignment, points=dict(self.assignments[assignment]))

    @classmethod
    def load(cls, root, assignment: str | None = None) -> Course:
        """The course in ``root``, describing ``assignment`` (default: its first); an assignment the
        course does not have is a CourseError naming those it has."""
        root = Path(root).resolve()
        path = root / MARKER_FILE
        if not path.is_file():
            raise CourseError(f"{shlex.quote(str(root))} is not an attnkit course (no {MARKER_FILE}): give the folder "
                              f"`attnkit course build` made (or run from inside it), or make one: "
                              f"`attnkit course build {shlex.quote(str(root))}`")
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise CourseError(f"{path} is not readable JSON ({exc}): rebuild the course with "
                              f"`attnkit course build {shlex.quote(str(root))}` (it keeps the gradebook and "
                              "submissions)") from None
        if "assignments" not in data:  # a course built before the kit had two assignments
            data["assignments"] = {data.get("assignment") or kit.assignment().name: data.pop("points", {})}
        data = {k: v for k, v in data.items() if k in {f.name for f in fields(cls)} - {"root", "assignment", "points"}}
        course = cls(root=root, **data)
        problem = speed_checks_problem(course.speed_checks)
        if problem:  # (a hand-edited file: said here, not as a grading worker that cannot start)
            raise CourseError(f"{path}: {problem}; edit it there, or rebuild the course with `attnkit course build "
                              f"{shlex.quote(str(root))} --speed-checks {'|'.join(SPEED_CHECK_POLICIES)}`")
        name = assignment or next(iter(course.assignments))
        if name not in course.assignments:
            raise CourseError(f"the course in {shlex.quote(str(root))} has no assignment {name!r}; its assignments: "
                              f"{', '.join(course.assignments)}")
        return course.of(name)


def speed_checks_problem(value) -> str | None:
    """What is wrong with ``value`` as a course's speed_checks, in a sentence naming the two choices; None if
    nothing."""
    if value in SPEED_CHECK_POLICIES:
        return None
    return (f"speed_checks must be {' or '.join(map(repr, SPEED_CHECK_POLICIES))}, not {value!r}: \"skip\" leaves "
            "the speed checks that cannot run where grading runs (no GPU) out of a stage's count, \"count\" fails "
            "them")
