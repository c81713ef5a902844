"""An nbgrader course built from the kit (``attnkit course build DIR``).

    DIR/
      nbgrader_config.py          course id, root, timeouts, kernel, exchange, grading hooks
      attnkit-course.json         marks DIR as an attnkit course (rebuilds are allowed)
      source/<assignment>/        what a student gets, for each assignment built (attention: chapter 3 of
                                  the book; modern-attention: the attention of today's LLMs):
        <assignment>.ipynb        stage explanations, demos, one locked autograder cell per stage
        sNN_topic.py              the stubs (from exercises/; mNN_topic.py for modern-attention)
        conftest.py               the kit's root conftest (pytest options)
        tests/                    public tests only, conftest.py and the support modules they import
        fixtures/public/          the published numbers
        pytest.ini                `pytest` there runs the public tests on the student's modules,
                                  each check limited to the course's test_timeout
        requirements.txt          what a student installs (torch, numpy, pytest, pytest-timeout)

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

import ast
import contextlib
import json
import os
import re
import shlex
import shutil
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from ..authoring.stubs import out_of_sync
from ..errors import CourseError
from ..grading.worker import READY_SECONDS
from ..kit import (
    ASSIGNMENT,
    ASSIGNMENTS,
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
from ..sandbox.limits import TEST_TIMEOUT, Limits, budget_problem
from ..suite import public_tests
from .gradebook import GradebookError, check_database, has_password

MARKER_FILE = "attnkit-course.json"
SUPPORT_FILES = ("conftest.py", "adapters.py", "checks.py")

@dataclass
class Course:
    """A course and one of its assignments (``assignment``, with its ``points``): ``Course.load(root, name)``."""
    root: Path
    course_id: str = "attention-kit"
    assignment: str = ASSIGNMENT
    points: dict = field(default_factory=dict)  # the assignment's stage modules -> points
    assignments: dict = field(default_factory=dict)  # every assignment of the course -> its points
    test_timeout: float = TEST_TIMEOUT  # CPU seconds per check (also the students' own limit per check)
    time_budget: float | None = None  # CPU seconds per submission when grading (None: from test_timeout)
    exchange_root: str | None = None
    db_url: str | None = None
    allow_plain: bool = False  # grade where no confinement holds, learner code unconfined (the instructor's choice)

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
            data["assignments"] = {data.get("assignment", ASSIGNMENT): data.pop("points", {})}
        data = {k: v for k, v in data.items() if k in {f.name for f in fields(cls)} - {"root", "assignment", "points"}}
        course = cls(root=root, **data)
        name = assignment or next(iter(course.assignments))
        if name not in course.assignments:
            raise CourseError(f"the course in {shlex.quote(str(root))} has no assignment {name!r}; its assignments: "
                              f"{', '.join(course.assignments)}")
        return course.of(name)


# ---------------------------------------------------------------- leaks

def solution_lines() -> set[str]:
    """Distinctive lines of the reference solutions' learner regions (stripped): lines that do not
    also appear outside the regions or in the student-safe test support files, are not comments,
    and are long enough to mean something."""
    inside, outside = set(), set()
    for name in SUPPORT_FILES:
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

def _steps(*names: str) -> list[str]:
    """Lines of a list of import strings in nbgrader_config.py."""
    return [f'    "{name}",' for name in names]


def nbgrader_config(course: Course) -> str:
    exclude = {name: [f"{s}.py" for s in points] for name, points in course.assignments.items()}
    # The first autograder cell starts a grading worker and grades the whole submission.
    limits = Limits(check_seconds=course.test_timeout, budget_seconds=course.time_budget)
    execute_timeout = int(READY_SECONDS + limits.run_wall + 60)
    lines = [
        '"""nbgrader configuration of an attention-kit course (written by `attnkit course build`;',
        'a rebuild overwrites it: change the build options instead of editing this file)."""',
        "import os",
        "import sys",
        "",
        "HERE = os.path.dirname(os.path.abspath(__file__))",
        "c = get_config()  # noqa: F821 (provided by nbgrader)",
        "",
        "# nbgrader runs `alembic` when it creates the gradebook: find it next to this Python even when",
        "# the virtual environment is not activated.",
        'os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")',
        "",
        f"c.CourseDirectory.course_id = {course.course_id!r}",
        "c.CourseDirectory.root = HERE",
        'c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".pytest_cache",',
        '                            "attnkit-grading.json"]',
    ]
    if course.db_url:
        lines.append(f"c.CourseDirectory.db_url = {course.db_url!r}")
    else:
        lines.append("# The gradebook is HERE/gradebook.db (SQLite); "
                     "set c.CourseDirectory.db_url for another database.")
    exchange = repr(course.exchange_root) if course.exchange_root else 'os.path.join(HERE, "exchange")'
    lines += [
        f"c.Exchange.root = {exchange}",
        "",
        "# Students write code in the stage modules; the notebook has no solution cells.",
        'c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}',
        "",
        "# Autograde: the kernel is python3; each autograder cell may run the whole suite (first cell).",
        'c.Execute.kernel_name = "python3"',
        f"c.Execute.timeout = {execute_timeout}",
        "c.OverwriteCells.add_missing_cells = True",
        "# Keep the student's modules: nbgrader otherwise overwrites every file with the source's.",
        f"c.Autograde.exclude_overwriting = {exclude!r}",
        "# Steps are named by import strings, which nbgrader resolves as it uses them: the formgrader shows",
        "# this configuration as JSON, and a class in it would not serialize (a warning on every visit).",
        "c.Autograde.sanitize_preprocessors = [",
        *_steps("nbgrader.preprocessors.ClearOutput", "grader.course.preprocessors.KeepCourseCells",
                "nbgrader.preprocessors.DeduplicateIds", "nbgrader.preprocessors.OverwriteKernelspec",
                "nbgrader.preprocessors.OverwriteCells", "nbgrader.preprocessors.CheckCellMetadata"),
        "]",
        "c.Autograde.autograde_preprocessors = [",
        *_steps("grader.course.preprocessors.SafePathExecute", "nbgrader.preprocessors.IgnorePattern",
                "nbconvert.preprocessors.ClearMetadataPreprocessor", "nbgrader.preprocessors.LimitOutput",
                "nbgrader.preprocessors.SaveAutoGrades", "nbgrader.preprocessors.AssignLatePenalties",
                "nbgrader.preprocessors.CheckCellMetadata"),
        "]",
        "# Feedback: each autograder cell named by its stage, without the hidden tests (grader.course.feedback).",
        'c.GenerateFeedback.exporter_class = "grader.course.feedback.FeedbackPage"',
        "c.GenerateFeedback.preprocessors = [",
        *_steps("nbgrader.preprocessors.GetGrades", "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
                "grader.course.feedback.FeedbackCells"),
        "]",
        "",
        "# The formgrader would show its whole configuration on Manage Assignments, and Jupyter's own settings",
        "# in it cannot be shown as JSON: 'Formgrader config is not serializable' on every visit. True shows it.",
        "c.FormgradeExtension.debug = False",
        "",
        "# zip_collect (LMS downloads): files named <student>_<file>, e.g. alice_s08_causal_attention.py",
        'c.FileNameCollectorPlugin.named_regexp = r".*/(?P<student_id>[^/_]+)_(?P<file_id>[^/]+)$"',
        'c.FileNameCollectorPlugin.valid_ext = [".ipynb", ".py"]  # the notebook and the stage modules',
        "",
    ]
    return "\n".join(lines)


