"""The notebook's demo and check cells: what a student's notebook calls (``notebook_tools.py`` in their folder).

The course build copies this file into every release beside the notebook, whose setup cell imports it from
there and calls ``setup`` with the course's time limit. ``demo`` runs a stage's demo in the kernel with the
student's modules as they are now, for at most the time limit in CPU time, and WAIT_FACTOR times that of waiting
(wall-clock time less the time the kernel waited for a processor: a busy machine does not stop a demo), so that an
endless loop ends in a message, not a hung kernel; ``check`` runs the stage's public tests in a subprocess, where
pytest.ini sets the same limit per check, with a backstop on the whole run (``CHECKS_TIME_LIMIT`` of waiting).

When nbgrader executes a notebook to grade it (it sets NBGRADER_EXECUTION), the setup cell does not import this
file at all (nothing of a submission's folder is imported into the grading kernel), and demo and check do
nothing here either. Standard library only: the kernel may not have torch installed yet (``setup`` says so).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

GRADING = bool(os.environ.get("NBGRADER_EXECUTION"))
TIME_LIMIT = 10.0  # CPU seconds: a demo, or one check, still running then is stopped (the course's: ``setup``)
WAIT_FACTOR = 5  # a demo may wait this many times TIME_LIMIT (sleeping, input(), a lock), as a check may
# A backstop for check(), in case a check's own limit cannot fire: pytest's start, the stage's checks
# and one that runs out of time fit well within this much waiting.
CHECKS_TIME_LIMIT = 60 + 3 * TIME_LIMIT
STAGE_MODULE = re.compile(r"[a-z]\d\d_\w+")  # a stage module's name (the setup cell gives the kit's)


def setup(time_limit=None, checks_time_limit=None, stage_module=None, packages=()):
    """The course's settings (the notebook's setup cell passes them): the time limit of a demo and of one check
    (seconds), the backstop of a stage's checks (default: 60 + 3 x the time limit), what a stage module is
    called; and the packages the notebook needs, of which it names those this kernel lacks."""
    global TIME_LIMIT, CHECKS_TIME_LIMIT, STAGE_MODULE
    if time_limit is not None:
        TIME_LIMIT = float(time_limit)
        CHECKS_TIME_LIMIT = 60 + 3 * TIME_LIMIT
    if checks_time_limit is not None:
        CHECKS_TIME_LIMIT = float(checks_time_limit)
    if stage_module is not None:
        STAGE_MODULE = re.compile(stage_module)
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing and not GRADING:
        print(f"Not installed for this kernel: {', '.join(missing)}. Run `%pip install -r requirements.txt` "
              "in a cell (or `pip install -r requirements.txt` in a terminal), then restart the kernel.")


class TimeLimitReached(BaseException):
    """Stops a demo at the time limit. Not an Exception: an `except Exception` in the code being run
    does not catch it."""


def run_delay(pid="self") -> float:
    """Seconds the threads of process ``pid`` have waited for a processor (Linux's schedstat; 0 elsewhere)."""
    total = 0.0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return total


class DemoClock:
    """TIME_LIMIT seconds of the kernel's CPU time (ITIMER_PROF, SIGPROF) and WAIT_FACTOR times that of waiting
    (ITIMER_REAL, SIGALRM: wall-clock time less the time the kernel waited for a processor, checked when the alarm
    rings) while the block runs; at either, TimeLimitReached where the code is, and again every second should the
    code catch it. Without interval timers (Windows), or off the main thread (signals reach only that one), no limit."""

    def __init__(self):
        self.timed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        self.stopped = None  # "cpu" or "waiting"
        self.previous = {}

    def __enter__(self):
        if self.timed:
            self.previous = {number: signal.signal(number, self._expired)
                             for number in (signal.SIGPROF, signal.SIGALRM)}
            self.started, self.delayed = time.monotonic(), run_delay()
            signal.setitimer(signal.ITIMER_PROF, TIME_LIMIT, 1)
            signal.setitimer(signal.ITIMER_REAL, WAIT_FACTOR * TIME_LIMIT)
        return self

    def __exit__(self, *exc):
        if self.timed:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
            for number, handler in self.previous.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)

    def _expired(self, signum, frame):
        if signum == signal.SIGALRM and self.stopped is None:
            left = WAIT_FACTOR * TIME_LIMIT - (time.monotonic() - self.started - (run_delay() - self.delayed))
            if left > 0:  # the machine kept the kernel waiting for a processor: not the demo's time
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.01))
                return
            signal.setitimer(signal.ITIMER_REAL, 1)
        self.stopped = self.stopped or ("cpu" if signum == signal.SIGPROF else "waiting")
        raise TimeLimitReached

    def said(self) -> str:
        if self.stopped == "waiting":
            return (f"after waiting {WAIT_FACTOR * TIME_LIMIT:g} s ({WAIT_FACTOR} x the time limit: time.sleep, "
                    "input()?)")
        return f"after {TIME_LIMIT:g} s of CPU time (the time limit)"


