"""Run untrusted learner code in confined processes that each serve one submission.

``IsolatedBackend(root)`` has the interface of ``adapters.LocalBackend``: ``run(op, module,
**kwargs)`` returns the same plain values, but the learner's modules are imported and run in a
*box*, a confined tree of processes that serves this one submission and is killed with it. This
(trusted) process never imports learner code. What comes back is plain data (numbers, strings,
numeric/bool NumPy arrays, lists/tuples/dicts of those), sent as JSON plus raw blobs without
pickle and checked here (see ``grader.sandbox_child``). Every conclusion is drawn in this process.

    this process ──control socket──> template: confined, torch imported; never runs learner
         │                             code; forks a box when asked, kills it when asked
         └──the box's own 4 pipes──> box: fresh namespaces, /tmp, /dev/shm, keyring and uid;
                                        its pid 1 forks a worker per stage, which runs the
                                        learner's code

A ``Sandbox`` is one template. A process that grades many submissions keeps one (torch is then
imported once per grading process) and asks it for a box per submission; ``IsolatedBackend``
without a sandbox starts its own. Everything a box holds (processes, /tmp and /dev/shm, IPC
objects, sockets, keyring, uid) is its own and dies with it, and its only file descriptors are
the four pipes this process gave it. What a box says is data about its own submission: no box
is ever used for a second submission, or again after anything went wrong in it (time-out,
crash, a message that does not parse), and no message of a box decides anything about a
process: the template, which learner code cannot reach, kills boxes and reports them gone.

Confinement, strongest first (``Sandbox.confinement`` says which holds and what is missing; a
grading run reports it at the start and in every record, and the kit's tests fail where it is
weaker than the README promises):

``namespaces``  (root) fresh mount, pid, network, IPC and UTS namespaces and a fresh uid per box
``userns``      (no root; unprivileged user namespaces) the same, except the uid: the box keeps
                the grader's uid, inside a nested user namespace that owns nothing
``plain``       neither: a child process with resource limits, and no isolation at all

Time (``Limits``): one check may use ``check_seconds`` of CPU time in the box (all its
processes), a whole submission ``budget``; limits of WALL_FACTOR times those on waiting only
stop code that waits or sleeps. Waiting is wall-clock time less the time the box's processes
were ready to run but waited for a processor (its cgroup's pressure stall count, where the
kernel keeps one): a loaded machine's delays are not the learner's. A box's start-up is never
counted, and the machine's load changes no CPU time. Other limits: address space (RLIMIT_AS),
processes (RLIMIT_NPROC of the box's uid), the box's tmpfs and the files it writes
(RLIMIT_FSIZE), captured output (drained by a thread, the first ``output_bytes`` kept), the size
of an answer.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import platform
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from stage_names import assignment_of, builds_on, is_stage_module, module_files

from . import cgroups, lockdown, redaction, scratch
from .cgroups import BoxGroup
from .kit import FIXTURES, KIT, SOLUTIONS, SUITE
from .sandbox_child import AUDIT_ARCH, CONTROL_BYTES, LENGTH, ProtocolError, decode, encode, pack, processes_of
from .submission import sources

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
# What a box imports besides the standard library, NumPy and torch: the adapter, and the stage
# names it reads. Found, not imported: the adapter imports torch, which this process need not.
RUNTIME_MODULES = [Path(importlib.util.find_spec(name).origin) for name in ("adapters", "stage_names")]
TEST_TIMEOUT = 10.0  # CPU seconds one check may use, unless a course or a run says otherwise
MAX_HEADER_BYTES = 1 << 20  # an answer's JSON (arrays travel as blobs beside it)
MESSAGE_CHARS = 4000  # of an error message or traceback from a box, kept
UID_RANGE = (1_500_000_000, 2_100_000_000)  # fresh uids for boxes (no real user lives there)
WALL_FACTOR = 5  # a check's limit on waiting (wall-clock time less the time spent waiting for a processor) is
# this many times its CPU limit
WAIT_SLACK = 1.1  # a whole submission may wait this many times its budget (a margin for the channel's own delays):
# one that sleeps in every check holds a grading worker for about its budget, no more
LOAD_FACTOR = 4  # an operation is stopped after this many times its waiting limit of wall-clock time, whatever
# the load (a backstop: a box whose processes always seem to wait for a processor)
BUDGET_CHECKS = 12  # the default budget of a submission: this many checks at their limit
START_SECONDS = 180.0  # a template must be ready within this (importing torch on a loaded machine)
BOX_SECONDS = 30.0  # a box must be ready, or gone, within this
POLL_SECONDS = 0.1  # how often the CPU time of a running check is read
CLOSE_SECONDS = 2.0  # CPU time a worker may take to close its stage before its box is replaced
# Learner code computes with one thread. Its time limits are CPU seconds, and a thread pool's
# workers spin while they wait: with torch's default of a thread per core, the same suite cost a
# box 3.7x the CPU time on 2 cores (0.98 s against 0.27 s for the reference), more on bigger
# machines. The kit's tensors are small; one thread is also the fastest.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DENIED_NOTE = ("\n(When graded, learner code may not run programs, start processes, write or create files, or open "
               "sockets: keep the stage's work in torch, in memory.)")


# ---------------------------------------------------------------- limits and confinement

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
        """Wall-clock limit of grading one whole submission, a backstop: the learner's time is bounded
        by the budget; add a restart of the sandbox and the trusted side's own work."""
        return self.budget_wall + START_SECONDS + 120

    def for_box(self, mode) -> dict:
        # RLIMIT_NPROC counts the processes of a uid (in its user namespace): without a box of
        # its own, that would be the grader's. RLIMIT_CPU backs the budget up (each process's own).
        return {"memory_bytes": self.memory_bytes, "tmp_bytes": self.tmp_bytes,
                "processes": self.processes if mode != "plain" else None,
                "cpu_seconds": int(self.budget + START_SECONDS)}


