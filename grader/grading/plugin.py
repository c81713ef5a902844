"""The pytest plugin that makes a run of the graded suite a grading run.

One ``GradingPlugin`` object is handed to ``pytest.main`` by a grading worker (``grader.grading.worker``).
It answers the suite's ``pytest_attnkit_backend`` hook with an ``IsolatedBackend``: the learner's
modules run in boxes of the worker's sandbox, never in this process, each stage beside the reference
versions of the stages it builds on (the kit's solutions/), so that a mistake costs points once. It
starts each check's time limit once the check's fixtures are set up, and it records a verdict per
check: the outcome, the failure (or skip) message a student may read, and the sandbox limit the check ran into
(the ``limit`` the backend set on the error it raised). Verdicts, like every other conclusion, are drawn here,
in the trusted process.
"""
from __future__ import annotations

import re

import pytest

from suite_runtime.stage_names import stage_of

from ..kit import SOLUTIONS
from ..sandbox.backend import IsolatedBackend, reference_imports
from ..sandbox.confinement import ConfinementRecord
from ..sandbox.limits import Limit, Limits
from ..sandbox.template import Sandbox
from . import faults
from .contracts import Check, Ran, Verdict
from .scoring import check_entry

RECORDED_CHARS = 8000  # of one failure message, kept in the record (a learner's exception can be huge)
NOT_RUN = "not run: the grading run stopped before this test"


