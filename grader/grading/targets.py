"""What ``attnkit grade`` grades, and where the grades go: an nbgrader course, or a plain folder."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from stage_names import assignment_of, module_files

from ..course.gradebook import GradebookSync
from ..kit import ASSIGNMENTS
from ..sandbox.limits import TEST_TIMEOUT
from . import records as R


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
    allow_plain: bool = False  # grade where no confinement holds (learner code unconfined: the instructor's choice)
    submissions_root: Path | None = None  # (a plain folder of submissions) that folder
    chosen: str = ""  # how the assignment was chosen when none was named and there was a choice (said at the start)

    @property
    def private(self) -> list[Path]:
        """What learner code must not reach besides the kit: the course (gradebook, submissions, records), or
        the folder of submissions and the records."""
        return [self.course_root] if self.course_root else [p for p in (self.submissions_root, self.out) if p]


def load_course(course_dir, assignment: str | None = None):
    """The attnkit course in ``course_dir`` describing ``assignment`` (default: its first), or a
    TargetError saying what to do."""
    from ..course.build import Course, CourseError

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


def course_assignment(course, asked: str | None, command: str) -> tuple[str, str]:
    """(``asked``, "") if the course has it, else a TargetError naming those it has, with the ``attnkit COMMAND``
    line that uses one. None asked: the course's assignment that ``command`` has work for (submissions to grade,
    records to report on), and a sentence saying it was chosen so (see ``chosen_assignment``)."""
    known = assignments(course)
    if asked is None:
        if command == "grade":
            found = {name: len(submitted(course, name)) for name in known}
            what = f"submissions in {quote(str(course.root / 'submitted'))}"
        else:
            found = {name: len(R.read_records(R.results_dir(course.root, name))) for name in known}
            what = f"grades in {quote(str(course.root / R.GRADES_DIR))}"
        name, chosen = chosen_assignment(found, what, command)
        return name or course.assignment, chosen
    if asked not in known:
        raise TargetError(f"the course in {quote(str(course.root))} has no assignment {asked!r}; its assignments: "
                          f"{', '.join(known)} (e.g. `attnkit {command} {quote(known[0])}`)")
    return asked, ""


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
        f"{name}: the only assignment with {what} (of {', '.join(found)}); name one to choose: "
        f"`attnkit {command} ASSIGNMENT`")
    return name, chosen


def submitted(course, assignment: str) -> dict[str, Path]:
    """nbgrader's layout: student -> COURSE/submitted/<student>/<assignment>/."""
    folder = course.root / "submitted"
    if not folder.is_dir():
        return {}
    return {p.name: p / assignment for p in sorted(folder.iterdir())
            if p.is_dir() and not p.name.startswith(".") and (p / assignment).is_dir()}


def modules_by_assignment(folders) -> dict[str, int]:
    """assignment -> how many of the submission ``folders`` hold stage modules of it."""
    found = Counter()
    for folder in folders:
        found.update({assignment_of(path.stem) for path in module_files(folder)})
    return dict(found)


def course_target(course_dir, assignment: str | None) -> Target:
    """nbgrader's layout: COURSE/submitted/<student>/<assignment>/."""
    course = load_course(course_dir)
    assignment, chosen = course_assignment(course, assignment, "grade")
    if assignment in course.assignments:
        course = course.of(assignment)
    found = submitted(course, assignment)
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
                  course_root=course.root, chosen=chosen, allow_plain=course.allow_plain,
                  where=f"nothing in {quote(str(course.root / 'submitted'))}/<student>/{assignment}/; collect the "
                        f"submissions first (in the course folder: `nbgrader collect {assignment}`, or "
                        f"`nbgrader zip_collect {assignment}` for an LMS download)")


def folder_target(submissions_dir, out, assignment: str | None = None, points=None,
                  test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None, course=None) -> Target:
    """A folder of submission folders, one per student (named after the student), graded on ``points`` (default:
    ``course``'s points of the assignment, or the kit's). No ``assignment`` (nor ``points``): the one (of the
    course's, or the kit's) whose stage modules the submissions hold (see ``chosen_assignment``)."""
    from ..course.build import ASSIGNMENT, plan_points

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
        assignment, chosen = chosen_assignment({name: held.get(name, 0) for name in
                                                (assignments(course) if course else ASSIGNMENTS)},
                                               f"stage modules in {quote(str(root))}", "grade")
    if course is not None and points is None:
        assignment, _ = course_assignment(course, assignment or course.assignment, "grade")
        points = load_course(course.root, assignment).points
    assignment = assignment or ASSIGNMENT
    if points is None and assignment not in ASSIGNMENTS:
        raise TargetError(f"the kit has no assignment {assignment!r}: its assignments are {', '.join(ASSIGNMENTS)} "
                          "(or give --course, whose assignment's points are used)")
    return Target(submissions=found, assignment=assignment, out=out,
                  points=dict(points or plan_points(assignment=assignment)), test_timeout=test_timeout,
                  time_budget=time_budget, submissions_root=root, chosen=chosen,
                  where=f"{quote(str(root))} holds no submission folder (it should hold one folder per student, "
                        "named after the student, with the student's stage modules, sNN_*.py or mNN_*.py)")
