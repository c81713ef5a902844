"""The notebook's demo and check cells: what a student's notebook calls (``notebook_tools.py`` in their folder).

The course build copies this file into every release beside the notebook, whose setup cell imports it from
there and calls ``setup`` with the course's time limit. ``demo`` runs a stage's demo in the kernel with the
student's modules as they are now, for at most the time limit (a SIGALRM timer: an endless loop ends in a
message, not a hung kernel); ``check`` runs the stage's public tests in a subprocess, where pytest.ini sets the
same limit per check, with a backstop on the whole run (``CHECKS_TIME_LIMIT``).

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
import traceback

GRADING = bool(os.environ.get("NBGRADER_EXECUTION"))
TIME_LIMIT = 10.0  # seconds: a demo, or one check, still running then is stopped (the course's: ``setup``)
# A backstop for check(), in case a check's own limit cannot fire: pytest's start, the stage's checks
# and one that runs out of time fit well within this.
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


def _stop(signum, frame):
    raise TimeLimitReached


def _line_reached(exc):
    """Where in a stage module the code was when it was stopped, as words ('' if not in one)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if STAGE_MODULE.fullmatch(os.path.splitext(os.path.basename(f.filename))[0])]
    if not frames:
        return ""
    return f" It was stopped on line {frames[-1].lineno} of {os.path.basename(frames[-1].filename)}."


def demo(stage):
    """Run a stage's demo (a decorator: `@demo(STAGE_MODULE_NAME)`) with your modules as they are
    now, for at most TIME_LIMIT seconds. A TODO not yet written, or a demo that runs out of time, is
    reported, not raised."""
    def run(show):
        if GRADING:
            return
        # torch before the clock starts: its first import takes seconds, and an import cut short
        # leaves it broken until the kernel restarts.
        import torch  # noqa: F401
        # Your modules afresh, inside the time limit (an edited module runs again on import).
        for name in [n for n in sys.modules if STAGE_MODULE.fullmatch(n)]:
            del sys.modules[name]
        importlib.invalidate_caches()
        # Without SIGALRM (Windows), or off the main thread (signals reach only that one), no limit.
        timed = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGALRM, _stop) if timed else None
        try:
            try:
                if timed:  # and again every second, should the code under test catch the first stop
                    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT, 1)
                show()
            finally:
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except NotImplementedError as exc:
            print(f"Not written yet: {exc}")
        except TimeLimitReached as exc:
            print(f"Stage {stage}: the demo was stopped after {TIME_LIMIT:g} s (the time limit): look for a loop "
                  f"that never ends in {stage}.py or a module it imports (a `while` whose condition never "
                  f"becomes false, a loop at the top of the module), or for very slow code.{_line_reached(exc)}")
        finally:
            if timed:
                signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
    return run


def check(stage_marker):
    """Run the public tests of one stage against your modules (same as `pytest -m STAGE`). Each check
    has TIME_LIMIT seconds (pytest.ini); all of them together CHECKS_TIME_LIMIT."""
    if GRADING:
        return
    command = [sys.executable, "-m", "pytest", "-q", "--no-header", "--color=no", "-p", "no:cacheprovider",
               "-m", stage_marker]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=CHECKS_TIME_LIMIT,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        if output.strip():
            print(output[-3000:])
        print(f"Stage {stage_marker}: the checks were stopped after {CHECKS_TIME_LIMIT:g} s (the time limit for "
              "one stage's checks): look for a loop that never ends, or very slow code, in that stage's module.")
        return
    print((run.stdout + run.stderr)[-6000:])
