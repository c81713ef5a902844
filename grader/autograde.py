"""Grading a submission with the kit's full suite, for nbgrader's autograder cells.

Every autograder cell of the course notebook ends in

    from grader.autograde import grade_stage
    grade_stage("causal_attention", points=12)

The first call runs the whole suite (public and hidden tests, ``book`` tests
deselected) ONCE against the submission folder, in a child ``pytest`` process
with ``--isolate`` (the learner's modules run in the sandbox, never in the
notebook kernel). The result is kept in this kernel; every cell then prints
its stage's per-test verdicts and failure messages (never test code) and
returns its score, which nbgrader reads as partial credit.

Nothing here writes to stderr: nbgrader zeroes any grade cell with stderr
output, so a correct submission that emits a warning would lose its points.

This module is also a pytest plugin (``-p grader.autograde``): in the child
pytest process it records one JSON line per test in the file named by
``ATTNKIT_RESULTS``, so that a run cut short still leaves what it finished.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

from . import TESTS, scratch
from .sandbox import STAGE_FILE as STAGE_MODULE
from .sandbox import ONE_THREAD, START_SECONDS, Limits, submission_sources

RESULTS_ENV = "ATTNKIT_RESULTS"
SUITE_ENV = "ATTNKIT_SUITE"  # another tests/ directory (kit development only)
STAGE_FILE = re.compile(r"test_(s\d\d)_(\w+)\.py$")
MESSAGE_LIMIT = 700  # characters of one failure message shown in feedback
DETAILED_FAILURES = 12  # failures per stage shown with their message

TEST_TIMEOUT = 10.0  # CPU seconds the learner's code may use in one check (see grader.sandbox.Limits)
TIME_LIMIT = re.compile(r"time limit|pytest-timeout")  # the sandbox's and pytest-timeout's messages
BACKSTOP_SECONDS = 60  # pytest-timeout's wall clock per test, beyond the sandbox's own limits

# pytest plugins a grading run goes without. The learner's code runs in the sandbox, so nothing it
# does reaches this process's warnings, logs, threads or unraisable exceptions; each of these plugins
# wraps every test in hooks (about 5 % of a warm worker's time). grader.grade's workers use the same.
UNUSED_PLUGINS = ("cacheprovider", "logging", "warnings", "threadexception", "unraisableexception", "faulthandler",
                  "unittest", "setuponly", "setupplan", "doctest", "junitxml", "pastebin", "stepwise", "anyio")


def limits_of(test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None) -> Limits:
    """The sandbox's limits for a grading run: ``test_timeout`` CPU seconds per check, ``time_budget``
    for the whole submission (None: the sandbox's default, derived from ``test_timeout``)."""
    return Limits(check_seconds=float(test_timeout), budget_seconds=None if time_budget is None else float(time_budget))


def grading_options(submission, seed, limits: Limits, isolate=True) -> list[str]:
    """The options of a grading run on ``submission`` (after the test files). ``isolate=False`` puts
    the learner's code in the pytest process itself: for measurements (benchmarks/bench_grading.py's
    floor), never for grading."""
    return [
        # --impl=PATH as one word: pytest must not take PATH for a test path (it would load a
        # conftest.py from the submission into this trusted process).
        f"--impl={submission}", *(["--isolate"] if isolate else []), "-p", "grader.autograde",
        *[arg for name in UNUSED_PLUGINS for arg in ("-p", f"no:{name}")],
        "-m", "not book", "--assert=plain", "-q", "--tb=no", "--no-header",
        f"--time-limit={limits.check_seconds}", f"--time-budget={limits.budget}",
        # pytest-timeout only backs the sandbox up (its clock is the wall's, and it would count the
        # sandbox's start-up in the first test's set-up): the learner's time is the sandbox's to limit.
        "-o", f"timeout={limits.check_wall + BACKSTOP_SECONDS:g}", "-o", "timeout_method=signal",
        "-o", "timeout_func_only=true", f"--seed={seed}",
    ]


class GradingError(RuntimeError):
    """The grading run itself failed (an instructor-side problem, not the learner's)."""


# ---------------------------------------------------------------- running the suite

def suite_dir() -> Path:
    return Path(os.environ.get(SUITE_ENV) or TESTS).resolve()


def suite_timeout(limits: Limits) -> float:
    """Wall-clock limit of one whole suite run, a backstop: the learner's time is bounded by the
    budget; add the sandbox's start-up and the trusted side's own work."""
    return limits.budget_wall + START_SECONDS + 120


def submission_fingerprint(submission: Path) -> str:
    """sha256 (hex) of the submitted stage modules' names and contents: what a record of the
    submission's grades stands for, and what its seed is drawn from. Only regular files count: the
    sandbox ignores a folder or a link named like a module, and neither may crash or stall grading."""
    digest = hashlib.sha256()
    for path in sorted(Path(submission).glob("s[0-9][0-9]_*.py")):
        if not path.is_file() or path.is_symlink():
            continue
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def seed_of(fingerprint: str) -> int:
    return int(fingerprint[:8], 16) & 0x7FFFFFFF


def submission_seed(submission: Path) -> int:
    """The seed of the randomized hidden cases: fixed by the submitted modules' contents, so that
    regrading gives the same grades while two different submissions get different cases."""
    return seed_of(submission_fingerprint(submission))


def run_suite(submission, *, isolate=True, limits: Limits | None = None, python=None) -> dict:
    """Run the kit's suite on ``submission`` (a folder of stage modules) in a child process.

    Returns {"tests": [{nodeid, stage, marker, label, outcome, message}], "confinement", "seed",
    "seconds", "returncode", "log"}. Tests the run did not reach (time limit, crash) count as failed.
    """
    submission = Path(submission).resolve()
    limits = limits or limits_of()
    seed = submission_seed(submission)
    tests = suite_dir()
    files = sorted(str(p) for p in tests.glob("test_s[0-9][0-9]_*.py"))
    if not files:
        raise GradingError(f"no stage test files (test_sNN_*.py) in {tests}")
    scratch.sweep()
    with scratch.Folder("grade") as work:
        results = work.path / "results.jsonl"
        cmd = [python or sys.executable, "-m", "pytest", *files, "--rootdir", str(tests.parent),
               *grading_options(submission, seed, limits, isolate)]
        env = dict(os.environ, **ONE_THREAD, **{RESULTS_ENV: str(results)})  # one thread, as in attnkit grade
        env.pop("NBGRADER_EXECUTION", None)
        env.pop("PYTHONSAFEPATH", None)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=work.path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, timeout=suite_timeout(limits),
            )
            returncode, log = proc.returncode, proc.stdout.decode("utf-8", "replace")
        except subprocess.TimeoutExpired as exc:
            returncode, log = None, (exc.stdout or b"").decode("utf-8", "replace")
        seconds = time.monotonic() - start
        recorded = read_results(results, cut_short=returncode not in (0, 1))
    if not recorded["tests"]:
        raise GradingError(
            f"the grading run collected no tests (pytest exit code {returncode}). Its output:\n"
            + log[-3000:]
        )
    return {"tests": recorded["tests"], "confinement": recorded["confinement"], "seed": seed,
            "seconds": round(seconds, 2), "returncode": returncode, "log": log[-20000:]}