class GradingPlugin:
    """Runs the suite's implementation in ``sandbox`` (None: in this process, for measurements only)
    within ``limits``, and records what each check of the current submission gave."""

    def __init__(self, limits: Limits, sandbox: Sandbox | None):
        self.limits, self.sandbox = limits, sandbox
        # What each stage is run beside, read once for every submission this session grades.
        self.provided = reference_imports(SOLUTIONS)
        self.ceilings: dict[str, int] = {}  # stage -> the MEMORY_HEADROOM its test module declares
        self.checks: list[Check] = []  # every collected check of a stage, in order
        self.collection_errors: list[str] = []
        self._stage_checks: dict[str, list[str]] = {}  # stage -> the nodeids of its checks (asked once per stage)
        self.fault = faults.from_environment()  # a failure of the grader's own to make, for the kit's tests
        self.begin()

    def begin(self, stages=None):
        """A new submission, graded on ``stages`` (stage modules; None: every stage): nothing recorded yet."""
        self.stages = None if stages is None else frozenset(stages)
        self.backend: IsolatedBackend | None = None
        self.implementations = 0  # how often the suite asked for the implementation (once per submission)
        self.outcomes: dict[str, Ran] = {}  # nodeid -> what each check run so far gave
        self.timed_out: set[str] = set()  # stages with a check that ran into its time limit
        self.output_capped: list[str] = []  # checks during which the learner's output was cut
        self.infrastructure: str | None = None  # why the grader could not grade (its own failure), if it could not
        self._dropped = 0
        if self.fault is not None:
            self.fault.begin()

    def grades(self, nodeid: str) -> bool:
        """Whether the test ``nodeid`` is a check of a stage the current submission is graded on."""
        stage = stage_of(nodeid)
        return stage is not None and (self.stages is None or stage in self.stages)

    def verdicts(self) -> list[Verdict]:
        """Every check of the graded stages with its verdict; a check that did not run has failed. A check that
        hit no limit but during which the learner's output was cut is marked so (limit "output")."""
        missing: Ran = {"outcome": "failed", "message": NOT_RUN, "limit": None, "mistakes": []}
        found: list[Verdict] = []
        for check in self.checks:
            if self.grades(check["nodeid"]):
                verdict: Verdict = {**check, **self.outcomes.get(check["nodeid"], missing)}
                capped = check["nodeid"] in self.output_capped and verdict["outcome"] != "skipped"
                if verdict["limit"] is None and capped:
                    verdict["limit"] = "output"
                found.append(verdict)
        return found

    @property
    def confinement(self) -> ConfinementRecord | None:
        """How the learner's code is kept apart (``grader.sandbox.confinement.Confinement.record()``)."""
        if self.fault is not None:
            self.fault.at_start()
        return self.sandbox.start().record() if self.sandbox is not None else None

    # -- the suite's hook

    @pytest.hookimpl
    def pytest_attnkit_backend(self, config, root):
        self.implementations += 1
        if self.sandbox is None:
            return None
        self.backend = IsolatedBackend(root, self.limits, sandbox=self.sandbox, provided=self.provided,
                                       ceilings=self.ceilings, passed=self.stage_passed)
        return self.backend

    def stage_passed(self, stage: str) -> bool:
        """Whether every check of ``stage`` this submission is graded on has run and passed (a skipped one aside):
        a stage built on it then meets the learner's own module of it (grader.sandbox.backend)."""
        checks = self._stage_checks.get(stage, []) if self.stages is None or stage in self.stages else []
        outcomes = [self.outcomes[nodeid]["outcome"] if nodeid in self.outcomes else None for nodeid in checks]
        return "passed" in outcomes and all(outcome in ("passed", "skipped") for outcome in outcomes)

    # -- pytest's hooks

    def pytest_configure(self, config):
        """A verdict keeps a failure's message, not its traceback: formatting each failed check's
        traceback with source (pytest's default without its terminal) would be most of a grading
        worker's time on a class of stubs. (``--tb`` belongs to the terminal plugin, which grading
        goes without; this is the option it would set.)"""
        config.option.tbstyle = "no"

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(f"{report.nodeid}: {report.longrepr}")

    def pytest_collection_finish(self, session):
        self.checks = [entry for entry in map(check_entry, (item.nodeid for item in session.items)) if entry]
        self._stage_checks = {}
        for check in self.checks:
            stage = stage_of(check["nodeid"])
            if stage is not None:
                self._stage_checks.setdefault(stage, []).append(check["nodeid"])
        # A stage's test module may declare how much memory the stage may allocate when graded (the
        # sandbox holds its worker to it): the suite's word, read here in the trusted process.
        for item in session.items:
            stage, headroom = stage_of(item.nodeid), getattr(getattr(item, "module", None), "MEMORY_HEADROOM", None)
            if stage and isinstance(headroom, int) and headroom > 0:
                self.ceilings[stage] = headroom

    def pytest_runtest_logstart(self, nodeid, location):
        self._dropped = self.sandbox.dropped_output if self.sandbox is not None else 0

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        """Each test is one check: its time limit counts from here, once its fixtures are set up
        (starting a box is not the learner's time)."""
        if self.backend is not None and "impl" in item.fixturenames:
            self.backend.start_check()
            if self.fault is not None:
                self.fault.at_check(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        """The limit the check ran into: the one the sandbox set on the error the check failed with (an error
        the test caught and diagnosed itself is the test's failure, not the limit's). A check the suite failed
        before its call because an earlier check of its stage hit the time limit hit it too. A failure of the
        grader's own (a sandbox that cannot serve, a reference or fixture that fails: ``_grader_failure``) is no
        failure of the learner's: record it and stop, so that the submission is not graded at all rather than
        failed check by check."""
        report = yield
        broke = self._grader_failure(item, call) if call.excinfo is not None and not self.infrastructure else None
        if not broke and not self.infrastructure and self.backend is not None and self.backend.infrastructure:
            broke = f"SandboxUnavailable: {self.backend.infrastructure}"  # (raised where the suite caught it)
        if broke:
            self.infrastructure = broke
            item.session.shouldstop = "the grader failed"
        limit: Limit | None = getattr(call.excinfo.value, "limit", None) if call.excinfo is not None else None
        stage = stage_of(item.nodeid)  # (a check of a stage: grading runs no other test)
        if report.failed and limit is None and call.when == "setup" and stage in self.timed_out:
            limit = "time"
        if report.failed and limit == "time" and stage is not None:
            self.timed_out.add(stage)
        report.attnkit_limit = limit
        return report

    def _grader_failure(self, item, call) -> str | None:
        """Why the check ``item`` says nothing about the learner's work, or None when it does. Learner code runs
        only in boxes, so a check fails for the learner's doing in three ways only: a comparison of the suite's
        (AssertionError), a stop the suite or the sandbox decided (pytest's fail, skip), or an error the sandbox
        reports from the box (the suite's SubmissionError). Anything else was raised by the trusted side: the
        sandbox could not serve (SandboxUnavailable), the reference or a fixture failed, the suite has a bug."""
        excinfo = call.excinfo
        if self.sandbox is None or excinfo.errisinstance(self._learners_failures):
            return None
        where = excinfo.traceback[-1] if excinfo.traceback else None
        said = f"{excinfo.typename}: {str(excinfo.value)[:2000]}"
        if excinfo.typename == "SandboxUnavailable":
            return said
        if _raised_by_the_check_itself(item, excinfo):
            return None  # (the check could not use what the learner's code returned: a float for an array, say)
        return (f"the check {item.nodeid} itself failed ({call.when}), not the learner's code: {said}"
                + (f" (at {where.path}:{where.lineno + 1})" if where is not None else ""))

    @property
    def _learners_failures(self) -> tuple:
        from suite_runtime.adapters import SubmissionError  # (imports torch: this plugin's user has it already)

        return (AssertionError, SubmissionError, pytest.fail.Exception, pytest.skip.Exception, pytest.xfail.Exception)

    def pytest_runtest_logreport(self, report):
        state = self.outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": "", "limit": None,
                                                         "mistakes": []})
        if report.failed and state["outcome"] != "failed":
            state.update({"outcome": "failed", "message": _message(report),
                          "limit": getattr(report, "attnkit_limit", None), "mistakes": _mistakes(report)})
        elif report.skipped and state["outcome"] == "passed":
            state.update({"outcome": "skipped", "message": _message(report)})

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.sandbox is not None and self.sandbox.dropped_output > self._dropped:
            self.output_capped.append(nodeid)


def _raised_by_the_check_itself(item, excinfo) -> bool:
    """Whether the innermost frame of the kit's own code that raised is the check's own test function's file (the
    library it called there, NumPy or torch, may have raised under it): the check met a value of the learner's it
    could not use (``out.mean()`` on a float). Raised deeper in the kit (the reference, a fixture, the diagnosis,
    the sandbox, the grader) it is the grader's failure."""
    test_file = str(item.path)
    for entry in reversed(excinfo.traceback):
        path = str(entry.path)
        if path == test_file:
            return True
        if "site-packages" not in path and not path.startswith("<"):
            return False  # (the kit's own code, or the Python library's, below the check)
    return False


def _mistakes(report) -> list[str]:
    """What the suite's diagnosis found for a failed check (its report's findings, diagnosis.FindingRecord), in
    words; each is capped like a message (its words come from the kit, its numbers from the learner's code)."""
    found = getattr(report, "attnkit_findings", None) or []
    return [str(f.get("text", ""))[:RECORDED_CHARS] for f in found if isinstance(f, dict) and f.get("text")]


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
        return re.sub(r"^(AssertionError|Failed|(suite_runtime\.)?adapters\.SubmissionError|grader\.\w+\.\w+Error): ",
                      "", crash.message)
    return str(longrepr).strip().splitlines()[-1] if str(longrepr).strip() else ""
