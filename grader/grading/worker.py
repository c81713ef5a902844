"""A grading worker: one pytest session of the graded suite that grades submission after submission.

    trusted side (WorkerProcess)             worker process (python -m grader.grading.worker)
    ----------------------------             ----------------------------------------
    start the process                  -->   import torch and pytest, start the sandbox,
                                             collect the suite once
                                       <--   {"ready", "confinement"}
    job: {"sources", "seed"}           -->   write the sources into its staging folder, run
                                             every collected check again (GradingPlugin)
                                       <--   {"tests": verdicts, "output_capped", ...}
    (another job, or close)

Both ``attnkit grade`` (many jobs per worker, grader.grading.dispatch) and nbgrader's autograder cells (one
job, grader.course.cells) grade through it, so a submission is graded the same way wherever it is graded.
The learner's code runs only in the worker's sandbox: one template per worker, a box of its own
for every submission, killed with it (grader.sandbox).

The session is an ordinary ``pytest.main`` run; ``JobLoop`` replaces its test loop through the
public ``pytest_runtestloop`` hook and runs the collected items once per job through
``pytest_runtest_protocol``, as pytest's own loop does. After a job's last check (``nextitem``
None) pytest tears the session's fixtures down, so the next job sets up its own implementation.
A job in which that did not happen exactly once is answered with an error instead of grades.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, cast

import pytest

from suite_runtime import DEFAULT_SPEED_CHECKS, SPEED_CHECK_POLICIES, SpeedChecks

from .. import submission as S
from ..kit import KIT, suite_files
from ..sandbox import scratch
from ..sandbox.confinement import ConfinementRecord, ConfinementRefused, SandboxUnavailable
from ..sandbox.limits import ATTEMPTS, ONE_THREAD, READY_SECONDS, Limits
from ..sandbox.procfs import TreeDelays
from ..sandbox.template import Sandbox
from .contracts import Graded, Job, Ready, Stopped, Verdict, WorkerAnswer
from .plugin import GradingPlugin

ANSWER_BYTES = 256 << 20  # a worker's answer for one submission is far smaller
CLOSE_SECONDS = 10  # a worker asked to stop ends its session (its sandbox's template too) within this
CHECK_SECONDS = 1.0  # how often the waiting of a worker that has not answered yet is read
# pytest plugins a grading run goes without. The learner's code runs in the sandbox, so nothing it
# does reaches this process's warnings, logs, threads or unraisable exceptions; nobody reads this
# session's terminal (the verdicts travel as data); the sandbox limits the learner's time, and the
# trusted side bounds the whole run (``Limits.run_wall``). Each of these plugins wraps every test
# in hooks of its own.
UNUSED_PLUGINS = ("terminal", "timeout", "cacheprovider", "logging", "warnings", "threadexception",
                  "unraisableexception", "faulthandler", "unittest", "setuponly", "setupplan", "doctest",
                  "junitxml", "pastebin", "stepwise", "anyio")


class WorkerError(RuntimeError):
    """A grading worker died, stopped answering or could not grade (never the learner's doing: their
    code is boxed). The submission gets no record and is tried again by the next run."""


class WorkerRefused(WorkerError):
    """No confinement holds where the worker runs, and plain was not allowed: no submission can be graded
    there (the message says what to do)."""


def pytest_args(staging: Path, speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> list[str]:
    """The arguments of a grading session whose implementation is the folder ``staging``; ``speed_checks``: the
    course's choice for speed checks that cannot run here (tests/suite_plugin/speed.py), always given, so that
    ATTNKIT_SPEED_CHECKS in the grader's environment does not decide it."""
    return [
        *map(str, suite_files()), "--rootdir", str(KIT),
        # --impl=PATH as one word: pytest must not take PATH for a test path (it would load a
        # conftest.py from the submission into this trusted process); --speed-checks=POLICY the same way.
        f"--impl={staging}", "--seed=0", "-m", "not book", "--assert=plain", f"--speed-checks={speed_checks}",
        "-o", "addopts=",  # the ini's options are for a person at a terminal
        "-o", "check_time_limit=0",  # (the student's clock: the sandbox times the learner's code, in its boxes)
        *[arg for name in UNUSED_PLUGINS for arg in ("-p", f"no:{name}")],
    ]


