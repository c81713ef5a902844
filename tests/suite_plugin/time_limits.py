"""Each check's time limit: the learner's own work, counted in CPU time, whatever the machine's load; worded for a
student; a stage's other checks fail at once after one hit it."""
from __future__ import annotations

import _thread
import os
import re
import signal
import threading
import time

import pytest

from suite_runtime.stage_names import stage_of

# ---------------------------------------------------------------- time limits
#
# A release's pytest.ini gives each check the course's time limit (``check_time_limit``, the root conftest's option;
# ``--check-time-limit`` on the command line): that many seconds of CPU time of this process (every thread's), as the
# grader counts a check's (grader/sandbox/limits.py). A check that waits (sleeps, reads input, waits on a lock) is
# stopped once it has waited WAIT_FACTOR times that: wall-clock time less the time this process's threads were ready
# to run but waited for a processor. A busy machine slows a check down but does not stop it: a correct FlexAttention
# stage, whose first call costs 3.5 s of CPU time, passes at any load. A check still running at its limit is stopped
# where it is and fails; this section says so in words a student understands, and lets the rest of that stage's
# checks fail at once instead of each waiting out the limit again. (pytest-timeout's wall-clock ``timeout``, which
# the kit's own tests use, is worded the same way.)

WAIT_FACTOR = 5  # a check may wait this many times its CPU limit (as when graded: WALL_FACTOR in grader/sandbox)
REPEAT_SECONDS = 1.0  # a check whose code caught the stop is stopped again this often
PYTEST_TIMEOUT = re.compile(r"Timeout \(>([0-9.]+)s\) from pytest-timeout")
TIME_LIMIT = re.compile(r"time limit|pytest-timeout")  # our wording, pytest-timeout's and the grading sandbox's
NOT_RUN = "not run: an earlier check of this stage hit the time limit"
OUT_OF_TIME = pytest.StashKey[set]()  # stages (sNN_topic) with a check that hit the time limit in this run
CLOCK = pytest.StashKey["CheckClock"]()  # the clock of a check that ran under a limit


def stages_out_of_time(config) -> set:
    return config.stash.setdefault(OUT_OF_TIME, set())


def time_limit_message(stage, seconds, how="cpu") -> str:
    """What a student reads when a check of ``stage`` was stopped at its time limit of ``seconds``: ``how`` it was
    counted, "cpu" (CPU time), "waiting" (WAIT_FACTOR times it of waiting) or "wall" (pytest-timeout's)."""
    if how == "waiting":
        return (f"stage {stage}: this check was stopped after waiting {WAIT_FACTOR * seconds:g} s ({WAIT_FACTOR} x "
                f"the time limit per check): look for time.sleep, input() or a lock that is never released in "
                f"{stage}.py or a module it imports.")
    return (
        f"stage {stage}: this check was stopped after {seconds:g} s{' of CPU time' * (how == 'cpu')} (the time limit "
        f"per check): look for a loop that never ends in {stage}.py or a module it imports (a `while` whose condition "
        "never becomes false, a loop at the top of the module), or for very slow code (keep the work in vectorized "
        "torch operations)."
    )


def check_time_limit(config) -> float | None:
    """CPU seconds per check (``--check-time-limit``, or the ini option ``check_time_limit``), None for no limit."""
    try:
        return float(config.getoption("check_time_limit", None) or config.getini("check_time_limit") or 0) or None
    except (ValueError, TypeError):
        raise pytest.UsageError("check_time_limit: expected a number of seconds") from None


def run_delay() -> float:
    """Seconds this process's living threads have waited on a run queue (Linux's schedstat; 0 elsewhere)."""
    total = 0.0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return total


