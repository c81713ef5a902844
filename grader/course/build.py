"""An nbgrader course built from the kit (``attnkit course build DIR``).

    DIR/
      nbgrader_config.py          course id, root, timeouts, kernel, exchange, grading hooks
      attnkit-course.json         marks DIR as an attnkit course (rebuilds are allowed)
      source/<assignment>/        what a student gets, for each assignment built (attention: chapter 3 of
                                  the book; modern-attention: the attention of today's LLMs):
        <assignment>.ipynb        stage explanations, demos, one locked autograder cell per stage
        sNN_topic.py              the stubs (from exercises/; mNN_topic.py for modern-attention)
        conftest.py               the kit's root conftest (pytest options)
        tests/                    public tests only, conftest.py and the suite's packages (runtime, diagnosis, plugin)
        fixtures/public/          the published numbers
        pytest.ini                `pytest` there runs the public tests on the student's modules,
                                  each check limited to the course's test_timeout (CPU time)
        requirements.txt          what a student installs (torch, numpy, pytest)
        README.md                 how to set it up, a command per platform (a CPU build of torch where no GPU)

Rebuilding rewrites the config and the ``source/<assignment>/`` folders it builds, keeps the other
assignments the course had, and leaves the gradebook, submissions and everything nbgrader made
alone. Each release is checked for leaks before the build returns: no solution line, no hidden test
name, no hidden fixture.

Two preprocessors (``grader.course.preprocessors``) plug into nbgrader's autograde through the config
(nbgrader itself is used unmodified): code cells the source notebook does not have are dropped
before execution and the nbgrader metadata of the others is restored from the gradebook, and the
kernel starts with PYTHONSAFEPATH=1 so that files in a submission folder cannot shadow modules the
kernel imports. In generate_feedback, ``grader.course.feedback`` names each autograder cell by its stage
and leaves the hidden tests out of the page. This module itself imports neither nbgrader nor
nbformat at the top: reading a course (``Course.load``) stays quick.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks

from .. import kit
from ..authoring.stubs import out_of_sync
from ..errors import CourseError
from ..kit import (
    EXERCISES,
    FIXTURES,
    KIT,
    SOLUTION_BEGIN,
    SOLUTION_END,
    SOLUTIONS,
    STUDENT_PACKAGES,
    SUITE,
    plan_points,
    stage_test_file,
    stages,
    suite_files,
)
from ..sandbox.limits import TEST_TIMEOUT, budget_problem
from ..suite import public_tests
from .gradebook import GradebookError, check_database, has_password
from .settings import MARKER_FILE, Course, speed_checks_problem

# What a release's tests/ holds besides the public test files: the suite's conftest and its three packages (its
# runtime, the diagnosis engine, its pytest plugin), every module of them.
SUPPORT_PACKAGES = ("suite_runtime", "diagnosis", "suite_plugin")
# ... less what only a grading box runs: how a box compiles a kernel for a GPU (it imports Triton, which only the
# kernels assignment's release installs, and no student needs it: a GPU compiles kernels the usual way).
GRADING_ONLY = ("suite_runtime/triton_compile.py",)
# pytest plugins of the kit's own test extra (pyproject.toml: parallel runs, a wall-clock timeout, snapshots of the
# grades on record), which a student's run of the public tests never uses: blocked in the release's pytest.ini, so
# that where they are installed (a machine that also grades) a student's `pytest` does not import them at every run.
# The student's time limit is the suite's own (tests/suite_plugin/time_limits.py), not pytest-timeout's.
GRADING_PLUGINS = ("xdist", "xdist.looponfail", "timeout", "syrupy")
NOTEBOOK_TOOLS = Path(__file__).with_name("notebook_tools.py")  # the release's copy: notebook_tools.py
NBGRADER_CONFIG = Path(__file__).parent / "templates" / "nbgrader_config.py"  # every course's

# ---------------------------------------------------------------- leaks

def solution_lines() -> set[str]:
    """Distinctive lines of the reference solutions' learner regions (stripped): lines that do not
    also appear outside the regions or in the student-safe test support files, are not comments,
    and are long enough to mean something."""
    inside, outside = set(), set()
    for name in support_files():
        outside.update(line.strip() for line in (SUITE / name).read_text().splitlines())
    for stage in stages():
        region = False
        for line in (SOLUTIONS / f"{stage}.py").read_text().splitlines():
            s = line.strip()
            if s == SOLUTION_BEGIN:
                region = True
            elif s == SOLUTION_END:
                region = False
            elif region:
                inside.add(s)
            else:
                outside.add(s)
    return {s for s in inside - outside if len(s) >= 12 and not s.startswith("#")}


def find_leaks(folder: Path, hidden_names, sol_lines=None) -> list[str]:
    """Problems in a folder meant for students: solution lines, hidden test names, hidden fixtures."""
    sol_lines = solution_lines() if sol_lines is None else sol_lines
    words = re.compile(r"\b(" + "|".join(map(re.escape, sorted(hidden_names))) + r")\b") if hidden_names else None
    problems = []
    for path in sorted(Path(folder).rglob("*")):
        rel = path.relative_to(folder)
        if "hidden" in rel.parts:
            problems.append(f"{rel}: hidden fixtures must not ship")
        if not path.is_file() or path.suffix not in (".py", ".ipynb", ".ini", ".txt", ".md", ".json", ".html"):
            continue
        text = path.read_text(errors="replace")
        if path.suffix in (".ipynb", ".html", ".json"):
            text = text.replace("\\n", "\n").replace('\\"', '"')
        stripped = {line.strip().strip('",') for line in text.splitlines()} | {
            line.strip() for line in text.splitlines()}
        for line in sorted(sol_lines & stripped):
            problems.append(f"{rel}: solution line {line!r}")
        if words:
            for name in sorted(set(words.findall(text))):
                problems.append(f"{rel}: hidden test name {name!r}")
    return problems


# ---------------------------------------------------------------- building

def student_requirements() -> dict[str, str]:
    """STUDENT_PACKAGES -> each one's requirement, with the versions the kit's pyproject.toml asks for
    (``pytest>=8.0,<10``)."""
    from packaging.requirements import Requirement

    stated = {Requirement(line).name: line for line in
              tomllib.loads((KIT / "pyproject.toml").read_text())["project"]["dependencies"]}
    return {name: stated[name].split(";")[0].strip() for name in STUDENT_PACKAGES}


def requirements_txt(requires: tuple[str, ...] = ()) -> str:
    """The release's requirements.txt: ``pip install -r requirements.txt`` sets up a student's Python; ``requires``:
    what the assignment needs beyond that (its record's)."""
    return (
        "# What this folder needs (then `pytest` here runs the public tests; README.md says the same).\n"
        "# Linux or Windows without an NVIDIA GPU: PyTorch's CPU build first (about 190 MB, against the CUDA build's\n"
        "# 5.5 GB that Linux gets otherwise), then the rest:\n"
        "#   pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
        "#   pip install -r requirements.txt\n"
        "# macOS, or Linux with an NVIDIA GPU: pip install -r requirements.txt\n"
        + "".join(f"{line}\n" for line in [*student_requirements().values(), *requires])
    )


def readme_md(assignment: str, notebook: str) -> str:
    """The release's README.md: what a student reads first in the folder, how to set it up on each platform (the
    notebook's first cell says the same, from the same template)."""
    from .notebook import TEMPLATES

    record = kit.assignment(assignment)
    return (f"# {record.title}\n\n" + TEMPLATES.get_template("setting_up.md").render()
            + f"\nThen open `{notebook}.ipynb` (e.g. `pip install jupyterlab`, then `jupyter lab`), which explains "
              "each stage, or run `pytest` here to test your modules against the public tests.\n")


def pytest_ini(test_timeout: float = TEST_TIMEOUT, tests: Path = SUITE) -> str:
    """The release's pytest.ini. Each check gets the course's time limit in CPU time (``check_time_limit``, kept by
    the suite's own plugin, tests/suite_plugin/time_limits.py: as when graded, a busy machine does not stop a check),
    so that an endless loop in a student's module stops with a message instead of hanging `pytest` in silence. It
    registers the markers the files in ``tests`` use, no others: `pytest --markers` in a student's folder names
    nothing that folder lacks (``slow`` marks the kit's own tests)."""
    config = tomllib.loads((KIT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    used = "\n".join(path.read_text() for path in Path(tests).glob("*.py"))
    markers = "".join(f"\n    {m}" for m in config.get("markers", [])
                      if re.search(rf"\bmark\.{re.match('[a-z_]+', m)[0]}\b", used))
    return (
        "# Run `pytest` here to test your own modules against the public tests\n"
        "# (set up once with `pip install -r requirements.txt`).\n"
        "[pytest]\n"
        "testpaths = tests\n"
        "impl = .\n"
        f"addopts = {config['addopts']}{''.join(f' -p no:{name}' for name in GRADING_PLUGINS)}\n"
        f"markers ={markers}\n"
        "filterwarnings = error::pytest.PytestUnknownMarkWarning\n"
        "# seconds of CPU time per check: a check still computing then is stopped and fails (one that waits, e.g.\n"
        "# sleeps, is stopped after 5 times that; a busy machine's delays do not count)\n"
        f"check_time_limit = {test_timeout:g}\n"
    )


def support_files() -> list[str]:
    """The support files students need, relative to tests/: its conftest.py and every module of SUPPORT_PACKAGES
    but those GRADING_ONLY."""
    return ["conftest.py"] + sorted(name for package in SUPPORT_PACKAGES for path in (SUITE / package).glob("*.py")
                                    if (name := str(path.relative_to(SUITE))) not in GRADING_ONLY)


def _check_target(root: Path):
    if root.exists() and not root.is_dir():
        raise CourseError(f"{root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not (root / MARKER_FILE).is_file():
        raise CourseError(
            f"{root} is not empty and is not an attnkit course (no {MARKER_FILE}); "
            "choose an empty or new directory"
        )


def build(root, *, course_id="attention-kit", assignments=None, total=100, points=None,
          test_timeout=TEST_TIMEOUT, time_budget=None, exchange_root=None, db_url=None, allow_plain=False,
          speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> Course:
    """(Re)create the course at ``root`` with ``assignments`` (names of the kit's assignments; default: all of
    them), keeping any other assignment it had; returns it, describing the first assignment built.
    ``total`` and ``points`` (marker -> points) apply to each assignment; ``speed_checks``: "skip" or "count" (see
    Course). Raises CourseError on bad input."""
    root = Path(root).expanduser().resolve()
    _check_target(root)
    chosen = list(dict.fromkeys(assignments or kit.assignments()))
    unknown = [a for a in chosen if a not in kit.assignments()]
    if unknown:
        raise CourseError(f"no assignment {', '.join(map(repr, unknown))} in the kit; its assignments: "
                          f"{', '.join(kit.assignments())}")
    if not test_timeout > 0:
        raise CourseError("test_timeout must be positive")
    if budget_problem(test_timeout, time_budget):
        raise CourseError(budget_problem(test_timeout, time_budget))
    if speed_checks_problem(speed_checks):
        raise CourseError(speed_checks_problem(speed_checks))
    stale = out_of_sync(assignments=chosen)
    if stale:
        raise CourseError(f"exercises/ is out of date with solutions/ ({', '.join(stale)}): run `attnkit stubs`")
    planned = {name: plan_points(total, points, name) for name in chosen}
    kept, before = {}, None
    if (root / MARKER_FILE).is_file():
        with contextlib.suppress(CourseError):  # a damaged course file: rebuilt from what is asked now
            before = Course.load(root)
    if before is not None:
        kept = {name: p for name, p in before.assignments.items() if name not in planned}
        # A rebuild keeps the course's gradebook and exchange unless given others: a PostgreSQL course
        # rebuilt without --db-url would otherwise grade into a new, empty SQLite file.
        db_url, exchange_root = db_url or before.db_url, exchange_root or before.exchange_root
    if exchange_root:  # nbgrader would read a relative path from its own folder, not the one it was given in
        exchange_root = str(Path(exchange_root).expanduser().resolve())
    if db_url:
        try:
            check_database(db_url)
        except GradebookError as exc:
            raise CourseError(str(exc)) from None
    every = {**planned, **kept}
    course = Course(root=root, course_id=course_id, assignment=chosen[0], points=planned[chosen[0]],
                    assignments={name: every[name] for name in kit.assignments() if name in every},
                    test_timeout=float(test_timeout),
                    time_budget=None if time_budget is None else float(time_budget),
                    exchange_root=exchange_root, db_url=db_url, allow_plain=bool(allow_plain),
                    speed_checks=speed_checks)
    root.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        write_release_source(course.of(name))
    shutil.copyfile(NBGRADER_CONFIG, root / NBGRADER_CONFIG.name)  # the same in every course: it reads MARKER_FILE
    data = asdict(course)
    for key in ("root", "assignment", "points"):
        data.pop(key)
    (root / MARKER_FILE).write_text(json.dumps(data, indent=1) + "\n")
    if has_password(db_url):  # the course's settings hold the gradebook's password: for the instructor's eyes only
        (root / MARKER_FILE).chmod(0o600)
    make_exchange(course.exchange)
    return course


def make_exchange(folder: Path):
    """The exchange folder, made as nbgrader's release_assignment makes it: every user may write there
    (students submit into it). Without it the formgrader warns on every page. A folder that cannot be
    made (no permission) is left to the instructor: see ``exchange_hint``."""
    if folder.is_dir():
        return
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True)
        folder.chmod(0o777)  # not subject to the umask, as in nbgrader


def exchange_hint(course: Course) -> str | None:
    """How to make the course's exchange folder when it is missing or not writable, else None."""
    folder = course.exchange
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    where = shlex.quote(str(folder))
    return (f"the exchange folder {where} is missing or not writable (nbgrader's release, fetch, submit and collect "
            f"need a folder every student can write to): sudo mkdir -p {where} && sudo chmod ugo+rwx {where}")


def write_release_source(course: Course):
    """``source/<assignment>/`` of the assignment ``course`` describes, checked for leaks."""
    if course.source.exists():
        shutil.rmtree(course.source)
    src = course.source
    (src / "tests").mkdir(parents=True)
    (src / "fixtures" / "public").mkdir(parents=True)
    for name in course.stage_files():
        shutil.copyfile(EXERCISES / name, src / name)
    hidden_names = []
    for stage in course.points:
        path = SUITE / stage_test_file(stage)
        if not path.is_file():
            raise CourseError(f"no test file for stage {stage} ({path})")
        derived = public_tests(path)
        hidden_names += derived.hidden
        if derived.source:
            (src / "tests" / path.name).write_text(derived.source)
    for name in support_files():
        (src / "tests" / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(SUITE / name, src / "tests" / name)
    shutil.copyfile(KIT / "conftest.py", src / "conftest.py")  # the --impl and --seed options
    for stage in course.points:
        npz = FIXTURES / "public" / f"{stage}.npz"
        if npz.is_file():
            shutil.copyfile(npz, src / "fixtures" / "public" / npz.name)
    (src / "pytest.ini").write_text(pytest_ini(course.test_timeout, src / "tests"))
    (src / "requirements.txt").write_text(requirements_txt(kit.assignment(course.assignment).requires))
    (src / "README.md").write_text(readme_md(course.assignment, course.notebook))
    import nbformat

    from .notebook import build_notebook

    nbformat.write(build_notebook(course.assignment, course.points, course.test_timeout, course.time_budget,
                                  course.speed_checks),
                   src / f"{course.notebook}.ipynb")
    shutil.copyfile(NOTEBOOK_TOOLS, src / NOTEBOOK_TOOLS.name)  # what the notebook's setup cell imports

    # A hidden name that is also public somewhere (another stage) is not a leak.
    public_names = {n for p in suite_files(list(course.points)) for n in public_tests(p).public}
    leaks = find_leaks(src, set(hidden_names) - public_names)
    if leaks:
        shutil.rmtree(src)
        raise CourseError(f"the release of {course.assignment} would leak instructor-only material:\n  "
                          + "\n  ".join(leaks[:20]))


def hidden_test_names() -> set[str]:
    hidden, public = set(), set()
    for path in suite_files():
        derived = public_tests(path)
        hidden.update(derived.hidden)
        public.update(derived.public)
    return hidden - public