# ---------------------------------------------------------------- the worker's side

Message = Ready | Stopped | WorkerAnswer  # what a grading worker says, one JSON line each


class JobLoop:
    """The test loop of a grading session: every job from ``jobs`` graded in turn, its answer given
    to ``answer``; the first message says the worker is ready (or why it cannot grade)."""

    def __init__(self, grading: GradingPlugin, staging: Path, jobs: Iterable[Job],
                 answer: Callable[[Message], object], started: float):
        self.grading, self.staging, self.jobs, self.answer, self.started = grading, staging, jobs, answer, started
        self.status = 0

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session):
        if self.grading.collection_errors or not self.grading.checks:
            why = "\n".join(self.grading.collection_errors)[-3000:] or "no checks were collected"
            return self._stop(f"the graded suite cannot be collected: {why}")
        try:  # before any learner code: which confinement holds here, proven by a probe box
            confinement = self.grading.confinement
        except SandboxUnavailable as exc:
            return self._stop(str(exc), refused=isinstance(exc, ConfinementRefused))
        # What a run announces: the confinement this worker's sandbox started with (and why a stronger one failed;
        # known once it started).
        sandbox = self.grading.sandbox
        summary = sandbox.confinement.summary() if sandbox is not None and sandbox.confinement is not None else None
        self.answer({"ready": True, "seconds": round(time.monotonic() - self.started, 3),
                     "confinement": confinement, "summary": summary})
        for job in self.jobs:
            try:
                answer = self.grade(session, job)
            except Exception:
                return self._stop("the grading worker failed:\n" + traceback.format_exc()[-3000:])
            if "tests" not in answer:  # (Stopped: no grades, and why)
                return self._stop(answer["error"])  # a fresh worker (and sandbox) for whatever comes next
            self.answer(answer)
        return True

    def grade(self, session, job: Job) -> WorkerAnswer | Stopped:
        for old in self.staging.iterdir():
            old.unlink()
        for name, data in job["sources"].items():
            (self.staging / name).write_bytes(data)
        session.config.option.seed = job["seed"]
        grading = self.grading
        grading.begin(job.get("stages"))
        started = time.monotonic()
        items = [item for item in session.items if grading.grades(item.nodeid)]
        for index, item in enumerate(items):
            following = items[index + 1] if index + 1 < len(items) else None
            # nextitem=None after the last item tears the session's fixtures down: this submission's
            # backend closes (its boxes are killed); the sandbox stays for the next one.
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
            if grading.infrastructure:
                return {"error": f"the grader failed, so the submission was not graded: {grading.infrastructure}",
                        "refused": False}
        if grading.implementations != 1:
            return {"error": f"pytest {pytest.__version__} set up the implementation {grading.implementations} "
                             "times for one submission instead of once: grading stopped rather than give "
                             "grades it cannot vouch for (see grader/grading/worker.py)", "refused": False}
        return {"tests": grading.verdicts(), "output_capped": grading.output_capped,
                "confinement": grading.confinement, "seconds": round(time.monotonic() - started, 3)}

    def _stop(self, why: str, refused: bool = False):
        self.answer({"error": why, "refused": refused})
        self.status = 1
        return True


