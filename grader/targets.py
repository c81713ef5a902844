"""What ``attnkit grade`` grades, and where the grades go: an nbgrader course, or a plain folder."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import results as R
from .gradebook import GradebookSync
from .sandbox import TEST_TIMEOUT


class TargetError(RuntimeError):
    """No submissions where they were looked for (printed as a plain error by the CLI)."""


@dataclass
class Target:
    """Where the submissions are and where their grades go."""
    submissions: dict[str, Path]  # student -> submission folder
    assignment: str
    out: Path  # the per-student records, grades.csv, grades.json
    points: dict[str, float]  # stage module -> points, teaching order
    test_timeout: float = TEST_TIMEOUT  # CPU seconds per check
    time_budget: float | None = None  # CPU seconds per submission (None: derived from test_timeout)
    gradebook: GradebookSync | None = None
    timestamps: dict[str, str] = field(default_factory=dict)
    course_root: Path | None = None  # the nbgrader course (None: a plain folder of submissions)


def course_target(course_dir, assignment: str | None) -> Target:
    """nbgrader's layout: COURSE/submitted/<student>/<assignment>/."""
    from .course import Course, CourseError

    try:
        course = Course.load(course_dir)
    except CourseError as exc:
        raise TargetError(str(exc)) from None
    assignment = assignment or course.assignment
    submitted = course.root / "submitted"
    found = {}
    if submitted.is_dir():
        for student in sorted(p for p in submitted.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (student / assignment).is_dir():
                found[student.name] = student / assignment
    timestamps = {}
    for student, folder in found.items():
        stamp = folder / "timestamp.txt"
        if stamp.is_file():
            timestamps[student] = stamp.read_text().strip()
    db_url = course.db_url or f"sqlite:///{course.root / 'gradebook.db'}"
    return Target(submissions=found, assignment=assignment, out=R.results_dir(course.root, assignment),
                  points=dict(course.points), test_timeout=course.test_timeout, time_budget=course.time_budget,
                  timestamps=timestamps,
                  gradebook=GradebookSync(db_url, assignment, course.notebook, dict(course.points)),
                  course_root=course.root)


def folder_target(submissions_dir, out, assignment: str | None = None, points=None,
                  test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None) -> Target:
    """A folder of submission folders, one per student (named after the student)."""
    from .course import ASSIGNMENT, plan_points

    root = Path(submissions_dir).resolve()
    if not root.is_dir():
        raise TargetError(f"{root} is not a folder of submissions")
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    return Target(submissions=found, assignment=assignment or ASSIGNMENT, out=Path(out).resolve(),
                  points=dict(points or plan_points()), test_timeout=test_timeout, time_budget=time_budget)