GUARANTEES = {  # what keeps one submission from reaching another, by the name a Confinement lists
    "files": "the kit's solutions, hidden tests and fixtures, the grader, the gradebook and other submissions out of "
             "its reach",
    "mount": "a private root file system for each submission (only the Python installation and its own modules "
             "in it)",
    "processes": "the grader's and other submissions' processes out of its reach (no signals, tracing, memory or "
                 "open files)",
    "pid": "a fresh pid namespace for each submission (other processes not even listed)",
    "uid": "a fresh unprivileged uid for each submission",
    "system calls": "learner code that cannot run programs, start processes, write files, or open sockets or IPC "
                    "objects (a seccomp filter)",
    "keyring": "no access to the kernel's keyrings",
    "cgroup": "a cgroup for each submission (the CPU time of all its processes counted, dead ones included)",
    "cgroup limits": "the memory and number of a submission's processes bounded together (cgroup memory and "
                     "pids controllers; without them, only each process's own limits)",
}
CGROUP_GUARANTEES = ("cgroup", "cgroup limits")  # held wherever this process may give boxes cgroups
HOLDS = {  # by the confinement's mode
    "namespaces": tuple(g for g in GUARANTEES if g not in CGROUP_GUARANTEES),
    "userns": tuple(g for g in GUARANTEES if g != "uid" and g not in CGROUP_GUARANTEES),
    # root without namespaces (Docker's default profile: Gradescope, Kubernetes, CI runners): a fresh uid, the
    # learner's filter, and the files a box must not reach made private to root first (``lockdown``)
    "container": ("files", "processes", "uid", "system calls", "keyring"),
    "plain": ("system calls", "keyring"),
}
MODES = tuple(HOLDS)  # strongest first
ALLOW_PLAIN = "--allow-plain"  # how an instructor opts into plain confinement (the refusal names it)


@dataclass(frozen=True)
class Confinement:
    """Which confinement a sandbox runs with, and what it lacks of the strongest."""

    mode: str
    cgroup: bool = False  # a cgroup for each box, counting its CPU time
    bounded: bool = False  # ... bounding its memory and number of processes too
    why: str = ""  # why stronger confinements failed, if they did
    private: tuple = ()  # what was made private to root before any box started (container)

    @property
    def missing(self) -> list[str]:
        cgroups = dict(zip(CGROUP_GUARANTEES, (self.cgroup, self.bounded)))
        holds = set(HOLDS[self.mode]) | {g for g, held in cgroups.items() if held}
        return [g for g in GUARANTEES if g not in holds]

    def summary(self) -> str:
        if self.mode == "plain":
            head = ("sandbox: plain (UNCONFINED, as the instructor allowed): learner code runs as this user, beside "
                    "the grader, and can read the solutions and hidden tests; it lacks")
        elif not self.missing:
            return f"sandbox: {self.mode} (fresh namespaces, /tmp, uid and cgroup for each submission)"
        else:
            head = f"sandbox: {self.mode}, WEAKER than full confinement; it lacks"
        lacking = "; ".join(GUARANTEES[g] for g in self.missing)
        private = f" (made private to root first: {', '.join(self.private)})" if self.private else ""
        return f"{head} {lacking}{private}" + (f" [{self.why}]" if self.why else "")

    def record(self) -> dict:
        return {"mode": self.mode, "missing": self.missing}


class SandboxWarning(UserWarning):
    """The sandbox runs with weaker confinement than it would like."""


class SandboxUnavailable(RuntimeError):
    """No way to start a template or a box works on this machine (not the learner's fault)."""


class ConfinementRefused(SandboxUnavailable):
    """No confinement holds here, and the instructor did not allow grading without one."""


def candidate_modes(allow_plain: bool = False) -> list[str]:
    """Confinements worth trying here, strongest first. Never ``userns`` as root: the boxes would
    keep root's uid on the host (owner of its files, its sysctls) without a capability to lose. Root
    whose namespaces are refused (a container) gets ``container``. ``plain`` only when allowed."""
    modes = []
    if os.geteuid() == 0:
        modes += ["namespaces"] if shutil.which("unshare") else []
        modes.append("container")
    elif shutil.which("unshare"):
        modes.append("userns")
    return modes + (["plain"] if allow_plain else [])


def _refuse(mode):
    if mode == "userns" and os.geteuid() == 0:
        raise SandboxUnavailable("userns: refused as root (the boxes would keep root's uid on the host); "
                                 "root gets the namespaces confinement")
    if mode == "container" and os.geteuid() != 0:
        raise SandboxUnavailable("container: needs root (each box gets a fresh uid)")
    if mode == "container" and platform.machine() not in AUDIT_ARCH:
        raise SandboxUnavailable(f"container: no system call table for {platform.machine()} (x86_64, aarch64)")
    if mode not in HOLDS:
        raise SandboxUnavailable(f"{mode!r} is not a confinement ({', '.join(MODES)})")


def refusal(failures: list[str]) -> ConfinementRefused:
    """The error of a machine where no confinement holds: what failed, and what to do."""
    return ConfinementRefused(
        "no confinement for learner code holds on this machine, so nothing was graded: "
        + "; ".join(failures) + ". Grade as root (with namespaces, or in a container with Docker's default "
        "capabilities), or where unprivileged user namespaces are enabled (sysctl kernel.unprivileged_userns_clone=1"
        f"). To grade anyway with learner code UNCONFINED beside the grader (it can then read the solutions and "
        f"hidden tests), pass {ALLOW_PLAIN} (attnkit grade, attnkit gradescope, attnkit course build)")


def _unshare(mode) -> list[str]:
    """The command prefix that puts a template in its namespaces ([] for container and plain)."""
    if mode in ("container", "plain"):
        return []
    user = ["--user", "--map-root-user"] if mode == "userns" else []
    return [shutil.which("unshare") or "unshare", *user, "--mount", "--pid", "--net", "--ipc", "--uts",
            "--fork", "--kill-child", "--"]


def _container_holds() -> str | None:
    """Why the container confinement cannot work here (None: it can): it needs root's power to change uids
    and a kernel with seccomp filters."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        effective = int(fields["CapEff"].strip(), 16)
    except (OSError, KeyError, ValueError):
        return "cannot read this process's capabilities (/proc/self/status)"
    capabilities = (("CAP_SETUID", 7), ("CAP_SETGID", 6), ("CAP_KILL", 5))
    lacking = [name for name, bit in capabilities if not effective >> bit & 1]
    if lacking:
        return f"root without {', '.join(lacking)}"
    if "Seccomp" not in fields:
        return "the kernel has no seccomp filters"
    return None


def probe(confine=None, allow_plain=False) -> Confinement:
    """The strongest confinement this machine allows, found quickly (no template is started): what a
    grading run announces before it starts. Raises ConfinementRefused where none holds and plain is not
    allowed."""
    failures = []
    for mode in [confine] if confine else candidate_modes(allow_plain):
        _refuse(mode)
        if mode == "container":
            why = _container_holds()
            if why:
                failures.append(f"container: {why}")
                continue
        elif mode != "plain":
            try:
                run = subprocess.run([*_unshare(mode), "true"], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.SubprocessError) as exc:
                failures.append(f"{mode}: {exc}")
                continue
            if run.returncode != 0:
                failures.append(f"{mode}: {run.stderr.strip() or run.returncode}")
                continue
        return Confinement(mode, *_cgroups(), why="; ".join(failures))
    raise refusal(failures or ["no confinement was allowed"])


def _cgroups() -> tuple[bool, bool]:
    """Whether this process may give each box a cgroup: (its CPU time counted, its memory and number
    of processes bounded)."""
    group = BoxGroup.create(1 << 30, 1)
    if group is None:
        return False, False
    bounded = {"memory", "pids"} <= set(group.folders)
    group.remove()
    return True, bounded


# ---------------------------------------------------------------- reading the box from outside

def _children(pid) -> list[int]:
    """The children of process ``pid`` (Linux /proc), or [] when that cannot be read."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
    except (OSError, ValueError):
        pass
    return found