def serve(jobs: Iterable[Job], answer: Callable[[Message], object], limits: Limits, *, isolate: bool = True,
          started: float | None = None, allow_plain: bool = False, private=(),
          speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> int:
    """Grade ``jobs`` ({"sources": {file name: bytes}, "seed", "stages": the stage modules to grade, None:
    every stage of the kit}) in one pytest session in this process,
    passing each answer to ``answer``; ``speed_checks``: see ``pytest_args``. ``isolate=False`` runs the
    learner's code in this process itself, each stage with the learner's own earlier stages (no reference versions
    of those, see grader/sandbox/backend.py): for measurements (benchmarks/bench_grading.py's floor), never for
    grading."""
    started = time.monotonic() if started is None else started
    # (named after the process that started this one: a run waits for its own workers' folders, not another run's)
    with scratch.Folder(f"worker-{os.getppid()}") as work, contextlib.ExitStack() as stack:
        sandbox = Sandbox(allow_plain=allow_plain, private=private) if isolate else None
        if sandbox is not None:
            stack.enter_context(sandbox)  # closed when the session ends, before its folder is removed
            sandbox.start_soon()  # its template imports torch while pytest starts here
        staging = work.path / "submission"  # the trusted copy the sandbox copies from
        staging.mkdir()
        grading = GradingPlugin(limits, sandbox)
        loop = JobLoop(grading, staging, jobs, answer, started)
        pytest.main(pytest_args(staging, speed_checks), plugins=[grading, loop])
    return loop.status


def main(argv=None) -> int:
    """``python -m grader.grading.worker SETTINGS``: one JSON job per line on stdin, one JSON answer per line out."""
    started = time.monotonic()
    _die_with_parent()
    settings = json.loads((argv or sys.argv[1:])[0])
    # Private copies of the job pipes: whatever pytest, torch or the sandbox print goes to the log.
    jobs = os.fdopen(os.dup(0), "r", encoding="utf-8")
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    import torch

    # One thread per worker, as in the boxes: workers share the cores; pinning them to cores
    # (sched_setaffinity) measured no better, and worse on a busy machine.
    torch.set_num_threads(1)
    decoded: Iterator[Job] = ({"seed": job["seed"], "stages": job.get("stages"),
                               "sources": {name: base64.b64decode(data) for name, data in job["sources"].items()}}
                              for job in map(json.loads, jobs))
    return serve(decoded, lambda answer: answers.write(json.dumps(answer) + "\n"), Limits(**settings["limits"]),
                 isolate=settings["isolate"], started=started, allow_plain=settings.get("allow_plain", False),
                 private=settings.get("private", ()), speed_checks=settings.get("speed_checks", DEFAULT_SPEED_CHECKS))


def _die_with_parent():
    """Linux: SIGKILL this process when the process (thread) that started it dies."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- the trusted side

# A worker's messages are JSON read from its pipe: typed as contracts say once their shape is checked here.

def is_ready(message: dict[str, Any]) -> bool:
    """Whether a worker's message is Ready: every key of it, its confinement a ConfinementRecord or None."""
    confinement = message.get("confinement")
    return (Ready.__required_keys__ <= message.keys() and message["ready"] is True
            and (confinement is None
                 or isinstance(confinement, dict) and ConfinementRecord.__required_keys__ <= confinement.keys()))


def is_answer(message: dict[str, Any]) -> bool:
    """Whether a worker's message is a WorkerAnswer: every key of one, its tests a list of verdicts with every key
    of a Verdict (what records are built from)."""
    tests = message.get("tests")
    return (WorkerAnswer.__required_keys__ <= message.keys() and isinstance(tests, list)
            and all(isinstance(t, dict) and Verdict.__required_keys__ <= t.keys() for t in tests))


class WorkerProcess:
    """The trusted side's handle on one grading worker process: started on first use, a job at a time,
    restarted after a failure."""

    def __init__(self, limits: Limits, isolate: bool = True, *, allow_plain: bool = False, private=(),
                 speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS,
                 on_start: Callable[[WorkerProcess], object] | None = None):
        """``allow_plain``: grade with learner code unconfined where nothing else holds (the instructor's explicit
        choice); ``private``: what boxes must not reach besides the kit (grader.sandbox.template.Sandbox);
        ``speed_checks``: "skip" or "count" the speed checks that cannot run (the course's choice, see
        ``pytest_args``); ``on_start``: called with this handle each time its worker is ready (its ``summary``
        known)."""
        if speed_checks not in SPEED_CHECK_POLICIES:  # (the worker's pytest would refuse it, in its log only)
            raise ValueError(f"speed_checks must be one of {', '.join(SPEED_CHECK_POLICIES)}, not {speed_checks!r}")
        self.limits, self.isolate, self.speed_checks = limits, isolate, speed_checks
        self.allow_plain, self.private = allow_plain, [str(p) for p in private]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.start_seconds: float | None = None  # how long the last start took (torch, pytest, collection, sandbox)
        # what its sandbox confines (grader.sandbox.confinement.Confinement.record())
        self.confinement: ConfinementRecord | None = None
        self.summary: str | None = None  # the same in words, as a run announces it (Confinement.summary())
        self.on_start = on_start
        self.busy = False  # grading a job
        self._buffer = bytearray()

    def start(self):
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, **ONE_THREAD, PYTHONSAFEPATH="1")  # no module from the working folder
        env.pop("NBGRADER_EXECUTION", None)
        settings = {"limits": asdict(self.limits), "isolate": self.isolate, "allow_plain": self.allow_plain,
                    "private": self.private, "speed_checks": self.speed_checks}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grader.grading.worker", json.dumps(settings)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, cwd=tempfile.gettempdir(), env=env,
        )
        self._buffer = bytearray()
        message = self._message(READY_SECONDS)
        if not is_ready(message):
            raise self._failed("the grading worker's first message does not say it is ready, and how it confines")
        ready = cast(Ready, message)
        # Said before the worker ran any learner code: what confines this worker's submissions from now on.
        self.start_seconds, self.confinement, self.summary = ready["seconds"], ready["confinement"], ready["summary"]
        if self.on_start is not None:
            self.on_start(self)

    def grade(self, job: Job) -> WorkerAnswer:
        """Grade ``job`` ({"sources": {file name: bytes}, "seed", "stages"}): {"tests", "output_capped",
        "confinement", "seconds"}. Raises WorkerError if the worker could not grade it."""
        self.busy = True
        try:
            return self._grade(job)
        finally:
            self.busy = False

    def _grade(self, job: Job) -> WorkerAnswer:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.start()
        line = json.dumps({"seed": job["seed"], "stages": job.get("stages"), "sources": {
            name: base64.b64encode(data).decode() for name, data in job["sources"].items()}})
        _, jobs, _ = self._pipes()
        try:
            jobs.write(line.encode() + b"\n")
            jobs.flush()
        except OSError:
            raise self._failed("the grading worker stopped reading") from None
        message = self._message(self.limits.run_wall)
        if not is_answer(message):
            raise self._failed("the grading worker's answer lacks its parts (tests, output_capped, confinement, "
                               "seconds; each verdict's)")
        # The confinement a record states is what this worker said before it ran any learner code, never a
        # word of an answer given after (where nothing confines, learner code could have written that).
        return {**cast(WorkerAnswer, message), "confinement": self.confinement}

    def _pipes(self) -> tuple[subprocess.Popen[bytes], IO[bytes], IO[bytes]]:
        """The worker process, its job pipe and its answer pipe (start() makes them all)."""
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise WorkerError("the grading worker is not running (the grader's bug: it was used before start())")
        return proc, proc.stdin, proc.stdout

    def _message(self, seconds: float) -> dict[str, Any]:
        """The worker's next message, a JSON object: one JSON line (read in linear time; the messages in it are
        capped where they come from, so a line beyond ANSWER_BYTES means a broken worker). A worker that has not
        answered after ``seconds`` of waiting is stopped: wall-clock time less the time its processes (the
        worker, its sandbox's template and boxes) waited for a processor, so that a busy machine only makes
        grading slower, never stops it (a worker that hangs waits without waiting for a processor). A worker that
        says why it stopped (contracts.Stopped) raises the WorkerError (or WorkerRefused) that says so."""
        proc, _, answers = self._pipes()
        fd = answers.fileno()
        started, delayed = time.monotonic(), TreeDelays(proc.pid)
        searched = 0
        while (end := self._buffer.find(b"\n", searched)) < 0:
            searched = len(self._buffer)
            if searched > ANSWER_BYTES:
                raise self._failed(f"the grading worker's answer exceeds {ANSWER_BYTES >> 20} MiB")
            remaining = seconds - (time.monotonic() - started - delayed())  # (read often: processes come and go)
            if remaining <= 0:
                raise self._failed("the grading worker did not answer in time")
            ready, _, _ = select.select([fd], [], [], min(remaining, CHECK_SECONDS))
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise self._failed("the grading worker died")
                self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        try:
            message = json.loads(line)
        except ValueError:
            raise self._failed("the grading worker's answer does not parse") from None
        if not isinstance(message, dict):
            raise self._failed("the grading worker's answer is not a JSON object")
        if "error" in message:
            raise self._failed(str(message["error"]), WorkerRefused if message.get("refused") else WorkerError)
        return message

    def _failed(self, what: str, kind: type[WorkerError] = WorkerError) -> WorkerError:
        tail = ""
        if self.log is not None and kind is WorkerError:
            self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, self.log.tell() - 3000))
            tail = self.log.read().decode("utf-8", "replace").strip()
        self.close(graceful=False)
        return kind(what + (f"; its log ends with:\n{tail}" if tail else ""))

    def close(self, graceful: bool = True):
        """Stop the worker. One waiting for a job is told so (its job pipe closes) and given
        CLOSE_SECONDS to end its session and remove its folders; one that is busy or broken, or does
        not end in time, is killed (its folders are then swept by the next run, scratch.sweep)."""
        if self.proc is not None:
            if graceful and not self.busy and self.proc.poll() is None:
                if self.proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        self.proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=CLOSE_SECONDS)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()  # its sandbox's processes follow (parent-death signal)
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


