"""What ``attnkit grade`` grades, and where the grades go: an nbgrader course, or a plain folder."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from . import results as R
from .gradebook import GradebookSync
from .kit import ASSIGNMENTS
from .sandbox import TEST_TIMEOUT


class TargetError(RuntimeError):
    """No course, assignment or submissions where they were looked for (printed as a plain error by the CLI)."""


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
    where: str = "the target"  # where the submissions were looked for, and how they get there (said if none)


def load_course(course_dir, assignment: str | None = None):
    """The attnkit course in ``course_dir`` describing ``assignment`` (default: its first), or a
    TargetError saying what to do."""
    from .course import Course, CourseError

    try:
        return Course.load(course_dir, assignment)
    except CourseError as exc:
        raise TargetError(str(exc)) from None


def assignments(course) -> list[str]:
    """The course's assignments, and any other it holds sources or grades of (from an earlier build)."""
    names = set(course.assignments) | {course.assignment}
    for folder in (course.root / "source", course.root / R.GRADES_DIR):
        if folder.is_dir():
            names |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return sorted(names)


def course_assignment(course, asked: str | None, command: str) -> str:
    """``asked`` (default: the course's own assignment), if the course has it; else a TargetError naming
    those it has, with the ``attnkit COMMAND`` line that uses one."""
    if asked is None:
        return course.assignment
    known = assignments(course)
    if asked not in known:
        raise TargetError(f"the course in {quote(str(course.root))} has no assignment {asked!r}; its assignments: "
                          f"{', '.join(known)} (e.g. `attnkit {command} {quote(known[0])}`)")
    return asked


def course_target(course_dir, assignment: str | None) -> Target:
    """nbgrader's layout: COURSE/submitted/<student>/<assignment>/."""
    course = load_course(course_dir)
    assignment = course_assignment(course, assignment, "grade")
    if assignment in course.assignments:
        course = course.of(assignment)
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
    return Target(submissions=found, assignment=assignment, out=R.results_dir(course.root, assignment),
                  points=dict(course.points), test_timeout=course.test_timeout, time_budget=course.time_budget,
                  timestamps=timestamps,
                  gradebook=GradebookSync(course.gradebook_url, assignment, course.notebook, dict(course.points),
                                          course.course_id, course.root),
                  course_root=course.root,
                  where=f"nothing in {quote(str(submitted))}/<student>/{assignment}/; collect the submissions first "
                        f"(in the course folder: `nbgrader collect {assignment}`, or `nbgrader zip_collect "
                        f"{assignment}` for an LMS download)")


def folder_target(submissions_dir, out, assignment: str | None = None, points=None,
                  test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None) -> Target:
    """A folder of submission folders, one per student (named after the student)."""
    from .course import ASSIGNMENT, plan_points

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
    assignment = assignment or ASSIGNMENT
    if points is None and assignment not in ASSIGNMENTS:
        raise TargetError(f"the kit has no assignment {assignment!r}: its assignments are {', '.join(ASSIGNMENTS)} "
                          "(or give --course, whose assignment's points are used)")
    return Target(submissions=found, assignment=assignment, out=out,
                  points=dict(points or plan_points(assignment=assignment)), test_timeout=test_timeout,
                  time_budget=time_budget,
                  where=f"{quote(str(root))} holds no submission folder (it should hold one folder per student, "
                        "named after the student, with the student's stage modules, sNN_*.py or mNN_*.py)")