def _cpu_fields(pid) -> list[int] | None:
    """utime, stime, cutime, cstime of process ``pid``, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return [int(f) for f in stat.read().rsplit(")", 1)[1].split()[11:15]]
    except (OSError, ValueError, IndexError):
        return None


def _learner_cpu(init) -> float | None:
    """CPU seconds used in a box so far: every process under the box's first process, living or
    reaped into its parent's counts, but not the first process's own work (the box's start-up).
    None when /proc cannot tell (the box is gone, or this is not Linux)."""
    fields = _cpu_fields(init)
    if fields is None:
        return None
    ticks = fields[2] + fields[3]  # the workers the first process has reaped
    pending = _children(init)
    while pending:
        pid = pending.pop()
        fields = _cpu_fields(pid)
        if fields is not None:
            ticks += sum(fields)
        pending += _children(pid)
    return ticks / CLOCK_TICKS


def _run_delays(init) -> dict[int, float]:
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
        pending += _children(pid)
    return delays


def _ns_pids(pid) -> list[int]:
    """The pids of process ``pid`` in each pid namespace it belongs to, outermost first (Linux)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(n) for n in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


# ---------------------------------------------------------------- output capture

class _Capture:
    """Drains a process's stdout and stderr so that it never blocks on a full pipe.

    Keeps the first ``limit`` bytes of each stream and a short rolling tail; counts
    the rest. Memory use stays bounded however much the process prints.
    """

    TAIL = 4096

    def __init__(self, streams, limit):
        self.limit = limit
        self.lock = threading.Lock()
        self.reset()
        self.thread = threading.Thread(target=self._drain, args=(streams,), daemon=True, name="sandbox-output")
        self.thread.start()

    def reset(self):
        with self.lock:
            self.head = {"stdout": bytearray(), "stderr": bytearray()}
            self.tail = {"stdout": b"", "stderr": b""}
            self.dropped = {"stdout": 0, "stderr": 0}

    def _drain(self, streams):
        fds = {stream.fileno(): (name, stream) for name, stream in streams.items()}
        while fds:
            ready, _, _ = select.select(list(fds), [], [])
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                name, stream = fds[fd]
                if not chunk:
                    stream.close()
                    del fds[fd]
                    continue
                with self.lock:
                    head = self.head[name]
                    room = max(0, self.limit - len(head))
                    head += chunk[:room]
                    self.dropped[name] += len(chunk) - min(room, len(chunk))
                    self.tail[name] = (self.tail[name] + chunk)[-self.TAIL:]

    def text(self, name):
        """What the stream held (truncated, with a note saying how much was dropped)."""
        with self.lock:
            text = self.head[name].decode(errors="replace")
            if self.dropped[name]:
                text += f"\n[... {self.dropped[name]} more bytes dropped; the end was:]\n"
                text += self.tail[name].decode(errors="replace")
        return text

    def dropped_bytes(self):
        with self.lock:
            return sum(self.dropped.values())

    def last_lines(self, name, count=12):
        with self.lock:
            data = self.tail[name] if self.dropped[name] else bytes(self.head[name][-self.TAIL:])
        return "\n".join(data.decode(errors="replace").rstrip().splitlines()[-count:])


# ---------------------------------------------------------------- the template

@dataclass
class _Box:
    """This process's side of one box."""

    token: str
    requests: int  # write end of the box's request pipe
    replies: int  # read end of its reply pipe
    capture: _Capture  # its stdout and stderr
    incoming: Path  # the folder holding the submission's modules, bound read-only into the box
    tmp: Path | None  # its scratch folder (without a mount namespace only)
    init: int | None = None  # pid of the box's first process (for its CPU time), None if unknown
    group: BoxGroup | None = None  # its cgroup (the CPU time of all its processes), if one could be made
    last_cpu: float = 0.0  # the CPU time last read (what a box that died before its count had used)
    last_stalled: float = 0.0  # the time waiting for a processor last read
    fresh: bool = True  # no learner code has run in it yet
    uid: int | None = None  # its fresh uid, if it has one
    delays: dict = field(default_factory=dict)  # thread -> seconds it waited for a processor (no cgroup)

    def stalled(self) -> float:
        """Seconds the box's processes were ready to run but waited for a processor: its cgroup's pressure
        stall count, else the sum of its threads' run-queue delays (/proc/<pid>/task/<tid>/schedstat, kept
        for threads that have ended), 0 where the kernel says neither."""
        seconds = self.group.stalled_seconds() if self.group is not None else None
        if seconds is None and self.init is not None:
            self.delays.update(_run_delays(self.init))
            seconds = sum(self.delays.values())
        if seconds is not None:
            self.last_stalled = max(self.last_stalled, seconds)
        return self.last_stalled

    def cpu(self) -> float:
        """CPU seconds the box has used: its cgroup's count, else what /proc shows of its processes."""
        seconds = self.group.cpu_seconds() if self.group is not None else (
            _learner_cpu(self.init) if self.init is not None else None)
        if seconds is not None:
            self.last_cpu = max(self.last_cpu, seconds)
        return self.last_cpu


class Sandbox:
    """One template process (see the module docstring): started on first use, kept until close().

    ``confine``: a mode name to insist on (None: the strongest that works here, ``plain`` only if
    ``allow_plain``). ``private``: paths the boxes must not reach besides the kit's own (a course, the
    records): where boxes are only other uids (``container``), they are made private to root before the
    first box starts (``grader.lockdown``). Wherever boxes run, a probe box proves they cannot reach them
    before any learner code runs. Thread-safe. ``dropped_output`` counts the bytes of learner output the
    cap dropped, over every box.
    """

    def __init__(self, *, confine=None, allow_plain=False, private=(), start_seconds=START_SECONDS):
        self.confine = confine
        self.allow_plain = allow_plain
        self.private = tuple(map(str, private))
        self.start_seconds = start_seconds
        self.confinement: Confinement | None = None
        self.dropped_output = 0
        self.stats = {"starts": 0, "start_seconds": [], "boxes": 0}
        self._proc = None
        self._control = None
        self._template = None  # the template's pid
        self._folder = None
        self._capture = None
        self._launched = None  # the mode of a template launched but not yet known to be ready
        self._lock = threading.RLock()
        self._finalizer = None

    @property
    def mode(self) -> str | None:
        return self.confinement.mode if self.confinement else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _modes(self) -> list[str]:
        if self.confine:
            return [self.confine]
        return [self.confinement.mode] if self.confinement else candidate_modes(self.allow_plain)

    # -- the template's life

    def start_soon(self):
        """Launch the template now, without waiting for it: importing torch there overlaps the caller's
        own start (a pytest run collecting its tests). The first box (or ``start()``) waits for it.
        (The process is started by the calling thread, whose end would kill it: its parent-death
        signal follows the thread that started it.)"""
        with self._lock:
            modes = self._modes()
            if self._proc is None and modes:
                try:
                    _refuse(modes[0])
                    self._launch(modes[0])
                except SandboxUnavailable:
                    self._stop()  # start() tries again, and says why

    def start(self) -> Confinement:
        """Start the template if it is not running (or finish starting it), and prove its confinement with a
        probe box; returns the confinement. Raises ConfinementRefused where none holds (and plain is not
        allowed), SandboxUnavailable where a confinement that should hold failed its proof."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._launched is None:
                return self.confinement  # started, and ready
            launched = self._launched if self._proc is not None and self._proc.poll() is None else None
            failures = []
            for mode in self._modes():
                started = time.monotonic()
                try:
                    _refuse(mode)
                    if mode == "container" and _container_holds():
                        raise SandboxUnavailable(_container_holds())
                    if launched != mode:
                        self._stop()
                        self._launch(mode)
                    launched = None
                    self._await_ready(mode)
                    self._launched = None
                    private = self._make_private(mode)
                except SandboxUnavailable as exc:
                    failures.append(f"{mode}: {exc}")
                    continue
                why = "; ".join(failures) or (self.confinement.why if self.confinement else "")
                self.confinement = Confinement(mode, *_cgroups(), why=why, private=private)
                self._prove()  # a confinement that should hold and does not is no reason to try a weaker one
                self.stats["starts"] += 1
                self.stats["start_seconds"].append(round(time.monotonic() - started, 3))
                if self.confinement.missing:
                    warnings.warn(self.confinement.summary(), SandboxWarning, stacklevel=3)
                return self.confinement
            raise refusal(failures or ["no confinement was allowed"])

    def _make_private(self, mode) -> tuple:
        """Where boxes share this machine's file system (container): what they must not reach, private to root."""
        if mode != "container":
            return ()
        keep = [*lockdown.needed(), self._folder.path]
        return tuple(map(str, lockdown.make_private([*lockdown.kit_private(), *self.private], keep)))

    def _prove(self):
        """Before any learner code: a probe box must fail to read what is private (a hidden fixture, a
        solution, the grader, the caller's ``private`` paths), to write the grader's files, and under the
        learner's filter to run a program, start a process, create a file, open a socket or reach this
        process, its parent or the template. Anything it reached stops the sandbox: SandboxUnavailable."""
        if self.confinement.mode == "plain":
            return
        private = [*lockdown.kit_private(), *self.private]
        request = {"cmd": "probe", "token": secrets.token_hex(8), "read": lockdown.witnesses(private),
                   "write": [str(p) for p in private if Path(p).exists()], "need": lockdown.python_witnesses()}
        if self.confinement.mode == "container":  # (elsewhere these pids are not in the box's world)
            request["pids"] = [pid for pid in (os.getpid(), os.getppid(), self._template) if pid]
        box = self.spawn({}, Limits())
        try:
            deadline = time.monotonic() + BOX_SECONDS
            _send(box, pack(request), deadline, lambda: None)
            header, _ = _receive(box, deadline, lambda: None, 0)
        except (_OutOfTime, _BoxGone, ProtocolError) as exc:
            header = {"kind": "failed", "message": type(exc).__name__.strip("_")}
        finally:
            self.kill(box)
        reached = header.get("reached") if header.get("kind") == "probe" else None
        if reached != []:
            self._stop()
            what = ("; ".join(map(str, reached)) if isinstance(reached, list)
                    else "run a program (the probe ended without answering)" if header.get("kind") == "ended"
                    else f"answer ({header.get('message', header.get('kind'))})")
            raise SandboxUnavailable(f"the {self.confinement.mode} confinement does not hold on this machine: a "
                                     f"probe box could {what}. Nothing was graded."
                                     + (lockdown.PYTHON_HINT if "which it needs" in what else ""))

    def _launch(self, mode):
        """Start a template process confined by ``mode`` (it then imports torch: see _await_ready)."""
        namespaced = mode in ("namespaces", "userns")
        scratch.sweep()
        cgroups.sweep()
        folder = scratch.Folder("sandbox")
        root = folder.path
        blocked = [p for p in root.parents if not p.stat().st_mode & 0o001]
        if mode == "container" and blocked:  # (boxes are other users, on this machine's file system)
            folder.remove()
            raise SandboxUnavailable(f"the boxes' folder {root} is out of their reach ({blocked[0]} lets no other "
                                     "user through): set TMPDIR to a folder every user may pass through, e.g. /tmp")
        for name in ("runtime", "incoming", "newroot", "tmp"):
            (root / name).mkdir()
        shutil.copyfile(CHILD_SCRIPT, root / "runtime" / "sandbox_child.py")
        for module in RUNTIME_MODULES:
            shutil.copyfile(module, root / "runtime" / module.name)
        for path in [root, *root.rglob("*")]:
            if path.name != scratch.LOCK:  # the boxes' uids may pass through, read the runtime, list nothing
                path.chmod((0o711 if path.name in (root.name, "incoming", "tmp") else 0o755) if path.is_dir()
                           else 0o644)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {
            "control_fd": theirs.fileno(),
            "mode": mode,
            "newroot": str(root / "newroot") if namespaced else None,
            "runtime_host": str(root / "runtime"),
            "incoming_host": str(root / "incoming"),
            "runtime": "/sandbox/runtime" if namespaced else str(root / "runtime"),
            "secrets": [str(p) for p in (KIT, SOLUTIONS, SUITE, FIXTURES)],
            "drop": {"namespaces": "uid", "userns": "userns", "container": "uid"}.get(mode),
        }
        command = [*_unshare(mode), sys.executable, "-I", str(root / "runtime" / "sandbox_child.py"),
                   json.dumps(config)]
        if _setpriv_pdeathsig():
            command = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", *command]
        home = "/tmp" if namespaced else str(root / "tmp")
        env = {**ONE_THREAD, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "USER": "learner", "LOGNAME": "learner",
               "HOME": home, "TMPDIR": home}
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),), cwd=root, env=env, start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            theirs.close()
            folder.remove()
            raise SandboxUnavailable(str(exc)) from None
        finally:
            theirs.close()
        self._proc, self._control, self._folder = proc, ours, folder
        self._capture = _Capture({"stdout": proc.stdout, "stderr": proc.stderr}, 64 << 10)
        self._finalizer = weakref.finalize(self, _kill_template, proc, ours, folder)
        self._launched = mode

    def _await_ready(self, mode):
        """Wait for the launched template to say it is confined and has imported torch."""
        proc = self._proc
        reply = self._reply(None, time.monotonic() + self.start_seconds)
        if reply.get("kind") != "ready":
            tail = self._capture.last_lines("stderr", 5)
            lines = str(reply.get("message")).strip().splitlines() or [""]
            self._stop()
            raise SandboxUnavailable(lines[-1] + (f" (stderr: {tail})" if tail else ""))
        namespaced = mode in ("namespaces", "userns")
        self._template = next(iter(_children(proc.pid)), None) if namespaced else proc.pid

    def close(self):
        """Stop the template: it kills every box it still has, then exits."""
        with self._lock:
            self._stop()

    def _stop(self):
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = self._proc = self._control = self._folder = self._template = self._launched = None

    # -- talking to the template

    def _reply(self, token, deadline) -> dict:
        """The template's next answer (to the request for ``token``); {"kind": "failed"} if none."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"kind": "failed", "message": "the sandbox did not answer in time"}
            ready, _, _ = select.select([self._control], [], [], remaining)
            if not ready:
                continue
            try:
                data = self._control.recv(CONTROL_BYTES)
            except OSError as exc:
                data = b""
                failure = str(exc)
            else:
                failure = "the sandbox process ended"
            if not data:
                return {"kind": "failed", "message": failure}
            reply = json.loads(data)
            if token is None or reply.get("token") == token:
                return reply

    def spawn(self, sources: dict[str, bytes], limits: Limits) -> _Box:
        """A new box holding ``sources`` (file name -> module source), ready to serve stages."""
        with self._lock:
            confinement = self.start()
            token = secrets.token_hex(8)
            uid = None
            if confinement.mode in ("namespaces", "container"):
                uid = secrets.randbelow(UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0]
            incoming = self._folder.path / "incoming" / token
            incoming.mkdir(mode=0o700)
            for name, data in sources.items():
                (incoming / name).write_bytes(data)
                (incoming / name).chmod(0o400)
            # The submission is the box's to read, and nobody else's: its fresh uid owns it.
            if uid is not None:
                for path in [incoming, *incoming.iterdir()]:
                    os.chown(path, uid, uid)
            incoming.chmod(0o500)
            tmp = None
            if confinement.mode in ("container", "plain"):  # (with a mount namespace: a tmpfs of its own)
                tmp = self._folder.path / "tmp" / token
                tmp.mkdir(mode=0o700)
                if uid is not None:
                    os.chown(tmp, uid, uid)
            pipes = [os.pipe() for _ in range(4)]  # requests, replies, stdout, stderr
            for read, _ in pipes[2:]:
                with contextlib.suppress(OSError):  # (Linux) fewer wake-ups for a flood of output
                    fcntl.fcntl(read, fcntl.F_SETPIPE_SZ, 1 << 20)
            theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
            request = {"cmd": "spawn", "token": token, "limits": limits.for_box(confinement.mode),
                       "uid": uid,
                       "submission": str(incoming), "tmp": str(tmp) if tmp else None}
            try:
                socket.send_fds(self._control, [json.dumps(request).encode()], theirs)
                reply = self._reply(token, time.monotonic() + BOX_SECONDS)
            except OSError as exc:
                reply = {"kind": "failed", "message": str(exc)}
            finally:
                for fd in theirs:
                    os.close(fd)
            streams = {"stdout": os.fdopen(pipes[2][0], "rb", buffering=0),
                       "stderr": os.fdopen(pipes[3][0], "rb", buffering=0)}
            box = _Box(token, pipes[0][1], pipes[1][0], _Capture(streams, limits.output_bytes), incoming, tmp, uid=uid)
            if reply.get("kind") != "spawned":
                self._discard(box)
                self._stop()
                raise SandboxUnavailable(f"the sandbox could not start a box: {reply.get('message')}")
            self.stats["boxes"] += 1
            init = self._global_pid(reply.get("pid"))
        # The box's first message says it is confined and ready (no learner code has run yet).
        first = _first_message(box, time.monotonic() + BOX_SECONDS)
        if first.get("kind") != "ready":
            tail = box.capture.last_lines("stderr", 5)
            self.kill(box)
            raise SandboxUnavailable(f"a box failed to start: {first.get('message')}" + (f" ({tail})" if tail else ""))
        box.init = init
        if box.init is not None and self.confinement.cgroup:
            group = BoxGroup.create(limits.memory_bytes, limits.processes)
            if group is not None and group.add(box.init):  # before it forks anything
                box.group = group
            elif group is not None:
                group.remove()
        return box

    def _global_pid(self, pid) -> int | None:
        """This process's pid of the template's child ``pid`` (the template numbers it in its own
        pid namespace)."""
        if self._template is None or not isinstance(pid, int):
            return None
        depth = len(_ns_pids(self._template)) - 1  # the template's own namespace, among its child's
        for child in _children(self._template):
            numbers = _ns_pids(child)
            if len(numbers) > depth >= 0 and numbers[depth] == pid:
                return child
        return None

    def kill(self, box: _Box):
        """Kill ``box`` and wait until the template reports it gone: every process of it dead (in a
        container, every process of its uid). A template that cannot say so is stopped, and the
        sandbox with it: SandboxUnavailable, for nothing a box that may live on did can be trusted."""
        with self._lock:
            gone = False
            if self._control is not None:
                try:
                    self._control.send(json.dumps({"cmd": "kill", "token": box.token}).encode())
                    reply = self._reply(box.token, time.monotonic() + BOX_SECONDS)
                except OSError:
                    reply = {"kind": "failed"}
                gone = reply.get("kind") == "gone"
                if not gone:
                    self._stop()  # a template that cannot kill its boxes is killed with them
            self._discard(box)
            if not gone and box.uid is not None and not _none_left(box.uid):
                raise SandboxUnavailable(f"a box's processes (uid {box.uid}) outlived it: nothing it did is trusted")

    def _discard(self, box: _Box):
        if box.group is not None:
            box.group.remove()
        with contextlib.suppress(OSError):
            box.incoming.chmod(0o700)  # (read-only for the box; its files may go now)
        for fd in (box.requests, box.replies):
            try:
                os.close(fd)
            except OSError:
                pass
        box.capture.thread.join(timeout=2)
        shutil.rmtree(box.incoming, ignore_errors=True)
        if box.tmp is not None:
            shutil.rmtree(box.tmp, ignore_errors=True)


def _none_left(uid, seconds=2.0) -> bool:
    """Whether every process of ``uid`` is gone within ``seconds`` (killed with their template: they die with
    their parents)."""
    deadline = time.monotonic() + seconds
    while processes_of(uid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_template(proc, control, folder):
    """Stop a template and everything it started; remove its folder (also at interpreter exit)."""
    try:
        control.close()  # the template kills its boxes and exits when it sees the socket close
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    # Under unshare, the template is the init of its pid namespace: killing it takes every
    # process of the namespace (all boxes) with it; then unshare itself.
    for pid in [*_children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    folder.remove()


def _clip(text, limit=MESSAGE_CHARS) -> str:
    """A string from a box, cut to ``limit`` characters: its messages end up in every record."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f" [... {len(text) - limit} more characters]"