def grade_folder(folder: Path, limits: Limits, graded_stages: list[str] | None = None, *, allow_plain=False,
                 private=(), speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> Graded:
    """The verdicts of the submission in nbgrader's autograded copy ``folder`` on ``graded_stages`` (None:
    every stage), graded by a worker of its own: {"fingerprint", "seed", "tests", "output_capped",
    "confinement", "seconds"}. ``allow_plain``, ``private``, ``speed_checks``: see WorkerProcess. A failure of the
    grader's own (the worker's, its sandbox's: WorkerError) is tried again in a fresh worker; if that fails too,
    WorkerError says why (never a grade). WorkerRefused (no confinement holds here) is not tried again."""
    sources = S.autograded_sources(folder, graded_stages or ())
    fingerprint = S.fingerprint(sources)
    job: Job = {"sources": sources, "seed": S.seed_of(fingerprint), "stages": graded_stages}
    failures = []
    for _ in range(ATTEMPTS):
        worker = WorkerProcess(limits, allow_plain=allow_plain, private=private, speed_checks=speed_checks)
        try:
            return {"fingerprint": fingerprint, "seed": job["seed"], **worker.grade(job)}
        except WorkerRefused:
            raise
        except WorkerError as exc:
            failures.append(str(exc))
        finally:
            worker.close()
    raise WorkerError(f"the grader failed {len(failures)} times on this submission (each time in a fresh worker and "
                      f"sandbox), so it was not graded; the last time: {failures[-1]}")


if __name__ == "__main__":
    code = main()
    # Then no interpreter teardown, as the sandbox's template does: with torch and the suite loaded it takes most of a
    # second of CPU time per worker (and as long for the run that waits for it to end). The session has ended by
    # now, and with it the worker's folder and its sandbox; what is left to do is to flush what it wrote. (A worker
    # that failed raised out of main(): it ends the usual way.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
