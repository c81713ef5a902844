"""attnkit: the instructor's command line.

    attnkit stubs      write exercises/ from solutions/
    attnkit fixtures   regenerate fixtures/ from solutions/
    attnkit course build DIR   (re)create an nbgrader course from the kit
    attnkit demo [--dir DIR] [--nbgrader ASSIGNMENT] [--all]   nbgrader's round and attnkit grade on sample submissions
    attnkit samples [ASSIGNMENT] [--course DIR]   put those samples into your own course, for a trial run
    attnkit grade [ASSIGNMENT] [--course DIR] [--notebooks]   grade a whole class in parallel (resumable)
    attnkit report [ASSIGNMENT] [--course DIR]   an HTML class report (plots + tables) of the graded class
    attnkit gradescope [ASSIGNMENT] [--out autograder.zip]   the autograder zip for Gradescope (asked which)
    attnkit doctor     which confinement holds here, what it rests on, what to change for a stronger one
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from shlex import quote

from suite_runtime import DEFAULT_SPEED_CHECKS, SPEED_CHECK_POLICIES, SpeedChecks
from suite_runtime.stage_names import is_stage_module

from .errors import AttnkitError, GradeError, SampleError
from .kit import assignment, assignments, plan_points, stage_named
from .sandbox.confinement import ALLOW_PLAIN
from .sandbox.limits import BUDGET_CHECKS, TEST_TIMEOUT, budget_problem
from .untrusted import ID_RULE, printable


def cmd_stubs(args):
    from .authoring.stubs import write_exercises

    for path in write_exercises():
        print(f"wrote {path}")


def cmd_fixtures(args):
    from .authoring.fixtures import generate
    from .kit import FIXTURES

    stages = None
    if args.stage or args.assignment:
        stages = [stage_named(s) for s in args.stage or []]
        for name in args.assignment or []:
            stages += assignment(name).modules
    manifest = generate(args.out or FIXTURES, stages)
    written, kept = manifest["written"], manifest["kept"]
    print(f"wrote {len(written)} fixture file{'s' if len(written) != 1 else ''}"
          + (f" ({', '.join(written)})" if 0 < len(written) <= 6 else "")
          + f", kept {len(kept)} unchanged (the same arrays within float noise), updated manifest.json")


def _points(text):
    """STAGE=POINTS, STAGE being a stage's marker (topic) or module (sNN_topic)."""
    name, sep, value = text.partition("=")
    try:
        points = float(value)
    except ValueError:
        points = None
    if not sep or points is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STAGE=POINTS, e.g. {assignment().stages[-1].marker}=12")
    name = name.strip()
    if is_stage_module(name):
        name = name.split("_", 1)[1]
    return name, points


