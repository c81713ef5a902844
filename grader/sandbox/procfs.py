"""What Linux's /proc shows of processes: their children, CPU time, run-queue delays, pids and uids.

Both sides of the sandbox read it: the trusted side to count a box's CPU time and waiting, the template
(``child``) to find what a box left behind. Standard library only: the grader copies this file into the
box's runtime folder beside ``child.py``.
"""
from __future__ import annotations

import os
import threading

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

def children(pid):
    """The children of process ``pid`` in this process's pid namespace ([] if there are none or
    /proc cannot tell)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:  # (a thread that ended since the listing is skipped, not the threads after it)
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except (OSError, ValueError):
            continue
    return found

def cpu_fields(pid) -> list[int] | None:
    """utime, stime, cutime, cstime of process ``pid``, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return [int(f) for f in stat.read().rsplit(")", 1)[1].split()[11:15]]
    except (OSError, ValueError, IndexError):
        return None


def learner_cpu(init) -> float | None:
    """CPU seconds used in a box so far: every process under the box's first process, living or
    reaped into its parent's counts, but not the first process's own work (the box's start-up).
    None when /proc cannot tell (the box is gone, or this is not Linux)."""
    fields = cpu_fields(init)
    if fields is None:
        return None
    ticks = fields[2] + fields[3]  # the workers the first process has reaped
    pending = children(init)
    while pending:
        pid = pending.pop()
        fields = cpu_fields(pid)
        if fields is not None:
            ticks += sum(fields)
        pending += children(pid)
    return ticks / CLOCK_TICKS


def own_cpu(pid) -> float | None:
    """CPU seconds process ``pid`` has used itself (with the children it reaped); None when /proc cannot tell."""
    fields = cpu_fields(pid)
    return None if fields is None else sum(fields) / CLOCK_TICKS


def run_delays(init) -> dict[int, float]:
    """Thread id -> seconds it has waited on a run queue, for every thread of ``init`` and the processes
    under it (Linux schedstat; {} where the kernel does not keep it)."""
    delays, pending = {}, [init]
    while pending:
        pid = pending.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                    delays[int(task)] = int(stat.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        pending += children(pid)
    return delays


class TreeDelays:
    """Seconds the threads of process ``pid`` and of every process under it have waited on a run queue since this
    object was made, dead ones included (each thread's last count is kept): the machine's load on that tree of
    processes. (Threads waiting at the same time add up: over what they waited together, never under.)"""

    def __init__(self, pid):
        self.pid = pid
        self.start = run_delays(pid)
        self.seen = dict(self.start)

    def __call__(self) -> float:
        self.seen.update(run_delays(self.pid))
        return sum(self.seen.values()) - sum(self.start.values())


class _Schedstat:
    """A thread's /proc/thread-self/schedstat, opened once (read again with pread: the kernel makes the text afresh
    at offset 0). Each thread's is held by ``_own`` alone, so it is closed when its thread ends."""

    fd = None  # (until opened)

    def __init__(self):
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)

    def read(self) -> bytes:
        return os.pread(self.fd, 128, 0)

    def __del__(self):
        if self.fd is not None:
            os.close(self.fd)


_own = threading.local()  # .stat: the calling thread's _Schedstat (a thread's locals go when it ends)


def own_run_delay() -> float:
    """Seconds the calling thread has waited on a run queue (Linux schedstat; 0 where the kernel does not keep it)."""
    try:
        stat = getattr(_own, "stat", None)
        if stat is None:
            stat = _own.stat = _Schedstat()
        return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class ThreadDelay:
    """Seconds one thread of this process has waited on a run queue (Linux schedstat; 0 where unknown), read through
    one descriptor, kept while this object lives (another thread's stat, read often: ``channel.Waiting``). Once the
    thread has ended, the last value read."""

    fd = None  # (until opened)

    def __init__(self, tid):
        self.last = 0.0
        try:
            self.fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass

    def __call__(self) -> float:
        if self.fd is not None:
            try:
                self.last = int(os.pread(self.fd, 128, 0).split()[1]) / 1e9
            except (OSError, ValueError, IndexError):
                pass
        return self.last

    def __del__(self):
        if self.fd is not None:
            os.close(self.fd)


def ns_pids(pid) -> list[int]:
    """The pids of process ``pid`` in each pid namespace it belongs to, outermost first (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(n) for n in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []

def processes_of(uid) -> list[int]:
    """The living processes (not zombies) with ``uid`` among their user ids (real, effective, saved, file)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (OSError, ValueError):
            continue
        if str(uid) in fields.get("Uid", "").split() and not fields.get("State", "").strip().startswith(("Z", "X")):
            found.append(int(name))
    return found
