"""What ``attnkit grade`` grades in an nbgrader course: COURSE/submitted/<student>/<assignment>/, its grades going
into the course's gradebook and COURSE/attnkit-grades/<assignment>/ (a ``grader.grading.targets.Target``), and
the course's assignment a command means when it names none."""
from __future__ import annotations

from pathlib import Path
from shlex import quote

from .. import kit
from ..errors import TargetError
from ..grading import records as R
from ..grading.targets import Target, chosen_assignment, folder_target
from .gradebook import GradebookSync
from .settings import Course


def assignments(course) -> list[str]:
    """The course's assignments, and any other it holds sources or grades of (from an earlier build): the kit's
    in teaching order, then any other by name."""
    names = set(course.assignments) | {course.assignment}
    for folder in (course.root / "source", course.root / R.GRADES_DIR):
        if folder.is_dir():
            names |= {p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")}
    order = list(kit.assignments())
    return sorted(names, key=lambda name: (order.index(name) if name in order else len(order), name))


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


def submitted(course, assignment: str) -> dict[str, Path]:
    """nbgrader's layout: student -> COURSE/submitted/<student>/<assignment>/."""
    folder = course.root / "submitted"
    if not folder.is_dir():
        return {}
    return {p.name: p / assignment for p in sorted(folder.iterdir())
            if p.is_dir() and not p.name.startswith(".") and (p / assignment).is_dir()}


def course_target(course_dir, assignment: str | None) -> Target:
    """nbgrader's layout: COURSE/submitted/<student>/<assignment>/."""
    course = Course.load(course_dir)
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
                  speed_checks=course.speed_checks,
                  where=f"nothing in {quote(str(course.root / 'submitted'))}/<student>/{assignment}/; collect the "
                        f"submissions first (in the course folder: `nbgrader collect {assignment}`, or "
                        f"`nbgrader zip_collect {assignment}` for an LMS download)")


def course_folder_target(course: Course, submissions_dir, out, assignment: str | None = None, **limits) -> Target:
    """A folder of submission folders graded on the points of ``course``'s assignment (``assignment``, or the one
    the submissions' stage modules are of), and with the course's choice for speed checks that cannot run."""
    def points_of(name):
        return Course.load(course.root, course_assignment(course, name or course.assignment, "grade")[0]).points

    target = folder_target(submissions_dir, out, assignment, names=assignments(course), points_of=points_of, **limits)
    target.speed_checks = course.speed_checks
    return target
