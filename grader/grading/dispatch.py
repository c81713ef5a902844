"""Where the jobs of ``attnkit grade`` run: warm grading workers on this machine's cores (here), or on
a Dask cluster (``grader.grading.on_dask``). Either way a job ({"student", "sources", "seed", ...}) meets a
``WorkerProcess`` (grader.grading.worker) that grades one submission at a time, and its result comes back as

    {"student", "tests", "output_capped", "confinement", "seconds", "error", "refused"}  (contracts.Result)

with ``error`` None, or saying why the submission could not be graded (it then gets no record and
is tried again by the next run). A failed worker is replaced and the job tried again in the fresh one first
(``ATTEMPTS`` in all, grader/sandbox/limits.py): a failure of the grader's own is never a grade.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Protocol

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks

from ..sandbox.confinement import ConfinementRecord
from ..sandbox.limits import ATTEMPTS, Limits
from .contracts import ClassJob, Result
from .worker import WorkerError, WorkerProcess, WorkerRefused


class Results(Protocol):
    """Where a run's jobs are graded (LocalResults here, grader.grading.on_dask.DaskResults on a cluster): each
    (job, result) as it completes; ``close`` stops its workers, also with jobs in flight."""

    def __iter__(self) -> Iterator[tuple[ClassJob, Result]]: ...
    def close(self) -> None: ...


class Workers:
    """``count`` grading worker processes (each started on first use), lent to one job at a time."""

    def __init__(self, limits: Limits, count: int, *, allow_plain: bool = False, private=(),
                 speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS):
        self.handles = [WorkerProcess(limits, allow_plain=allow_plain, private=private, speed_checks=speed_checks,
                                      on_start=self._started) for _ in range(count)]
        self.refused: WorkerRefused | None = None  # no confinement holds where the workers run: nothing can be graded
        self.first: WorkerProcess | None = None  # the first worker that started (what the run announces)
        self.started = threading.Event()
        self.free: queue.SimpleQueue[WorkerProcess] = queue.SimpleQueue()
        for handle in self.handles:
            self.free.put(handle)
        self.stopped = threading.Event()  # set by close(): no worker is started any more

    def grade(self, job: ClassJob) -> Result:
        handle = self.free.get()
        try:
            error = "the run was interrupted"
            for attempt in range(1, ATTEMPTS + 1):
                if self.stopped.is_set():
                    break
                try:
                    answer = handle.grade(job)
                    return {"student": job["student"], "tests": answer["tests"],
                            "output_capped": answer["output_capped"], "confinement": answer["confinement"],
                            "seconds": answer["seconds"], "error": None, "refused": False}
                except WorkerRefused as exc:  # the same for every submission: the run stops
                    self.refused = exc
                    self.stopped.set()
                    error = str(exc)
                    break
                except WorkerError as exc:  # (also an answer without its parts: WorkerProcess checks them)
                    handle.close()  # the next attempt starts a fresh worker, with a fresh sandbox
                    error = f"{type(exc).__name__} (attempt {attempt} of {ATTEMPTS}, each in a fresh worker): {exc}"
            return {"student": job["student"], "tests": [], "output_capped": [], "confinement": None,
                    "seconds": 0.0, "error": error, "refused": self.refused is not None}
        finally:
            self.free.put(handle)

    def _started(self, handle: WorkerProcess):
        if self.first is None:
            self.first = handle
            self.started.set()

    def close(self):
        """Stop every worker process now, all at once (a job waiting on one gets an error)."""
        self.stopped.set()
        with ThreadPoolExecutor(max_workers=len(self.handles) or 1, thread_name_prefix="attnkit-stop") as pool:
            list(pool.map(WorkerProcess.close, self.handles))


class LocalResults:
    """(job, result) as they complete, on ``workers`` local threads, each with a worker process. The
    workers start at once (torch, pytest, the sandbox: a second or so) while the caller goes on."""

    def __init__(self, jobs: Iterable[ClassJob], limits: Limits, workers: int, *, allow_plain: bool = False,
                 private=(), speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS):
        self.workers = Workers(limits, workers, allow_plain=allow_plain, private=private, speed_checks=speed_checks)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnkit-grade")
        self.futures: dict[Future[Result], ClassJob] = {self.pool.submit(self.workers.grade, job): job for job in jobs}

    def confinement(self) -> tuple[str | None, ConfinementRecord | None] | None:
        """What confines the submissions, as the first worker's sandbox found once started and proven: (its
        summary, its record); None if no worker started (every job then has its error)."""
        while not self.workers.started.wait(0.1):
            if all(future.done() for future in self.futures):
                return None
        first = self.workers.first
        if first is None:  # (set before ``started`` is)
            raise RuntimeError("the grader's bug: a worker started, and none is known as the first")
        return first.summary, first.confinement

    def __iter__(self) -> Iterator[tuple[ClassJob, Result]]:
        for future in as_completed(self.futures):
            yield self.futures[future], future.result()

    def close(self):
        self.workers.close()  # also unblocks threads still waiting on a worker (interrupted run)
        self.pool.shutdown(wait=True, cancel_futures=True)