def student_requirements() -> dict[str, str]:
    """STUDENT_PACKAGES -> each one's requirement, with the versions the kit's pyproject.toml asks for
    (``pytest>=8.0,<10``)."""
    from packaging.requirements import Requirement

    stated = {Requirement(line).name: line for line in
              tomllib.loads((KIT / "pyproject.toml").read_text())["project"]["dependencies"]}
    return {name: stated[name].split(";")[0].strip() for name in STUDENT_PACKAGES}


def requirements_txt() -> str:
    """The release's requirements.txt: ``pip install -r requirements.txt`` sets up a student's Python."""
    return (
        "# What this folder needs: pip install -r requirements.txt (then `pytest` here runs the public tests).\n"
        "# Without an NVIDIA GPU, a CPU build of torch is a much smaller download; install it first:\n"
        "#   pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
        + "".join(f"{line}\n" for line in student_requirements().values())
    )


def pytest_ini(test_timeout: float = TEST_TIMEOUT, tests: Path = SUITE) -> str:
    """The release's pytest.ini. Each check gets the course's time limit (pytest-timeout, signal
    method: the check fails and the run goes on), so that an endless loop in a student's module
    stops with a message (tests/conftest.py words it) instead of hanging `pytest` in silence; without
    pytest-timeout, pytest refuses to run (``required_plugins``) rather than run with no limit. It
    registers the markers the files in ``tests`` use, no others: `pytest --markers` in a student's
    folder names nothing that folder lacks (``slow`` marks the kit's own tests)."""
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
        f"addopts = {config['addopts']}\n"
        f"markers ={markers}\n"
        "filterwarnings = error::pytest.PytestUnknownMarkWarning\n"
        "# seconds per check: a check still running then is stopped and fails\n"
        f"timeout = {test_timeout:g}\n"
        "timeout_method = signal\n"
        "# no run without those limits\n"
        f"required_plugins = {student_requirements()['pytest-timeout'].replace(' ', '')}\n"
    )