def read_results(path: Path, cut_short: bool) -> dict:
    """What the child recorded: {"tests": the collected tests with their verdicts, "confinement"}.
    Raises GradingError if the run could not grade (the sandbox failed: not the learner's doing)."""
    recorded = {"tests": [], "confinement": None}
    if not path.is_file():
        return recorded
    collected, verdicts = [], {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut off by a crash
        if "collected" in entry:
            collected = entry["collected"]
        elif "confinement" in entry:
            recorded["confinement"] = entry["confinement"]
        elif "infrastructure" in entry:
            raise GradingError(f"the sandbox failed, so the submission was not graded: {entry['infrastructure']}")
        else:
            verdicts[entry["nodeid"]] = entry
    for test in collected:
        verdict = verdicts.get(test["nodeid"])
        if verdict is None:
            why = ("not run: the grading run hit its time limit or crashed before this test"
                   if cut_short else "not run")
            verdict = {"outcome": "failed", "message": why}
        recorded["tests"].append({**test, "outcome": verdict["outcome"], "message": verdict.get("message", "")})
    return recorded


# ---------------------------------------------------------------- scoring and reporting

def stage_verdicts(results: dict, marker: str) -> list[dict]:
    return [t for t in results["tests"] if t["marker"] == marker]


def stage_score(tests: list[dict], points: float) -> float:
    """points x (passed / counted); skipped tests (e.g. CUDA cases without a GPU) do not count."""
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    if not counted:
        return 0.0
    passed = sum(t["outcome"] == "passed" for t in counted)
    return round(points * passed / len(counted), 2)


def stage_report(marker: str, points: float, tests: list[dict]) -> str:
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    passed = [t for t in counted if t["outcome"] == "passed"]
    score = stage_score(tests, points)
    lines = [f"Stage {marker}: {len(passed)} of {len(counted)} checks pass -> {score:g} of {points:g} points"]
    shown = 0
    for t in tests:
        if t["outcome"] == "passed":
            lines.append(f"  PASS  {t['label']}")
        elif t["outcome"] == "failed":
            lines.append(f"  FAIL  {t['label']}")
            if shown < DETAILED_FAILURES:
                shown += 1
                message = t["message"].strip() or "the check failed (no message)"
                if len(message) > MESSAGE_LIMIT:
                    message = message[:MESSAGE_LIMIT] + " [...]"
                lines.extend("        " + m for m in message.splitlines())
        else:
            lines.append(f"  skip  {t['label']} ({t['message'].strip() or 'skipped'})")
    return "\n".join(lines)


# ---------------------------------------------------------------- the kernel side

_RESULTS: dict = {}


@contextlib.contextmanager
def _no_stderr():
    """Keep anything this process would write to stderr out of the cell's outputs."""
    sink = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stderr(sink):
            yield sink


def submission_folder() -> Path:
    """The autograded folder: nbgrader runs the notebook with it as the working directory."""
    return Path(os.getcwd()).resolve()


def submitted_twin(folder: Path) -> Path | None:
    """nbgrader's submitted/<student>/<assignment>/ folder of the autograded folder ``folder``, if any."""
    if len(folder.parents) < 3 or folder.parents[1].name != "autograded":
        return None
    submitted = folder.parents[2] / "submitted" / folder.parent.name / folder.name
    return submitted if submitted.is_dir() else None


def linked_modules(folder: Path) -> list[str]:
    """Stage modules of ``folder`` that are symbolic links (grading never follows them)."""
    return sorted(p.name for p in Path(folder).iterdir() if STAGE_MODULE.match(p.name) and p.is_symlink())


def symlinked_modules(folder: Path) -> list[str]:
    """Stage modules that arrived as symbolic links in nbgrader's submitted/ copy of this folder.

    nbgrader copies submitted/ into autograded/ following links, so a module linked to the
    solutions would arrive as a regular file; only the submitted/ copy tells.
    """
    submitted = submitted_twin(folder)
    return linked_modules(submitted) if submitted is not None else []


def graded_sources(folder: Path, linked: list[str] | None = None) -> dict[str, bytes]:
    """The stage modules grading runs: the folder's regular module files, and for each module that
    was submitted as a symbolic link (``linked``; default: the folder's own links) one that fails
    on import, saying so. The same for nbgrader's cells and for ``attnkit grade``."""
    sources = submission_sources(folder)
    for name in linked_modules(folder) if linked is None else linked:
        sources[name] = (f"raise ImportError('{name} was submitted as a symbolic link, not a file: "
                         "submit the module itself')\n").encode()
    return sources


LINK_NOTE = "This file was submitted as a symbolic link; what the link pointed at is not copied.\n"


def defuse_links(folder: Path) -> list[str]:
    """In nbgrader's autograded copy ``folder``, replace what came through a symbolic link of the
    submission with a short note; returns the paths replaced. nbgrader's copy follows links, and
    ``generate_feedback`` hands the autograded folder to the student: a link to the solutions (or
    any file of the grader's machine) would otherwise reach them."""
    submitted = submitted_twin(folder)
    if submitted is None:
        return []
    replaced = []
    for link in sorted(p for p in submitted.rglob("*") if p.is_symlink()):
        copy = folder / link.relative_to(submitted)
        if copy.is_dir() and not copy.is_symlink():
            shutil.rmtree(copy)
        elif copy.exists() or copy.is_symlink():
            copy.unlink()
        else:
            continue  # not copied (an ignored name)
        copy.write_text(LINK_NOTE)
        replaced.append(str(link.relative_to(submitted)))
    return replaced


def without_links(folder: Path, linked: list[str], work: Path) -> Path:
    """A copy of the folder's stage modules in which each linked one fails on import, saying why."""
    for name, data in graded_sources(folder, linked).items():
        (work / name).write_bytes(data)
    return work


def results_for(folder: Path, limits: Limits) -> dict:
    key = str(folder)
    if key not in _RESULTS:
        try:
            linked = symlinked_modules(folder)
            with contextlib.suppress(OSError):
                defuse_links(folder)  # before the feedback is made from this folder
            if linked:
                with scratch.Folder("unlinked") as work:
                    _RESULTS[key] = run_suite(without_links(folder, linked, work.path), limits=limits)
            else:
                _RESULTS[key] = run_suite(folder, limits=limits)
        except GradingError as exc:
            _RESULTS[key] = exc  # fail every stage cell the same way, without rerunning
        else:
            report = folder / "attnkit-grading.json"  # for the instructor's records, never read back
            with contextlib.suppress(OSError):
                report.write_text(json.dumps(_RESULTS[key], indent=1))
    if isinstance(_RESULTS[key], GradingError):
        raise _RESULTS[key]
    return _RESULTS[key]


def grade_stage(marker: str, points: float, test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None) -> float:
    """Print this stage's verdicts and return its score (the autograder cell's partial credit).
    ``test_timeout``: CPU seconds per check; ``time_budget``: for the whole submission."""
    with _no_stderr():
        results = results_for(submission_folder(), limits_of(test_timeout, time_budget))
        tests = stage_verdicts(results, marker)
        if not tests:
            raise GradingError(f"the suite has no graded tests for stage {marker!r}")
        report = stage_report(marker, points, tests)
        score = stage_score(tests, points)
    print(report)
    return score


# ---------------------------------------------------------------- pytest plugin (child side)

_record = {"file": None, "verdicts": {}, "infrastructure": None}


def _label(nodeid: str) -> str:
    parts = nodeid.split("::")[1:]
    return " / ".join(re.sub(r"^test_?", "", p).replace("_", " ") for p in parts)


def _item_entry(nodeid: str) -> dict | None:
    match = STAGE_FILE.search(nodeid.split("::")[0])
    if not match:
        return None
    return {"nodeid": nodeid, "stage": f"{match.group(1)}_{match.group(2)}", "marker": match.group(2),
            "label": _label(nodeid)}


def _write(entry: dict):
    if _record["file"] is not None:
        _record["file"].write(json.dumps(entry) + "\n")
        _record["file"].flush()


RECORDED_CHARS = 8000  # of one failure message, kept in the record (a learner's exception can be huge)


def _message(report) -> str:
    message = _full_message(report)
    return message if len(message) <= RECORDED_CHARS else message[:RECORDED_CHARS] + " [...]"


def _full_message(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skips: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return re.sub(r"^(AssertionError|Failed|adapters\.SubmissionError|grader\.\w+\.\w+Error): ", "", crash.message)
    return str(longrepr).strip().splitlines()[-1] if str(longrepr).strip() else ""


def pytest_load_initial_conftests(early_config, parser, args):
    """A grading run (--isolate) starts its sandbox first thing: the template's import of torch then
    overlaps pytest's own (the suite's conftest imports torch as it loads)."""
    if "--isolate" in args and getattr(early_config, "attnkit_sandbox", None) is None:
        from .sandbox import Sandbox

        early_config.attnkit_sandbox = Sandbox()
        early_config.attnkit_sandbox.start_soon()
        early_config.add_cleanup(early_config.attnkit_sandbox.close)


def pytest_configure(config):
    path = os.environ.get(RESULTS_ENV)
    if path:
        _record["file"] = open(path, "a", encoding="utf-8")


def pytest_collection_finish(session):
    entries = [e for e in (_item_entry(item.nodeid) for item in session.items) if e]
    _write({"collected": entries})


def pytest_runtest_logreport(report):
    verdicts = _record["verdicts"]
    state = verdicts.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed and state["outcome"] != "failed":
        state.update(outcome="failed", message=_message(report))
    elif report.skipped and state["outcome"] == "passed":
        state.update(outcome="skipped", message=_message(report))
    if report.when == "teardown":
        _write({"nodeid": report.nodeid, **verdicts.pop(report.nodeid)})


def pytest_runtest_makereport(item, call):
    """A sandbox that cannot start is no failure of the learner's: record it and stop; the run then
    grades nothing (``read_results`` raises GradingError) instead of failing every check."""
    if call.excinfo is not None and call.excinfo.typename == "SandboxUnavailable" and not _record["infrastructure"]:
        _record["infrastructure"] = str(call.excinfo.value)
        _write({"infrastructure": _record["infrastructure"]})
        item.session.shouldstop = "the sandbox failed"


def pytest_sessionfinish(session):
    confinement = getattr(session.config, "attnkit_confinement", None)
    if confinement is not None:
        _write({"confinement": confinement})


def pytest_unconfigure(config):
    if _record["file"] is not None:
        _record["file"].close()
        _record["file"] = None