def _positive(kind):
    """An argparse type: a number of ``kind`` (float, int) above 0."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a number above 0")
        return value
    return parse


UNCONFINED_HELP = ("grade even where no confinement for learner code holds (UNCONFINED: it could read the "
                   "solutions and hidden tests); without it such a machine is refused")
SPEED_CHECKS_HELP = ("the kernels' speed checks that cannot run where grading runs (no GPU, or kernels in Triton's "
                     "interpreter, as in every grading box today): skip leaves them out of a stage's count, so a "
                     "grade made without a GPU can reach full marks; count fails them, so it cannot")


def cmd_course_build(args):
    from .course.build import build, exchange_hint

    course = build(
        args.dir, course_id=args.course_id, assignments=args.assignment, total=args.total,
        points=dict(args.points or []), test_timeout=args.test_timeout, time_budget=args.time_budget,
        exchange_root=args.exchange, db_url=args.db_url, allow_plain=args.allow_plain,
        speed_checks=args.speed_checks,
    )
    print(f"built course {course.course_id!r} in {course.root}")
    built = list(dict.fromkeys(args.assignment or course.assignments))
    for name in built:
        one = course.of(name)
        print(f"  source/{name}/: notebook {one.notebook}.ipynb, {len(one.points)} stage stubs, "
              f"public tests, public fixtures ({one.total:g} points)")
        for stage, points in one.points.items():
            print(f"    {stage:<28} {points:>6g}")
    hint = exchange_hint(course)
    if hint:
        print(f"note: {hint}")
    print(f"next: cd {quote(str(course.root))} && " + " && ".join(f"nbgrader generate_assignment {n}" for n in built))
    return 0


def cmd_demo(args):
    from .course.demo import run

    result = run(args.dir, nbgrader="all" if args.all else args.nbgrader)
    return 1 if result["fast_path_differs"] else 0


def cmd_samples(args):
    from .course.build import Course
    from .course.samples import load_into, planned
    from .course.targets import course_assignment

    course = Course.load(args.course)
    if args.student and not args.assignment:
        raise SampleError("--student needs an ASSIGNMENT (the samples differ between assignments): "
                          f"e.g. `attnkit samples attention --student {quote(args.student[0])}`")
    asked = args.assignment and course_assignment(course, args.assignment, "samples")[0]
    chosen = [asked] if asked else [*course.assignments]
    released = [name for name in chosen if (course.root / "release" / name).is_dir()]
    # Every assignment asked for is checked before any sample is written: one that was asked for by name, or
    # none at all, not generated yet is an error that says so.
    for name in chosen if args.assignment or not released else released:
        planned(course.root, name, args.student, args.force)
    loaded = {name: load_into(course.root, name, args.student, args.force) for name in released}
    for name, samples in loaded.items():
        print(f"{name}: {len(samples)} sample submission{'s' * (len(samples) > 1)} in "
              f"{quote(str(course.root / 'submitted'))}/<student>/{name}/ (what grading should give each, and why)")
        width, expected = max(len(s.student) for s in samples), max(len(s.expected()) for s in samples)
        for sample in samples:
            print(f"  {sample.student:<{width}}  {sample.expected():<{expected}}  {sample.description}")
    for name in sorted(set(chosen) - set(released)):
        print(f"{name}: not generated yet, no samples (`nbgrader generate_assignment {name}` first)")
    cd = f"cd {quote(str(course.root))} && " if course.root.resolve() != Path.cwd().resolve() else ""
    for name in loaded:
        print(f"next: {cd}nbgrader autograde {name}   (or the fast path: {cd}attnkit grade {name})")
    return 0


def cmd_report(args):
    if args.results:  # a results folder names its own assignment
        from .outputs.report import build_report

        index, report = build_report(args.results, args.assignment, args.out)
    else:  # a course: an assignment it has
        from .course.build import Course
        from .course.gradebook import class_report
        from .course.targets import course_assignment

        course = Course.load(args.course)
        assignment, chosen = course_assignment(course, args.assignment, "report")
        if chosen:  # (a note, not an error: the report goes on)
            print(f"reporting on {chosen}", file=sys.stderr)
        index, report = class_report(course, assignment, args.out)
    print(f"class report on {len(report.students)} students, {len(report.stages)} stages, "
          f"{report.limit_summary()}: {quote(str(index))}")
    for mismatch in report.mismatches:
        print(f"  warning: {printable(mismatch)}")
    return 0


def cmd_grade(args):
    from .course.settings import Course
    from .course.targets import course_folder_target, course_target
    from .grading.run import grade
    from .grading.targets import folder_target

    if args.submissions:
        if not args.out:
            raise GradeError("--submissions needs --out DIR (where the grades go)")
        limits = {"test_timeout": args.test_timeout or TEST_TIMEOUT, "time_budget": args.time_budget}
        if args.course:  # the points of the course's assignment
            target = course_folder_target(Course.load(args.course), args.submissions, args.out, args.assignment,
                                          **limits)
        else:
            target = folder_target(args.submissions, args.out, args.assignment, **limits)
    else:
        target = course_target(args.course or ".", args.assignment)
        if args.test_timeout is not None:
            target.test_timeout = args.test_timeout
            target.time_budget = None  # derived from the new limit, unless given too
        if args.time_budget is not None:
            target.time_budget = args.time_budget
    if args.speed_checks is not None:
        target.speed_checks = args.speed_checks
    if target.chosen:  # (a note, not an error: grading goes on)
        print(f"grading {target.chosen}", file=sys.stderr)
    if budget_problem(target.test_timeout, target.time_budget):
        raise GradeError(budget_problem(target.test_timeout, target.time_budget))
    if args.notebooks:  # (nbconvert and nbgrader's preprocessors: seconds to import, only for notebooks)
        from .course.feedback import check_notebooks_possible, write_notebooks

        check_notebooks_possible(target)  # before grading, not after
    target.allow_plain = target.allow_plain or args.allow_plain
    outcome = grade(target, students=args.student, force=args.force, executor=args.executor,
                    scheduler=args.scheduler, workers=args.workers, quiet=args.quiet)
    written, failed = write_notebooks(target, args.student, args.quiet) if args.notebooks else ([], {})
    graded = len(outcome.graded)
    rate = f", {graded / outcome.seconds:.2f} submissions/s" if graded and outcome.seconds else ""
    print(f"{target.assignment}: graded {graded}, already graded {len(outcome.skipped)}, "
          f"errors {len(outcome.errors)}" + (f", refused {len(outcome.refused)}" if outcome.refused else "")
          + f" in {outcome.seconds:.1f} s{rate}")
    for student, why in sorted(outcome.errors.items()):
        print(f"  not graded: {printable(student)}: {printable(why.splitlines()[0])} (run again to retry)")
    for student, why in sorted(outcome.refused.items()):
        print(f"  refused: {quote(printable(target.submissions[student]))}: {printable(why)}; {ID_RULE}: "
              "rename the folder and run again")
    if args.notebooks:
        print(f"autograded notebooks: {len(written)} written, {len(failed)} failed"
              + (f"; next: nbgrader generate_feedback {target.assignment}" if written else ""))
        for student, why in sorted(failed.items()):
            print(f"  no notebook for {printable(student)}: {printable(why)}")
    if not args.quiet:
        print(f"grades: {quote(str(target.out))} (one JSON per student, grades.csv, grades.json)"
              + ("; gradebook updated" if target.gradebook else ""))
    return 1 if outcome.errors or outcome.refused or failed else 0


def gradescope_assignment(asked: str | None) -> str:
    """The assignment ``attnkit gradescope`` builds the autograder of: the one asked for; else the kit's only one, or
    the only one of the course in the current folder (said); else a GradeError that asks which, as grade and report
    do when there is a choice (an autograder of the wrong assignment grades every upload 0)."""
    from .course.settings import Course
    from .errors import CourseError

    names = list(assignments())
    if asked or len(names) == 1:
        return asked or names[0]
    try:
        built = [name for name in Course.load(".").assignments if name in names]
    except CourseError:  # not in a course
        built = []
    if len(built) == 1:
        print(f"building the autograder of {built[0]}, the only assignment of the course in "
              f"{quote(str(Path.cwd()))} (of {', '.join(names)}); name one to choose: `attnkit gradescope ASSIGNMENT`",
              file=sys.stderr)
        return built[0]
    raise GradeError(f"name the assignment to build Gradescope's autograder of, one of {', '.join(names)}: e.g. "
                     f"`attnkit gradescope {names[0]} --out autograder.zip`")


def cmd_gradescope(args):
    from .outputs.gradescope import build_zip, python_floor, tested_versions

    args.assignment = gradescope_assignment(args.assignment)
    points = plan_points(args.total, None, args.assignment)
    if budget_problem(args.test_timeout, args.time_budget):
        raise GradeError(budget_problem(args.test_timeout, args.time_budget))
    speed_checks = args.speed_checks or course_speed_checks()
    out = build_zip(args.out, args.assignment, points, args.test_timeout, args.time_budget, args.allow_plain,
                    speed_checks)
    floor = ".".join(map(str, python_floor(tested_versions())))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): Gradescope's autograder for {args.assignment}, "
          f"{len(points)} stages, {sum(points.values()):g} points; upload it as a zip-file autograder "
          f"(an Ubuntu base image with Python {floor} or later, e.g. Ubuntu 24.04; no GPU)"
          + ("; the speed checks, which cannot run there, count as failed" if speed_checks == "count" else ""))
    return 0


def course_speed_checks() -> SpeedChecks:
    """The speed_checks of the course in the current folder (an instructor builds Gradescope's zip there, as
    ``gradescope_assignment`` assumes), else "skip"."""
    from .course.settings import Course
    from .errors import CourseError

    try:
        return Course.load(".").speed_checks
    except CourseError:  # not in a course
        return DEFAULT_SPEED_CHECKS


def cmd_doctor(args):
    from .sandbox.doctor import report

    lines, status = report(confine=args.confine, allow_plain=args.allow_plain)
    for line in lines:
        print(line)
    return status


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="attnkit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("stubs", help="write exercises/ from solutions/").set_defaults(func=cmd_stubs, said_as="stubs")
    p = sub.add_parser("fixtures", help="regenerate fixtures/ from solutions/ (only the files that change)")
    p.add_argument("--out", help="write somewhere else than fixtures/")
    p.add_argument("--stage", action="append", help="only this stage (its module or marker; repeatable)")
    p.add_argument("--assignment", action="append", help="only this assignment's stages (repeatable)")
    p.set_defaults(func=cmd_fixtures, said_as="fixtures")

    p = sub.add_parser("course", help="nbgrader course management")
    course_sub = p.add_subparsers(dest="course_command", required=True)
    b = course_sub.add_parser(
        "build", help="(re)create an nbgrader course directory from the kit",
        description="Write DIR/nbgrader_config.py and DIR/source/ASSIGNMENT/ (stubs, public tests, notebook). "
                    "DIR must be new, empty or an attnkit course; a rebuild keeps the gradebook and submissions.",
    )
    b.add_argument("dir", metavar="DIR")
    b.add_argument("--course-id", default="attention-kit", help="nbgrader course id (default: %(default)s)")
    b.add_argument("--assignment", action="append", choices=list(assignments()),
                   help="an assignment to build (repeat for several; default: all of them, %(choices)s)")
    b.add_argument("--total", type=float, default=100,
                   help="total points; stages without --points share what is left (default: %(default)s)")
    b.add_argument("--points", type=_points, action="append", metavar="STAGE=POINTS",
                   help=f"fix one stage's points, e.g. --points {assignment().stages[-1].marker}=15 (repeatable)")
    b.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT,
                   help="seconds of CPU time the learner's code may use in one check when grading, and the "
                        "time limit per check of the students' own pytest runs (default: %(default)s)")
    b.add_argument("--time-budget", type=float,
                   help="seconds of CPU time for a whole submission when grading; when it runs out, the checks "
                        f"not yet run fail (default: {BUDGET_CHECKS} x --test-timeout)")
    b.add_argument("--exchange", help="nbgrader Exchange.root (default: DIR/exchange)")
    b.add_argument("--db-url", help="nbgrader gradebook URL (default: sqlite DIR/gradebook.db)")
    b.add_argument(ALLOW_PLAIN, action="store_true", help=f"the autograder cells {UNCONFINED_HELP}")
    b.add_argument("--speed-checks", choices=SPEED_CHECK_POLICIES, default=SPEED_CHECK_POLICIES[0],
                   help=f"{SPEED_CHECKS_HELP}; kept in attnkit-course.json for every way the course grades "
                        "(default: %(default)s)")
    b.set_defaults(func=cmd_course_build, said_as="course build")

    p = sub.add_parser(
        "demo", help="grade the built-in sample submissions with nbgrader and attnkit grade, print a table",
        description="Build a course of every assignment in DIR, put the kit's sample submissions in it and grade "
                    "them: the first assignment through nbgrader's round (autograde, feedback) and `attnkit grade`, "
                    "whose scores must be equal, the others through `attnkit grade` alone; a class report each, "
                    "nbgrader export, and a table of students x stages per assignment.",
    )
    p.add_argument("--dir", default="attnkit-demo", help="course directory to (re)create (default: ./%(default)s)")
    p.add_argument("--nbgrader", action="append", choices=list(assignments()), metavar="ASSIGNMENT",
                   help="put this assignment through nbgrader's round (repeatable; default: "
                        f"{next(iter(assignments()))}; one of %(choices)s)")
    p.add_argument("--all", action="store_true",
                   help="every assignment through nbgrader's round (nbgrader's autograde takes seconds a submission)")
    p.set_defaults(func=cmd_demo, said_as="demo")

    p = sub.add_parser(
        "samples", help="put the demo's sample submissions into your own course, for a trial run",
        description="Write the kit's sample submissions (the reference, the stubs, typical mistakes, a syntax error, "
                    "an endless loop ...) into COURSE/submitted/<sample>/ASSIGNMENT/, as `nbgrader collect` leaves "
                    "submissions, to grade them with `nbgrader autograde` or `attnkit grade` and see what each gets. "
                    "The assignment must be generated (nbgrader generate_assignment) first.",
    )
    p.add_argument("assignment", nargs="?", metavar="ASSIGNMENT",
                   help="default: every assignment of the course that is generated")
    p.add_argument("--course", default=".", help="nbgrader course directory (default: the current one)")
    p.add_argument("--student", action="append", metavar="SAMPLE", help="only this sample of ASSIGNMENT (repeatable)")
    p.add_argument("--force", action="store_true", help="replace submissions already there under the samples' names")
    p.set_defaults(func=cmd_samples, said_as="samples")

    p = sub.add_parser(
        "report", help="write an HTML class report (score distributions, frequent mistakes, limits hit)",
        description="Read the gradebook and attnkit-grades/ASSIGNMENT/*.json of a course graded with `attnkit grade` "
                    "(or, with --results, a folder of such <student>.json files alone) and write index.html with "
                    "PNG plots and tables.",
    )
    p.add_argument("assignment", metavar="ASSIGNMENT", nargs="?",
                   help="default: the course's assignment that has grades (asked when several have)")
    p.add_argument("--course", default=".", help="nbgrader course directory (default: the current one)")
    p.add_argument("--results", metavar="FOLDER", help="read the <student>.json files in FOLDER, no gradebook")
    p.add_argument("--out", metavar="FOLDER",
                   help="where to write index.html and the PNGs (default: attnkit-grades/ASSIGNMENT/report/ "
                        "or FOLDER/report)")
    p.set_defaults(func=cmd_report, said_as="report")

    p = sub.add_parser(
        "grade", help="grade every submission of an assignment in parallel (resumable)",
        description="Grade every submission of ASSIGNMENT: nbgrader's COURSE/submitted/<student>/ASSIGNMENT/ "
                    "(scores go into the gradebook and COURSE/attnkit-grades/ASSIGNMENT/), or with --submissions "
                    "a folder of submission folders (grades go to --out). Students already graded with the same "
                    "modules are skipped: a run killed at any moment resumes where it stopped.",
    )
    p.add_argument("assignment", nargs="?", metavar="ASSIGNMENT",
                   help="default: the assignment the submissions are of (asked when they are of several)")
    p.add_argument("--course", help="nbgrader course directory (default: the current one); with --submissions: "
                                    "take the stage points from this course")
    p.add_argument("--submissions", metavar="DIR", help="grade the submission folders in DIR instead")
    p.add_argument("--out", metavar="DIR", help="with --submissions: where the grades go")
    p.add_argument("--student", action="append", metavar="ID", help="grade only this student (repeatable)")
    p.add_argument("--force", action="store_true", help="regrade students already graded")
    p.add_argument("--workers", type=_positive(int), help="local grading workers (default: one per core)")
    p.add_argument("--executor", choices=["local", "dask"], default="local",
                   help="where the grading jobs run (default: %(default)s)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="with --executor dask: the scheduler, e.g. tcp://host:8786")
    p.add_argument("--test-timeout", type=_positive(float),
                   help=f"CPU seconds per check (default: the course's, or {TEST_TIMEOUT:g})")
    p.add_argument("--time-budget", type=_positive(float),
                   help=f"CPU seconds per submission (default: the course's, or {BUDGET_CHECKS} x --test-timeout)")
    p.add_argument("--notebooks", action="store_true",
                   help="also write autograded/ notebooks from the grades (through nbgrader's autograde, without "
                        "running them), so that the formgrader shows them and `nbgrader generate_feedback` works")
    p.add_argument("--quiet", action="store_true", help="no progress bars (CI)")
    p.add_argument("--speed-checks", choices=SPEED_CHECK_POLICIES,
                   help=f"{SPEED_CHECKS_HELP} (default: the course's, or {SPEED_CHECK_POLICIES[0]})")
    p.add_argument(ALLOW_PLAIN, action="store_true", help=UNCONFINED_HELP)
    p.set_defaults(func=cmd_grade, said_as="grade", interrupted="what was graded is kept: run again to grade the rest")

    p = sub.add_parser(
        "gradescope", help="build Gradescope's autograder zip for an assignment",
        description="Write the autograder zip Gradescope takes: setup.sh, run_autograder and the kit, which grades "
                    "each submission with the same suite and sandbox as `attnkit grade` "
                    "(grader/outputs/gradescope.py).",
    )
    p.add_argument("assignment", nargs="?", choices=list(assignments()), metavar="ASSIGNMENT",
                   help="%(choices)s (default: the only one of the course in the current folder; asked otherwise)")
    p.add_argument("--out", default="autograder.zip", help="the zip to write (default: %(default)s)")
    p.add_argument("--total", type=_positive(float), default=100, help="total points (default: %(default)s)")
    p.add_argument("--test-timeout", type=_positive(float), default=TEST_TIMEOUT,
                   help="CPU seconds per check (default: %(default)s)")
    p.add_argument("--time-budget", type=_positive(float),
                   help=f"CPU seconds per submission (default: {BUDGET_CHECKS} x --test-timeout)")
    p.add_argument("--speed-checks", choices=SPEED_CHECK_POLICIES,
                   help=f"{SPEED_CHECKS_HELP} (Gradescope has no GPU; default: the speed_checks of the course in the "
                        f"current folder, or {SPEED_CHECK_POLICIES[0]})")
    p.add_argument(ALLOW_PLAIN, action="store_true", help=f"the autograder: {UNCONFINED_HELP}")
    p.set_defaults(func=cmd_gradescope, said_as="gradescope")

    p = sub.add_parser(
        "doctor", help="say which confinement holds here, what each guarantee rests on, what to change",
        description="Start a sandbox as a grading run does (the strongest confinement that holds here, proven by a "
                    "probe box), and say what it found: each guarantee, what it rests on, and for those missing "
                    "what to change. Exit status 0 where the strongest holds, 1 where a weaker one does, 2 where none.",
    )
    p.add_argument("--confine", choices=["namespaces", "userns", "container", "plain"],
                   help="try only this confinement (default: the strongest that holds)")
    p.add_argument(ALLOW_PLAIN, action="store_true", help="count plain (unconfined) as an answer")
    p.set_defaults(func=cmd_doctor, said_as="doctor")

    parser.set_defaults(interrupted=None)
    args = parser.parse_args(argv)
    return run(args)


def run(args) -> int:
    """Run the command ``args`` names; the one place where what stops a command is said: an AttnkitError as
    ``attnkit COMMAND: error: ...`` (exit status 2), an interruption in a line (130)."""
    try:
        return args.func(args) or 0
    except AttnkitError as exc:
        print(f"attnkit {args.said_as}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        note = getattr(args, "interrupted", None)
        print(f"attnkit {args.said_as}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