def _first_message(box: _Box, deadline) -> dict:
    """A box's first message ({"kind": "ready"} or "failed"), read with this process's limits."""
    try:
        header, _ = _receive(box, deadline, lambda: None, 0)
        return header
    except (_OutOfTime, _BoxGone, ProtocolError) as exc:
        return {"kind": "failed", "message": type(exc).__name__.strip("_")}


class _Waiting:
    """The time an operation on ``box`` has waited so far: wall-clock seconds since it began, less
    the time the box's processes were ready to run but waited for a processor. On a loaded machine
    a working box waits for a processor; that is the machine's load, not the learner's time."""

    def __init__(self, box: _Box):
        self.box, self.started, self.stalled = box, time.monotonic(), box.stalled()

    def __call__(self) -> float:
        return time.monotonic() - self.started - (self.box.stalled() - self.stalled)


class _OutOfTime(Exception):
    def __init__(self, what):
        super().__init__(what)
        self.what = what  # "check", "wall", "budget" or "close"


class _BoxGone(Exception):
    pass


def _wait(fd, deadline, charge, write=False):
    """Block until ``fd`` can be read (or written); ``charge()`` checks the time limits meanwhile."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _OutOfTime("wall")
        readable, writable, _ = select.select([] if write else [fd], [fd] if write else [], [],
                                              min(POLL_SECONDS, remaining))
        if readable or writable:
            return
        charge()


def _read(box, size, deadline, charge):
    chunks = []
    while size:
        _wait(box.replies, deadline, charge)
        chunk = os.read(box.replies, min(size, 1 << 20))
        if not chunk:
            raise _BoxGone
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(box, deadline, charge, result_bytes):
    """One message from the box, checked against the size limits before it is read."""
    (size,) = LENGTH.unpack(_read(box, LENGTH.size, deadline, charge))
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes")
    try:
        header = json.loads(_read(box, size, deadline, charge))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad header ({type(exc).__name__})") from None
    sizes = header.pop("blobs", None) if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError("bad blob list")
    if sum(sizes) > result_bytes:
        raise ProtocolError(f"a result of {sum(sizes)} bytes (limit {result_bytes})")
    return header, [_read(box, n, deadline, charge) for n in sizes]


def _send(box, message, deadline, charge):
    data = memoryview(message)
    while data:
        _wait(box.requests, deadline, charge, write=True)
        try:
            data = data[os.write(box.requests, data[: 1 << 16]):]
        except BrokenPipeError:
            raise _BoxGone from None


# ---------------------------------------------------------------- the backend

class IsolatedBackend:
    """Like ``adapters.LocalBackend``, but the learner's code runs in boxes (see the module docstring).

    One backend per submission: its modules are read once, here. ``sandbox``: the template to
    take boxes from (None: a template of its own, stopped by ``close()``). The test harness calls
    ``start_check()`` at the start of each test; without it, every operation is a check of its
    own. ``last_output`` holds what the learner printed during the most recent operation.

    A stage that builds on others (stage 9's wrapper imports stage 8's ``CausalAttention``) is run
    with the reference versions of those (``provided``: stage -> {module: source},
    ``reference_imports``; default: those of the kit's solutions/), so that a mistake costs points
    on its own stage only. Without solutions/ (a release has none), nothing is provided. No box that
    was given the reference of a stage ever serves that stage.

    A stage may come with a memory ceiling (``ceilings``: stage -> bytes, what its test module declares
    as ``MEMORY_HEADROOM``): its worker's address space is then held by the kernel (RLIMIT_AS) to what it
    was when the stage started plus that much, before the learner's module is imported. Code inside the
    learner's process can hide what it allocates from any measurement taken there, not from that.
    """

    def __init__(self, root, limits: Limits | None = None, *, sandbox: Sandbox | None = None, confine=None,
                 provided: dict[str, dict[str, str]] | None = None, ceilings: dict[str, int] | None = None):
        self.root = Path(root).resolve()
        self.limits = limits or Limits()
        self.sources = sources(self.root)
        self.provided = reference_imports(SOLUTIONS) if provided is None else provided
        self.ceilings = dict(ceilings or {})
        self.sandbox = sandbox or Sandbox(confine=confine)
        self._own_sandbox = sandbox is None
        import adapters  # (torch: imported where a backend is made, not where the sandbox is merely named)

        self.adapters = adapters
        self.stats = {"boxes": 0, "workers": 0, "stages": 0, "leaving": {}, "dropped_output": {},
                      "cpu_seconds": 0.0, "wall_seconds": 0.0}
        self.last_output = {"stdout": "", "stderr": ""}
        self._box: _Box | None = None
        self._module = None  # the stage module the box's current worker serves
        self._token = None  # names the current stage's requests and replies
        self._worker = None  # the token the current worker was forked for (None: no worker)
        self._held: set[str] = set()  # the stages whose reference the current box has been given
        self._cpu_before = 0.0  # CPU time of this submission's earlier boxes
        self._wall = 0.0  # wall time of this submission's operations so far
        self._check_cpu = 0.0  # CPU time used when the current check started
        self._check_wall = 0.0  # wall time of the current check's operations so far
        self._checks_from_caller = False
        self._exhausted = False
        self._own = None  # fingerprints of the submission's own modules (grader.redaction), made when first needed
        # Whose release the student has (what needs no hiding): the assignment of the submission's modules.
        self._assignment = next((assignment_of(Path(name).stem) for name in self.sources), None)
        self._lock = threading.Lock()

    @property
    def mode(self):
        return self.sandbox.mode

    @property
    def confinement(self) -> Confinement | None:
        return self.sandbox.confinement

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            self._end_box()
            if self._own_sandbox:
                self.sandbox.close()

    # -- time

    def cpu_used(self) -> float:
        """CPU seconds the learner's code has used so far, over every box of this submission."""
        current = self._box.cpu() if self._box is not None else None
        return self._cpu_before + (current or 0.0)

    def start_check(self):
        """A check (one test) begins: its time limit counts from here."""
        self._checks_from_caller = True
        with self._lock:
            self._begin_check()

    def _begin_check(self):
        self._check_cpu, self._check_wall = self.cpu_used(), 0.0
        if self._check_cpu >= self.limits.budget or self._wall >= self.limits.budget_wall:
            self._exhausted = True

    def _charger(self, waited: _Waiting, closing=False):
        """The function that ends an operation once a time limit is reached (``waited``: its waiting
        so far): the check's own limits and the submission's budget; ``closing`` (a stage's end, no
        check's time): the budget, CLOSE_SECONDS of CPU time and WALL_FACTOR times that of waiting."""
        limits, cpu_at_start = self.limits, self.cpu_used() if closing else self._check_cpu

        def charge():
            wall = waited()
            cpu = self.cpu_used()
            if cpu >= limits.budget or self._wall + wall >= limits.budget_wall:
                raise _OutOfTime("budget")
            if closing:
                if cpu - cpu_at_start >= CLOSE_SECONDS or wall >= WALL_FACTOR * CLOSE_SECONDS:
                    raise _OutOfTime("close")
            elif cpu - cpu_at_start >= limits.check_seconds:
                raise _OutOfTime("check")
            elif self._check_wall + wall >= limits.check_wall:
                raise _OutOfTime("wall")

        return charge

    def _time_message(self, module, what):
        limits = self.limits
        if what == "budget":
            return (f"{module}: the time budget of this submission ran out ({limits.budget:g} s of CPU time, or "
                    f"{limits.budget_wall:g} s of waiting, for all its checks together); this check and the "
                    "remaining ones were not run")
        if what == "wall":
            return (f"{module}: time limit of {limits.check_wall:g} s (wall clock, waiting) exceeded while the code "
                    "was waiting or sleeping (time.sleep, input(), a lock?)")
        return (f"{module}: time limit of {limits.check_seconds:g} s of CPU time for one check exceeded — an "
                "infinite loop? (or very slow code: keep the work in vectorized torch operations)")

    # -- the interface

    def run(self, op, module, **kwargs):
        a = self.adapters
        if op not in a.OPS:
            raise KeyError(op)
        if not is_stage_module(module):
            raise ValueError(f"{module!r} is not a stage module name (sNN_topic)")
        blobs = []
        value = encode(kwargs, blobs)
        with self._lock:
            if not self._checks_from_caller:
                self._begin_check()
            if self._exhausted:
                raise a.SubmissionError(self._time_message(module, "budget"))
            box = waited = None
            try:
                if self._box is None or self._module != module:
                    before = self.cpu_used()
                    box = self._ready_box(module)
                    # Start-up and the end of the last stage are no check's time (only the budget's).
                    self._check_cpu += self.cpu_used() - before
                else:
                    box = self._box
                box.capture.reset()
                waited = _Waiting(box)
                charge = self._charger(waited)
                deadline = waited.started + LOAD_FACTOR * self.limits.check_wall + 1
                token = secrets.token_hex(8)  # this operation's: a reply sent ahead answers nothing
                _send(box, pack({"cmd": "op", "op": op, "kwargs": value, "token": token}, blobs), deadline, charge)
                while True:
                    header, values = _receive(box, deadline, charge, self.limits.result_bytes)
                    if header.get("token") == token or self._worker_ended(header):
                        break  # anything else is left over from an earlier worker
                if header.get("kind") == "result":
                    return self._said_in(decode(header.get("value"), values))
                failure = self._failure(module, header)  # the learner's code raised: the box serves on
            except _OutOfTime as exc:
                self._end_box()
                if exc.what == "budget":
                    self._exhausted = True
                raise a.SubmissionError(self._time_message(module, exc.what)) from None
            except _BoxGone:
                tail = box.capture.last_lines("stderr") if box else ""
                self._end_box()
                raise a.SubmissionError(
                    f"{module}: the sandbox process died unexpectedly" + (f"; its last output:\n{tail}" if tail else "")
                ) from None
            except ProtocolError as exc:
                self._end_box()
                raise a.SubmissionError(f"{module}: the answer could not be read: {exc}") from None
            except BaseException:
                self._end_box()  # e.g. interrupted: the box is in an unknown state
                raise
            finally:
                if waited is not None:
                    elapsed = waited()
                    self._wall += elapsed
                    self._check_wall += elapsed
                    self.stats["wall_seconds"] = round(self._wall, 3)
                if box is not None:
                    self._collect_output(box, module)
        raise failure

    def _collect_output(self, box, module):
        self.last_output = {name: box.capture.text(name) for name in ("stdout", "stderr")}
        dropped = box.capture.dropped_bytes()
        if dropped:
            self.sandbox.dropped_output += dropped  # the output cap was hit (the verdict itself does not change)
            counts = self.stats["dropped_output"]
            counts[module] = counts.get(module, 0) + dropped
            box.capture.reset()

    def _failure(self, module, header):
        """The SubmissionError for a reply that is not a result."""
        a = self.adapters
        kind = header.get("kind")
        if kind == "submission_error":  # (the adapter's word in the box: an import that failed, a name missing)
            message = self._said(header.get("message"))
            return a.SubmissionError(message + (DENIED_NOTE if "Operation not permitted" in message else ""))
        if kind == "exception":
            what = f"{self._said(header.get('type'), 200)}: {self._said(header.get('message'))}"
            if header.get("type") == "PermissionError" or "Operation not permitted" in str(header.get("message")):
                what += DENIED_NOTE
            if header.get("memory") and module in self.ceilings:
                what = (f"{module}: out of memory: when graded, this stage may allocate "
                        f"{self.ceilings[module] / 2**20:g} MiB beyond what its process held when the stage "
                        f"started ({what})")
            elif header.get("memory"):
                what = f"{module}: memory limit of {self.limits.memory_bytes / 2**30:g} GiB exceeded ({what})"
            trace = self._said(header.get("traceback") or "")
            return a.SubmissionError(what + (f"\nwhere (most recent call last):\n{trace.rstrip()}" if trace else ""))
        if kind == "ended":
            self._module = self._token = self._worker = None  # the worker is gone; the next call starts another
            return a.SubmissionError(self._describe_end(module, header.get("status")))
        return a.SubmissionError(f"{module}: unexpected answer {kind!r} from the sandbox")

    def _said(self, text, limit=MESSAGE_CHARS) -> str:
        """A text from the box, as a student may read it: cut to ``limit`` characters, and without any stretch
        that quotes hidden material (grader.redaction: a stage built on another holds the other's reference)."""
        text = _clip(text, limit)
        if len(text) < redaction.WINDOW:
            return text
        if self._own is None:
            self._own = redaction.fingerprints(self.sources)
        return redaction.kit_redactor(self._assignment).clean(text, self._own)

    def _said_in(self, value):
        """A result from the box with every string in it passed through ``_said`` (what checks may print)."""
        if isinstance(value, str):
            return self._said(value, len(value))
        if isinstance(value, dict):
            return {self._said_in(k): self._said_in(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(map(self._said_in, value))
        return value

    def _describe_end(self, module, status):
        if not (type(status) is int and 0 <= status < 1 << 16):  # the box's word: check it
            return f"{module}: the child process ended before answering"
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            hint = {
                "SIGSEGV": " (a crash in native code: ctypes, or torch used out of bounds?)",
                "SIGKILL": " (killed: out of memory?)",
                "SIGXFSZ": f" (a file larger than {self.limits.tmp_bytes >> 20} MiB was written)",
                "SIGABRT": " (an abort in native code)",
            }.get(name, "")
            text = f"{module}: the child process died with signal {name}{hint}"
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            text = (f"{module}: the child process exited with code {code} before answering "
                    "(sys.exit/os._exit at import or in the function?)")
        tail = self._said(self._box.capture.last_lines("stderr")) if self._box else ""
        return text + (f"\nits last output on stderr:\n{tail}" if tail else "")

    # -- boxes and stages

    def _worker_ended(self, header):
        """Whether ``header`` says that the current worker has gone (crashed, exited)."""
        return header.get("kind") == "ended" and self._worker is not None and header.get("token") == self._worker

    def _ready_box(self, module) -> _Box:
        """The box, with a worker serving ``module``: the current one, or a new box after a stage that
        would not end cleanly or a channel its worker jammed (the learner's doing: no check fails for it,
        but the time counts against the budget). A new box that will not take its first request is
        the sandbox's failure, not the learner's: SandboxUnavailable."""
        if self._box is not None and module in self._held:
            self._end_box()  # it was given the reference of ``module`` (for a stage built on it): never ``module``
        if self._box is not None and self._module not in (None, module) and not self._close_stage():
            self._end_box()  # a worker that will not close its stage costs a new box, no more
        while True:
            if self._box is None:
                self._box = self.sandbox.spawn(self.sources, self.limits)
                self.stats["boxes"] += 1
            if self._module == module or self._open(module):
                return self._box
            fresh = self._box.fresh
            self._end_box()
            if fresh:
                raise SandboxUnavailable("a new box stopped listening before any learner code ran")

    def _close_stage(self) -> bool:
        """End the current stage: its worker then stays for the next ("parked") or leaves. False if
        the box misbehaved (no answer in time, garbage, gone)."""
        box, token = self._box, self._token
        waited = _Waiting(box)
        charge = self._charger(waited, closing=True)
        try:
            deadline = waited.started + LOAD_FACTOR * WALL_FACTOR * CLOSE_SECONDS
            _send(box, pack({"cmd": "close", "token": token}), deadline, charge)
            while True:
                header, _ = _receive(box, deadline, charge, 0)
                kind = header.get("kind")
                if (header.get("token") == token and kind in ("parked", "leaving")) or self._worker_ended(header):
                    break
        except (_OutOfTime, _BoxGone, ProtocolError) as exc:
            if isinstance(exc, _OutOfTime) and exc.what == "budget":
                self._exhausted = True
            return False
        finally:
            self._wall += waited()
        if kind != "parked":
            self._worker = None  # the box forks a fresh one for the next stage
        if kind == "leaving":
            self._count_leaving(header.get("changed"))
        self._module = self._token = None
        return True

    def _count_leaving(self, changed):
        """What made workers leave (for the kit's own measurements): the worker's word, so a few
        short names at most."""
        counts = self.stats["leaving"]
        for what in (changed if isinstance(changed, list) else [])[:5]:
            if isinstance(what, str) and len(what) <= 64 and (what in counts or len(counts) < 32):
                counts[what] = counts.get(what, 0) + 1

    def _open(self, module) -> bool:
        """Ask for a worker serving ``module``, with the reference sources of the stages it builds on:
        the parked one takes it, or the box forks one. The module's import is learner code: it runs
        on the first operation's time. False if the box will not take the request (a worker may have
        jammed the channel); the wait counts against the budget."""
        token = secrets.token_hex(8)
        provided = self.provided.get(module, {})
        self._held.update(provided)
        waited = _Waiting(self._box)
        try:
            # (a request this small, a few kB, waits for nothing but a pipe jammed on purpose)
            _send(self._box, pack({"cmd": "open", "module": module, "token": token, "provided": provided,
                                   "memory_headroom": self.ceilings.get(module)}),
                  waited.started + CLOSE_SECONDS, self._charger(waited, closing=True))
        except _OutOfTime as exc:
            if exc.what == "budget":
                raise
            return False
        except _BoxGone:
            return False
        finally:
            self._wall += waited()
        self._box.fresh = False
        self._token, self._module = token, module
        self.stats["stages"] += 1
        if self._worker is None:
            self._worker = token
            self.stats["workers"] += 1
        return True

    def _end_box(self):
        """Kill the current box (never used again) and count the CPU time it used."""
        box, self._box = self._box, None
        self._module = self._token = self._worker = None
        self._held = set()
        if box is None:
            return
        cpu = box.cpu()
        self.sandbox.kill(box)
        self._cpu_before += cpu or 0.0
        self.stats["cpu_seconds"] = round(self._cpu_before, 3)


def reference_imports(folder) -> dict[str, dict[str, str]]:
    """For each stage module of ``folder`` (the reference solutions), the sources of the stage modules
    it builds on: those it imports, and those they import in turn, each after the ones it imports
    (the order ``adapters.load_stage_module`` runs them in). A stage is never among its own. Nothing
    where there is no such folder (a student's release)."""
    if not Path(folder).is_dir():
        return {}
    texts = {path.stem: path.read_text() for path in module_files(folder)}

    def built_on(stage):
        order, seen = [], {stage}

        def visit(name):
            for other in builds_on(texts[name]):
                if other in texts and other not in seen:
                    seen.add(other)
                    visit(other)
                    order.append(other)

        visit(stage)
        return {name: texts[name] for name in order}

    return {stage: built_on(stage) for stage in texts}


@cache
def _setpriv_pdeathsig() -> bool:
    """Whether util-linux's setpriv can set a parent-death signal (2.33 and later)."""
    path = shutil.which("setpriv")
    if not path:
        return False
    try:
        return "--pdeathsig" in subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