class CheckClock:
    """One check's time limit while the block runs (in the main thread): ``limit`` seconds of CPU time, and
    WAIT_FACTOR times that of waiting (see above). At either, the check fails where its code is (pytest.fail, raised
    in a signal handler of the main thread), and again every REPEAT_SECONDS should its code catch that.

    Where the kernel has interval timers (Linux, macOS), ITIMER_PROF counts the CPU time and signals (SIGPROF) when it
    is spent, and a watchdog thread that sleeps until the waiting may be spent signals the main thread then. Elsewhere
    (Windows: ``threaded``) the watchdog reads both clocks and interrupts the main thread (SIGINT, handled here)."""

    def __init__(self, stage: str, limit: float, threaded: bool | None = None):
        self.stage, self.limit, self.wait_limit = stage, limit, WAIT_FACTOR * limit
        self.threaded = not hasattr(signal, "setitimer") if threaded is None else threaded
        self.signal = signal.SIGINT if self.threaded else signal.SIGPROF
        self.stopped: str | None = None  # "cpu" or "waiting", once the check was stopped
        self._previous = None
        self._done = threading.Event()

    @property
    def message(self) -> str:
        return time_limit_message(self.stage, self.limit, how=self.stopped or "cpu")

    def waited(self) -> float:
        return time.monotonic() - self._started - (run_delay() - self._delayed)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # (signals reach the main thread only: no limit here)
        self._started, self._delayed, self._cpu = time.monotonic(), run_delay(), time.process_time()
        self._previous = signal.signal(self.signal, self._expired)
        if not self.threaded:
            signal.setitimer(signal.ITIMER_PROF, self.limit, REPEAT_SECONDS)
        threading.Thread(target=self._watch, daemon=True, name="check-time-limit").start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        if self._previous is not None:
            if not self.threaded:
                signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(self.signal, self._previous)

    def _expired(self, signum, frame):
        if self._done.is_set():
            return
        self.stopped = self.stopped or "cpu"  # (the watchdog says "waiting" before it signals)
        pytest.fail(self.message)

    def _watch(self):
        main = threading.main_thread().ident
        pause = 0.1 if self.threaded else self.wait_limit
        while not self._done.wait(pause):
            if self.stopped is None:
                if self.threaded and time.process_time() - self._cpu >= self.limit:
                    self.stopped = "cpu"
                elif self.waited() >= self.wait_limit:
                    self.stopped = "waiting"
                elif not self.threaded:  # the machine kept the check waiting for a processor: not its time
                    pause = max(self.wait_limit - self.waited(), 0.01)
                    continue
            if self.stopped is not None:
                pause = REPEAT_SECONDS
                if hasattr(signal, "pthread_kill"):  # (a signal wakes the main thread from a sleep or a wait)
                    signal.pthread_kill(main, self.signal)
                else:  # Windows: a SIGINT as Ctrl-C makes it, which ends time.sleep there too
                    _thread.interrupt_main(signal.SIGINT)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A stage's check runs under its time limit (its fixtures are set up: the clock counts the check's own work).
    The limit counts CPU time: torch computes with one thread, as when graded (a pool of a thread per core spins
    while it waits, CPU time the check's work does not need)."""
    stage, limit = stage_of(item.nodeid), check_time_limit(item.config)
    if stage is None or limit is None:
        return (yield)
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    with CheckClock(stage, limit) as clock:
        item.stash[CLOCK] = clock
        return (yield)


def note_time_limit(item, report) -> bool:
    """Called for every failed report. When the check ran out of time, remember its stage, and word the stop for
    the student, in the crash message too (grading feedback and -rf summaries show only that line). True when the
    failure is fully explained here (a stop at the time limit, or a check not run because of an earlier one), so no
    other hint applies."""
    stage = stage_of(item.nodeid)
    if stage is None:
        return False  # the kit's own tests keep pytest-timeout's message
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    clock = item.stash.get(CLOCK, None) if report.when == "call" else None
    # A check whose clock stopped it counts, whatever it failed with: its code may have caught the stop (a bare
    # `except:`) and failed some other way afterwards.
    stopped = PYTEST_TIMEOUT.search(text)
    if clock is not None and clock.stopped:
        message = clock.message
    elif stopped:
        message = time_limit_message(stage, float(stopped.group(1)), how="wall")
    else:
        if TIME_LIMIT.search(text):  # (the grading sandbox's stop, worded there)
            stages_out_of_time(item.config).add(stage)
        return NOT_RUN in text
    stages_out_of_time(item.config).add(stage)
    if crash is not None:
        crash.message = message
    if hasattr(report.longrepr, "addsection"):
        report.longrepr.addsection("Time limit", message + "\nThe traceback above ends at the line that was "
                                   "running when the check was stopped.")
    return True


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
