"""How the kit's tests run the kit's commands and read what they leave: ``attnkit`` and nbgrader's command line
(each command a process of its own), ``attnkit grade`` of a course (here, or in a container as Docker makes one),
the files, gradebook rows and scores a run leaves, and what a record says."""
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from grader.grading.scoring import stage_report
from grader.kit import KIT, marker
from grader.sandbox.lockdown import kit_private

ATTNKIT = [sys.executable, "-m", "grader.cli"]
MODES_HELD = "ATTNKIT_TEST_KIT_MODES_HELD"  # set for the processes of a test that holds kit_modes_kept


@contextlib.contextmanager
def kit_modes_kept():
    """The permissions of the kit's secrets as they were, once the block ends: the container confinement makes
    them private to root. One such block at a time on this machine (pytest-xdist runs test files side by side:
    one giving the modes back must not open them under another's boxes); a process started inside the block
    (``MODES_HELD`` in its environment) leaves them to the block."""
    if os.environ.get(MODES_HELD):
        yield
        return
    held = os.open(KIT, os.O_RDONLY | os.O_DIRECTORY)  # the lock is on the kit's folder: nothing left behind
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        modes = {path: path.stat().st_mode for path in kit_private() if path.exists()}
        os.environ[MODES_HELD] = "1"
        try:
            yield
        finally:
            del os.environ[MODES_HELD]
            for path, mode in modes.items():
                path.chmod(mode)
    finally:
        os.close(held)


def attnkit(*args, cwd=None, tmpdir=None, stderr=False):
    """The command's output (and its error output too, with ``stderr``); it must succeed."""
    env = dict(os.environ, TMPDIR=str(tmpdir)) if tmpdir else None
    run = subprocess.run([*ATTNKIT, *args], cwd=cwd, capture_output=True, text=True, env=env)
    assert run.returncode == 0, f"attnkit {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return (run.stdout, run.stderr) if stderr else run.stdout


def nbgrader(*args, cwd, env=None) -> subprocess.CompletedProcess:
    """``python -m nbgrader ARGS`` in the folder ``cwd``: its exit status and what it printed. The command runs in
    a process of its own, forked from one that imported nbgrader once for this test process
    (kit_tests/nbgrader_server.py): nbgrader's own command line, without importing nbgrader anew each time."""
    with _SERVER_LOCK, tempfile.TemporaryDirectory(prefix="nbgrader-said-") as folder:
        global _server
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("nbgrader_server.py"))],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = [os.path.join(folder, name) for name in ("stdout", "stderr")]
        request = {"args": list(map(str, args)), "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                   "said": said}
        _server.stdin.write(json.dumps(request) + "\n")
        _server.stdin.flush()
        status = json.loads(_server.stdout.readline() or "null")
        assert status is not None, "the nbgrader server (kit_tests/nbgrader_server.py) died"
        stdout, stderr = (Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in said)
    return subprocess.CompletedProcess(["nbgrader", *args], status, stdout, stderr)


_server: subprocess.Popen | None = None  # this test process's nbgrader server, started on first use
_SERVER_LOCK = threading.Lock()


class Nbgrader:
    """Runs nbgrader's own command line (``nbgrader`` above) in one course, and keeps how long each run took (the
    fixture that makes one prints them)."""

    def __init__(self, course: Path):
        self.course = course
        self.timings = {}  # command -> seconds of each of its runs, in order

    def __call__(self, *args, cwd=None, env=None):
        start = time.monotonic()
        run = nbgrader(*args, cwd=cwd or self.course, env=env)
        self.timings.setdefault(args[0], []).append(time.monotonic() - start)
        assert run.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
        return run


def file_hashes(root: Path, skip=()) -> dict:
    """sha256 of every file under root (paths relative to root), leaving out the ``skip`` folders."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(rel.parts[:len(s.parts)] == s.parts for s in skip):
            out[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def gradebook_rows(db: Path) -> set:
    """Every row of every table, as (table, row) pairs."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {(t, row) for t in tables for row in con.execute(f'SELECT * FROM "{t}"')}


def scores(c, db: Path, students) -> dict:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{db}", c.course_id) as gb:
        return {s: {stage: gb.find_grade(f"grade_{stage}", c.notebook, c.assignment, s).score for stage in c.points}
                for s in students}


def expected_scores(c, entry) -> dict:
    return {stage: round(points * float(entry.fraction(marker(stage))), 2) for stage, points in c.points.items()}


DOCKER = Path(__file__).with_name("docker_default.sh")  # a command run in a container as Docker makes one


def attnkit_grade(root, tmpdir, assignment="attention", container=False):
    """``attnkit grade`` of the course at ``root``, here or (``container``) in a container like Docker's."""
    env = dict(os.environ, TMPDIR=str(tmpdir), PYTHON=sys.executable)
    command = [sys.executable, "-m", "grader.cli", "grade", assignment, "--course", str(root), "--workers", "1",
               "--quiet"]
    run = subprocess.run([str(DOCKER), *command] if container else command, capture_output=True, text=True, env=env)
    assert run.returncode == 0, f"attnkit grade failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def graded_content(record: dict) -> str:
    """What a record says about the work (not when or how fast it was graded), as bytes to compare."""
    return json.dumps(record["stages"], sort_keys=True)


@functools.cache
def hidden_lines() -> tuple[tuple[str, str], ...]:
    """(line, as matched) of the hidden material a student must never be shown: every line of every reference's
    solution regions, and every line of code of every hidden test (not its message strings: a failing check shows
    those), of 30 letters and digits or more, as grader.sandbox.redaction normalises text."""
    import ast

    from grader.kit import SOLUTIONS, SUITE
    from grader.sandbox.redaction import normalise, solution_regions
    from grader.suite import public_tests

    lines = [line for path in sorted(SOLUTIONS.glob("*.py")) for region in solution_regions(path.read_text())
             for line in region.splitlines()]
    for path in sorted(SUITE.glob("test_*.py")):
        text, hidden = path.read_text(), set(public_tests(path).hidden)
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name in hidden:
                lines += [line for line in text.splitlines()[node.lineno - 1:node.end_lineno]
                          if not line.strip().startswith(('"', "'", 'f"', "f'"))]
    matched = {line.strip(): normalise(line)[0] for line in lines}
    return tuple((line, n) for line, n in matched.items() if len(n) >= 30)


def hidden_quotes(shown: str, own: str = "") -> list[str]:
    """The hidden lines (``hidden_lines``) that ``shown`` quotes and ``own`` (the submission's modules) does not hold,
    matched as the redactor matches: a separator, an invisible character, case or width hides none."""
    from grader.sandbox.redaction import normalise

    shown, own = normalise(shown)[0], normalise(own)[0]
    return [line for line, n in hidden_lines() if n in shown and n not in own]


def feedback(record: dict) -> str:
    """The record as the student's feedback shows it (what `attnkit grade --notebooks` puts in the cells), its
    whitespace as single spaces: the report wraps long lines, and a phrase may span two."""
    return " ".join("\n".join(stage_report(s["stage"], s["max_points"], s["tests"]) for s in record["stages"]).split())
