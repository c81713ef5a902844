"""What one submission may use when graded: its time limits and resource limits (``Limits``).

Time: one check may use ``check_seconds`` of CPU time in the box (all its processes), a whole submission
``budget``; limits of WALL_FACTOR times those on waiting only stop code that waits or sleeps. Waiting is
wall-clock time less the time the box's processes were ready to run but waited for a processor (its cgroup's
pressure stall count, where the kernel keeps one): a loaded machine's delays are not the learner's. A box's
start-up is never counted, and the machine's load changes no CPU time. Other limits: address space
(RLIMIT_AS), processes (RLIMIT_NPROC of the box's uid), the box's tmpfs and the files it writes
(RLIMIT_FSIZE), captured output (drained by a thread, the first ``output_bytes`` kept), the size of an answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The limits a check can run into, as a grading record names them (the field ``limit`` of each check's verdict). Set
# by the sandbox's backend where it stops an operation, on the SubmissionError it raises (its ``limit``):
# "time"    the check's time limit: its CPU time, or its waiting (wall-clock time less the time spent waiting for a
#           processor); the suite then fails the rest of the stage's checks without running them ("time" too)
# "budget"  the whole submission's budget: this check and every later one fail at once
# "memory"  the address space of a process, or a stage's memory ceiling (MEMORY_HEADROOM in its test module)
# "crash"   a process of the box died from a signal, or the box went away
# "exit"    learner code ended its process (sys.exit, os._exit) before answering
# "output"  an answer larger than allowed; or, where nothing else was hit, the learner's output was cut
Limit = Literal["time", "budget", "memory", "crash", "exit", "output"]
LIMITS: tuple[Limit, ...] = get_args(Limit)

TEST_TIMEOUT = 10.0  # CPU seconds one check may use, unless a course or a run says otherwise

WALL_FACTOR = 5  # a check's limit on waiting (wall-clock time less the time spent waiting for a processor) is
# this many times its CPU limit
WAIT_SLACK = 1.1  # a whole submission may wait this many times its budget (a margin for the channel's own delays):
# one that sleeps in every check holds a grading worker for about its budget, no more
LOAD_FACTOR = 4  # an operation is stopped after this many times its waiting limit of wall-clock time, whatever
# the load (a backstop: a box whose processes always seem to wait for a processor)
BUDGET_CHECKS = 12  # the default budget of a submission: this many checks at their limit
START_SECONDS = 180.0  # a template must be ready within this (importing torch on a loaded machine)
ATTEMPTS = 2  # a submission the grader failed on (its own failure) is graded this often in all, each time by a fresh
# grading worker and sandbox, before it is left without a grade (grader.grading.dispatch, grader.grading.worker)
READY_SECONDS = 300  # a grading worker must be ready (torch, pytest, collection, its sandbox) within this much waiting

# Learner code computes with one thread. Its time limits are CPU seconds, and a thread pool's
# workers spin while they wait: with torch's default of a thread per core, the same suite cost a
# box 3.7x the CPU time on 2 cores (0.98 s against 0.27 s for the reference), more on bigger
# machines. The kit's tensors are small; one thread is also the fastest.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

def budget_problem(check_seconds: float, budget_seconds: float | None) -> str | None:
    """Why a time budget per submission cannot go with this limit per check (it must hold one check at
    least), or None when it can (None: the default budget)."""
    if budget_seconds is not None and not budget_seconds >= check_seconds:
        return (f"the time budget ({budget_seconds:g} s) must be at least the time limit of one check "
                f"({check_seconds:g} s)")
    return None


@dataclass(frozen=True)
class Limits:
    """What one submission may use. Times are CPU seconds of the learner's processes."""

    check_seconds: float = TEST_TIMEOUT  # one check (one test)
    budget_seconds: float | None = None  # the whole submission; None: BUDGET_CHECKS x check_seconds
    memory_bytes: int = 4 << 30  # address space of each process
    output_bytes: int = 1 << 20  # kept of what the learner prints (the rest is counted and dropped)
    processes: int = 64  # processes and threads of the box's uid
    files: int = 128  # open files of each process of a box: they bound its pipe and socket buffers
    tmp_bytes: int = 64 << 20  # each of the box's /tmp and /dev/shm, and any file it writes
    result_bytes: int = 256 << 20  # one answer

    @property
    def budget(self) -> float:
        return self.budget_seconds if self.budget_seconds is not None else BUDGET_CHECKS * self.check_seconds

    @property
    def check_wall(self) -> float:
        return WALL_FACTOR * self.check_seconds

    @property
    def budget_wall(self) -> float:
        """The whole submission's waiting: its budget. Computing is waiting too (waiting is wall-clock time
        less the time spent waiting for a processor), so code that only computes meets its CPU budget first."""
        return self.budget * WAIT_SLACK

    @property
    def run_wall(self) -> float:
        """Limit of waiting for a grading worker to grade one whole submission (grader.grading.worker: wall-clock
        time less the time its processes waited for a processor), a backstop: the learner's time is bounded
        by the budget; add a restart of the sandbox and the trusted side's own work."""
        return self.budget_wall + START_SECONDS + 120

    def for_box(self, mode) -> dict:
        # RLIMIT_NPROC counts the processes of a uid (in its user namespace): without a box of
        # its own, that would be the grader's. RLIMIT_CPU backs the budget up (each process's own).
        return {"memory_bytes": self.memory_bytes, "tmp_bytes": self.tmp_bytes, "files": self.files,
                "processes": self.processes if mode != "plain" else None,
                "cpu_seconds": int(self.budget + START_SECONDS)}