def _local_imports(path: Path) -> set[str]:
    """Modules of the kit's tests/ folder that a file imports (by plain name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return {f"{n}.py" for n in names if (SUITE / f"{n}.py").is_file() and not n.startswith("test_")}


def support_files(public_tests_dir: Path) -> list[str]:
    """The support modules students need: SUPPORT_FILES and whatever they or the public tests
    import from tests/ (e.g. cases.py), transitively."""
    todo = [SUITE / n for n in SUPPORT_FILES] + sorted(Path(public_tests_dir).glob("test_*.py"))
    needed = set(SUPPORT_FILES)
    while todo:
        for name in _local_imports(todo.pop()):
            if name not in needed:
                needed.add(name)
                todo.append(SUITE / name)
    return sorted(needed)


def _check_target(root: Path):
    if root.exists() and not root.is_dir():
        raise CourseError(f"{root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not (root / MARKER_FILE).is_file():
        raise CourseError(
            f"{root} is not empty and is not an attnkit course (no {MARKER_FILE}); "
            "choose an empty or new directory"
        )


def build(root, *, course_id="attention-kit", assignments=None, total=100, points=None,
          test_timeout=TEST_TIMEOUT, time_budget=None, exchange_root=None, db_url=None, allow_plain=False) -> Course:
    """(Re)create the course at ``root`` with ``assignments`` (names in ``ASSIGNMENTS``; default: all of
    them), keeping any other assignment it had; returns it, describing the first assignment built.
    ``total`` and ``points`` (marker -> points) apply to each assignment. Raises CourseError on bad input."""
    root = Path(root).expanduser().resolve()
    _check_target(root)
    chosen = list(dict.fromkeys(assignments or ASSIGNMENTS))
    unknown = [a for a in chosen if a not in ASSIGNMENTS]
    if unknown:
        raise CourseError(f"no assignment {', '.join(map(repr, unknown))} in the kit; its assignments: "
                          f"{', '.join(ASSIGNMENTS)}")
    if not test_timeout > 0:
        raise CourseError("test_timeout must be positive")
    if budget_problem(test_timeout, time_budget):
        raise CourseError(budget_problem(test_timeout, time_budget))
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
                    assignments={name: every[name] for name in ASSIGNMENTS if name in every},
                    test_timeout=float(test_timeout),
                    time_budget=None if time_budget is None else float(time_budget),
                    exchange_root=exchange_root, db_url=db_url, allow_plain=bool(allow_plain))
    root.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        write_release_source(course.of(name))
    (root / "nbgrader_config.py").write_text(nbgrader_config(course))
    data = asdict(course)
    for key in ("root", "assignment", "points"):
        data.pop(key)
    (root / MARKER_FILE).write_text(json.dumps(data, indent=1) + "\n")
    if has_password(db_url):  # the course's files hold the gradebook's password: for the instructor's eyes only
        for name in ("nbgrader_config.py", MARKER_FILE):
            (root / name).chmod(0o600)
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
    for name in support_files(src / "tests"):
        shutil.copyfile(SUITE / name, src / "tests" / name)
    shutil.copyfile(KIT / "conftest.py", src / "conftest.py")  # the --impl and --seed options
    for stage in course.points:
        npz = FIXTURES / "public" / f"{stage}.npz"
        if npz.is_file():
            shutil.copyfile(npz, src / "fixtures" / "public" / npz.name)
    (src / "pytest.ini").write_text(pytest_ini(course.test_timeout, src / "tests"))
    (src / "requirements.txt").write_text(requirements_txt())
    import nbformat

    from .notebook import build_notebook

    nbformat.write(build_notebook(course.points, course.test_timeout, course.time_budget, course.assignment),
                   src / f"{course.notebook}.ipynb")

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