def _line_reached(exc):
    """Where in a stage module the code was when it was stopped, as words ('' if not in one)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if STAGE_MODULE.fullmatch(os.path.splitext(os.path.basename(f.filename))[0])]
    if not frames:
        return ""
    return f" It was stopped on line {frames[-1].lineno} of {os.path.basename(frames[-1].filename)}."


def demo(stage):
    """Run a stage's demo (a decorator: `@demo(STAGE_MODULE_NAME)`) with your modules as they are
    now, for at most TIME_LIMIT seconds of CPU time. A TODO not yet written, or a demo that runs out of time, is
    reported, not raised."""
    def run(show):
        if GRADING:
            return
        # torch before the clock starts: its first import takes seconds, and an import cut short
        # leaves it broken until the kernel restarts.
        import torch
        # Your modules afresh, inside the time limit (an edited module runs again on import).
        for name in [n for n in sys.modules if STAGE_MODULE.fullmatch(n)]:
            del sys.modules[name]
        importlib.invalidate_caches()
        threads = torch.get_num_threads()
        clock = DemoClock()
        try:
            torch.set_num_threads(1)  # (CPU time is what the limit counts: idle threads of a pool spin)
            with clock:
                show()
        except NotImplementedError as exc:
            print(f"Not written yet: {exc}")
        except TimeLimitReached as exc:
            print(f"Stage {stage}: the demo was stopped {clock.said()}: look for a loop "
                  f"that never ends in {stage}.py or a module it imports (a `while` whose condition never "
                  f"becomes false, a loop at the top of the module), or for very slow code.{_line_reached(exc)}")
        finally:
            torch.set_num_threads(threads)
    return run


def check(stage_marker):
    """Run the public tests of one stage against your modules (same as `pytest -m STAGE`). Each check
    has TIME_LIMIT seconds of CPU time (pytest.ini); all of them together CHECKS_TIME_LIMIT seconds of waiting."""
    if GRADING:
        return
    command = [sys.executable, "-m", "pytest", "-q", "--no-header", "--color=no", "-p", "no:cacheprovider",
               "-m", stage_marker]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1")) as run:
        output = []
        reader = threading.Thread(target=lambda: output.append(run.stdout.read()), daemon=True)
        reader.start()
        started, delayed = time.monotonic(), 0.0
        while run.poll() is None:  # (its threads' waits for a processor are the machine's load, not the run's)
            delayed = max(delayed, run_delay(run.pid))
            if time.monotonic() - started - delayed >= CHECKS_TIME_LIMIT:
                run.kill()
                run.wait()
                reader.join(5)
                said = "".join(output)
                if said.strip():
                    print(said[-3000:])
                print(f"Stage {stage_marker}: the checks were stopped after {CHECKS_TIME_LIMIT:g} s (the time limit "
                      "for one stage's checks): look for a loop that never ends, or very slow code, in that stage's "
                      "module.")
                return
            time.sleep(0.1)
        reader.join()
    print("".join(output)[-6000:])
