"""Each check's time limit, in words a student understands; a stage's other checks fail at once after one hit it."""
from __future__ import annotations

import re

import pytest

from suite_runtime.stage_names import stage_of

# ---------------------------------------------------------------- time limits
#
# Each check has a time limit (pytest-timeout's `timeout`: the course's test_timeout in a release's
# pytest.ini, `-o timeout=...` when grading). A check that runs past it is stopped and fails; this
# section says so in words a student understands, and lets the rest of that stage's checks fail at
# once instead of each waiting out the limit again.

PYTEST_TIMEOUT = re.compile(r"Timeout \(>([0-9.]+)s\) from pytest-timeout")
TIME_LIMIT = re.compile(r"time limit|pytest-timeout")  # our wording, pytest-timeout's and the grading sandbox's
NOT_RUN = "not run: an earlier check of this stage hit the time limit"
OUT_OF_TIME = pytest.StashKey[set]()  # stages (sNN_topic) with a check that hit the time limit in this run


def stages_out_of_time(config) -> set:
    return config.stash.setdefault(OUT_OF_TIME, set())


def time_limit_message(stage, seconds) -> str:
    """What a student reads when a check of ``stage`` was stopped at the time limit."""
    return (
        f"stage {stage}: this check was stopped after {seconds:g} s (the time limit per check): look for a loop "
        f"that never ends in {stage}.py or a module it imports (a `while` whose condition never becomes false, "
        "a loop at the top of the module), or for very slow code (keep the work in vectorized torch operations)."
    )


def _limit_per_check(config):
    """Seconds per check (pytest-timeout's --timeout or ini ``timeout``), or None without a limit."""
    try:
        return float(config.getoption("timeout", None) or config.getini("timeout") or 0) or None
    except (ValueError, TypeError):  # pytest-timeout not installed, or an unreadable value
        return None


def note_time_limit(item, report) -> bool:
    """Called for every failed report. When the check ran out of time, remember its stage, and word
    pytest-timeout's message for the student, in the crash message too (grading feedback and -rf
    summaries show only that line). True when the failure is fully explained here (pytest-timeout's
    stop, or a check not run because of an earlier one), so no other hint applies."""
    stage = stage_of(item.nodeid)
    if stage is None:
        return False  # the kit's own tests keep pytest-timeout's message
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    limit = _limit_per_check(item.config)
    # A check that took the whole limit counts too: its code may have swallowed pytest-timeout's
    # exception (a bare `except:`) and failed some other way afterwards.
    if not (TIME_LIMIT.search(text) or (limit and report.when == "call" and report.duration >= 0.9 * limit)):
        return False
    stages_out_of_time(item.config).add(stage)
    stopped = PYTEST_TIMEOUT.search(text)
    if stopped:
        message = time_limit_message(stage, float(stopped.group(1)))
        if crash is not None:
            crash.message = message
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("Time limit", message + "\nThe traceback above ends at the line that was "
                                       "running when the check was stopped.")
        return True
    return NOT_RUN in text


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """After a check of a stage hit the time limit, its other checks fail at once. A module that
    loops at import would otherwise cost the limit once per check: a failed import is not cached."""
    if stage_of(item.nodeid) in stages_out_of_time(item.config) and not _skipped_by_marks(item):
        pytest.fail(NOT_RUN, pytrace=False)


def _skipped_by_marks(item) -> bool:
    """Whether pytest skips ``item`` by its marks (a CUDA case without CUDA): it stays skipped, not failed,
    so that it counts for nothing either way. (This hook runs before pytest's own skipping hook.)"""
    return any(mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0] is True)
               for mark in item.iter_markers())
