"""Run untrusted learner code in a separate, locked-down process.

``IsolatedBackend(root)`` has the interface of ``adapters.LocalBackend``:
``run(op, module, **kwargs)`` returns the same plain values, but the learner's
modules are imported and run in a child process; this (trusted) process never
imports them. What comes back is plain data (numbers, strings, numeric/bool
NumPy arrays, lists/tuples/dicts of those), sent as JSON plus ``.npy`` blobs
without pickle and checked here (see ``grader.sandbox_child``). Every
conclusion (comparisons, points) is drawn in this process.

Confinement, strongest first (the first that starts on this machine is used;
``IsolatedBackend.mode`` says which, and a weaker one emits a warning):

``namespaces``  (root) ``unshare`` puts the child in new mount, pid, network,
                IPC and UTS namespaces. The child pivots into a fresh root file
                system holding only /usr, /etc, the Python installation and a
                private copy of the submission (read-only), with small private
                /tmp and /dev, then switches to a dedicated unprivileged uid.
                The kit (solutions, tests, hidden fixtures), other submissions
                and the gradebook do not exist in its world; it has no network.
``userns``      (no root needed) the same inside an unprivileged user namespace;
                privileges are dropped by entering a nested user namespace.
``uid``         (root without namespaces, e.g. a locked-down container) only the
                dedicated uid: files readable by everyone stay readable.
``plain``       a child process with resource limits, nothing more.

Limits per call: wall-clock time (the child is killed and restarted later),
address space (RLIMIT_AS), processes (RLIMIT_NPROC of the dedicated uid, and
the pid namespace dies with its init), captured stdout/stderr (drained by a
thread, kept up to ``output_bytes``, the rest counted and dropped), files the
child writes (a small tmpfs, RLIMIT_FSIZE).

Process layout: one child ("zygote") per backend imports torch once, then
forks a worker; the worker imports the learner's stage module afresh for each
stage and answers the operations on it. It goes on to the next stage only if
the last one left the process as the zygote had it (same objects behind the
names of torch, numpy, builtins and the adapter, same torch modes and hooks, no
new threads, processes or held memory: ``sandbox_child.process_state``);
otherwise it exits and the zygote forks a clean worker, so a module that
rebinds torch's functions changes no other stage's grade. What the check cannot
see (a function's code object swapped, torch's C internals) can reach the same
submission's later stages, never another submission: each submission starts
from a fresh fork of the clean zygote. Reusing the worker saves a fork and
torch's first-touch page copies per stage (about 8 ms each). A crash in one
stage costs that stage only; a timeout kills the whole child, which is
restarted on the next call.

Warm reuse (``keep_warm()``, for grading many submissions in one process):
closing a backend then keeps its zygote instead of killing it, and the next
``IsolatedBackend`` with the same limits takes it over, so torch is imported
once per grading process rather than once per submission. Before the handover
the zygote's workers are gone (its pid namespace holds nothing else), its
scratch space (/tmp, /dev/shm) is emptied, and the read-only submission
folder it sees is refilled with the new submission's modules. Only the
confinements with a pid namespace and a private file system are reused; with
weaker ones a leftover process could outlive its submission, so those
children are still killed.
"""
from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path

from . import FIXTURES, KIT, SOLUTIONS, TESTS
from .kit import adapters
from .sandbox_child import LENGTH, ProtocolError, decode, encode, pack

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
STAGE_FILE = re.compile(r"^s\d\d_\w+\.py$")
MAX_MODULE_BYTES = 1 << 20  # a stage module larger than this is not copied
MAX_HEADER_BYTES = 16 << 20
UID_BASE = 1_500_000_000  # dedicated uids come from here on (no real user lives there)

_chosen_mode = None  # the first confinement that worked in this process
_warned = set()
_uid_counter = 0
REUSABLE = ("namespaces", "userns")  # confinements whose children may serve another submission
_warm = {"enabled": False, "idle": {}}  # see keep_warm(); idle: limits key -> _Child
_warm_lock = threading.Lock()
_dropped = [0]  # bytes of learner output dropped by the output cap, all backends of this process


def dropped_output_bytes() -> int:
    """How much learner output the cap has dropped so far in this process (a running count)."""
    return _dropped[0]


class SandboxWarning(UserWarning):
    """The sandbox runs with weaker confinement than it would like."""


class SandboxUnavailable(RuntimeError):
    """No way to start the child process works on this machine (not the learner's fault)."""


class _Timeout(Exception):
    pass


class _ChildGone(Exception):
    pass


# ---------------------------------------------------------------- output capture

class _Capture:
    """Drains the child's stdout and stderr so that it never blocks on a full pipe.

    Keeps the first ``limit`` bytes of each stream and a short rolling tail; counts
    the rest. Memory use stays bounded however much the child prints.
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
                chunk = os.read(fd, 1 << 16)
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

    def last_lines(self, name, count=12):
        with self.lock:
            data = self.tail[name] if self.dropped[name] else bytes(self.head[name][-self.TAIL:])
        return "\n".join(data.decode(errors="replace").rstrip().splitlines()[-count:])


# ---------------------------------------------------------------- the child process

class _Child:
    """One running child: the process, its pipes, its work directory. Killing is idempotent."""

    def __init__(self, proc, requests, replies, capture, workdir, uid, unshared):
        self.proc, self.requests, self.replies = proc, requests, replies
        self.unshared = unshared  # proc is unshare, and the zygote its child
        self.capture, self.workdir, self.uid = capture, workdir, uid
        self.alive = True

    def kill(self):
        if not self.alive:
            return
        self.alive = False
        # Under unshare, kill the zygote first (the init of the pid namespace: its death
        # takes every process of the namespace with it) so that unshare, still alive, reaps
        # it; then the whole process group (unshare itself, or the zygote in plain modes).
        if self.unshared:
            for pid in _children(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.uid is not None:
            # Without a pid namespace strays may have left the process group; with one,
            # the kernel tears the namespace down asynchronously. Either way, wait (briefly)
            # until nothing runs under the dedicated uid any more.
            for _ in range(100):
                if not _kill_uid(self.uid):
                    break
                time.sleep(0.02)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self.requests, self.replies):
            try:
                os.close(fd)
            except OSError:
                pass
        self.capture.thread.join(timeout=1)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _children(pid):
    """The children of process ``pid`` (Linux /proc), or [] when that cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except (OSError, ValueError):
        return []


def _kill_uid(uid):
    """Kill every process whose real uid is ``uid`` (a dedicated sandbox uid, never a person's).

    Returns how many there were (zombies included).
    """
    found = 0
    if uid < UID_BASE:
        return found
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as status:
                    for line in status:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                found += 1
                                os.kill(int(entry), signal.SIGKILL)
                            break
            except (OSError, ValueError):
                pass
    return found


def _modes():
    """Confinements worth trying here, strongest first."""
    unshare = shutil.which("unshare")
    modes = []
    if unshare and os.geteuid() == 0:
        modes.append("namespaces")
    if unshare:
        modes.append("userns")
    if os.geteuid() == 0:
        modes.append("uid")
    modes.append("plain")
    return modes


def _warn_once(mode, why):
    if mode not in _warned:
        _warned.add(mode)
        warnings.warn(f"grader.sandbox: confinement degraded to {mode!r}: {why}", SandboxWarning, stacklevel=4)


WEAKNESS = {
    "userns": "no root: privileges are dropped with a nested user namespace (the file system is still hidden)",
    "uid": "no namespaces here: the child runs under a dedicated uid but can read every world-readable "
           "file, including the kit's solutions and hidden fixtures unless their permissions forbid it",
    "plain": "no namespaces and no root: the child has the grader's own rights (resource limits only)",
}


def submission_sources(root) -> dict[str, bytes]:
    """The stage modules of folder ``root`` the child may see: regular files named sNN_topic.py of
    at most MAX_MODULE_BYTES. Symlinks are not followed (one could point at the solutions)."""
    sources = {}
    for path in sorted(Path(root).iterdir()):
        if STAGE_FILE.match(path.name) and path.is_file() and not path.is_symlink():
            if path.stat().st_size <= MAX_MODULE_BYTES:
                sources[path.name] = path.read_bytes()
    return sources


def _fill(folder: Path, sources: dict[str, bytes]):
    """Make ``folder`` hold exactly ``sources`` (readable by the child's dedicated uid)."""
    for old in folder.iterdir():
        old.unlink()
    for name, data in sources.items():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o644)


def keep_warm(enabled: bool = True):
    """Keep closed backends' children for the next IsolatedBackend of this process (see the module
    docstring). Turning it off kills the idle children."""
    _warm["enabled"] = enabled
    if not enabled:
        discard_warm()


def discard_warm():
    """Kill the idle warm children."""
    with _warm_lock:
        idle, _warm["idle"] = list(_warm["idle"].values()), {}
    for child in idle:
        child.kill()


atexit.register(discard_warm)


# ---------------------------------------------------------------- the backend

class IsolatedBackend:
    """Like ``adapters.LocalBackend``, but the learner's code runs in a confined child process.

    One child per backend (per submission), reused across calls and restarted after
    a timeout. Use ``close()`` or ``with IsolatedBackend(root) as backend:``.
    ``last_output`` holds what the learner printed during the most recent call.
    """

    def __init__(self, root, *, wall_seconds=20.0, memory_bytes=4 << 30, output_bytes=1 << 20,
                 processes=64, tmp_bytes=64 << 20, result_bytes=256 << 20, start_seconds=120.0,
                 confine=None):
        self.root = Path(root).resolve()
        self.wall_seconds = wall_seconds
        self.memory_bytes = memory_bytes
        self.output_bytes = output_bytes
        self.processes = processes
        self.tmp_bytes = tmp_bytes
        self.result_bytes = result_bytes
        self.start_seconds = start_seconds
        self.confine = confine  # None: the strongest that works; or one of the mode names
        self.mode = None
        self.degraded = ""  # why stronger confinements failed, if they did
        self.adapters = adapters()
        self.stats = {"starts": 0, "start_seconds": [], "reused": 0, "dropped_output": {}, "workers": 0,
                      "stages": 0, "leaving": {}}
        self.last_output = {"stdout": "", "stderr": ""}
        self._child = None
        self._module = None  # the stage module the current worker serves
        self._token = None  # names the current stage's requests and replies
        self._worker = None  # the token the current worker was forked for (None: no worker)
        self._lock = threading.Lock()
        self._finalizer = None

    # -- context manager and cleanup

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            if not (_warm["enabled"] and self.mode in REUSABLE and self._release()):
                self._stop()

    def _warm_key(self):
        return (self.mode, self.memory_bytes, self.processes, self.tmp_bytes, _torch_threads())

    def _release(self) -> bool:
        """Hand a clean child to the warm pool; False if it could not be cleaned (then kill it)."""
        child = self._child
        if child is None or not child.alive:
            return False
        deadline = time.monotonic() + 5
        try:
            self._retire(deadline)
            token = secrets.token_hex(8)
            self._send({"cmd": "reset", "token": token}, [], deadline)
            while True:
                header, _ = self._receive(deadline)
                if header.get("kind") == "reset" and header.get("token") == token:
                    break
        except (_Timeout, _ChildGone, ProtocolError):
            return False
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._child = None
        self._module = self._token = self._worker = None
        _fill(child.workdir / "box" / "submission", {})
        with _warm_lock:
            previous = _warm["idle"].pop(self._warm_key(), None)
            _warm["idle"][self._warm_key()] = child
        if previous is not None:
            previous.kill()
        return True

    def _take_warm(self) -> bool:
        """Take over an idle child with this backend's limits, refilled with this submission."""
        modes = [self.confine] if self.confine else [_chosen_mode]
        for mode in modes:
            if mode not in REUSABLE:
                continue
            self.mode = mode
            with _warm_lock:
                child = _warm["idle"].pop(self._warm_key(), None)
            if child is None:
                continue
            if child.proc.poll() is not None:
                child.kill()
                continue
            _fill(child.workdir / "box" / "submission", submission_sources(self.root))
            child.capture.limit = self.output_bytes
            self._child = child
            self._finalizer = weakref.finalize(self, child.kill)
            self.stats["reused"] += 1
            return True
        return False

    def _stop(self):
        if self._child is not None:
            self._child.kill()
            self._child = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._module = self._token = self._worker = None

    # -- the interface

    def run(self, op, module, **kwargs):
        a = self.adapters
        if op not in a.OPS:
            raise KeyError(op)
        if not a.STAGE_MODULE.match(module):
            raise ValueError(f"{module!r} is not a stage module name (sNN_topic)")
        blobs = []
        body = encode(kwargs, blobs)
        with self._lock:
            self._ensure_child()
            if self._module != module:
                self._open(module)
            self._child.capture.reset()
            deadline = time.monotonic() + self.wall_seconds
            try:
                self._send({"cmd": "op", "op": op, "kwargs": body, "token": self._token}, blobs, deadline)
                while True:
                    header, values = self._receive(deadline)
                    if header.get("token") == self._token or self._worker_ended(header):
                        break  # anything else is left over from an earlier worker
                kind = header.get("kind")
                if kind == "result":
                    return decode(header.get("value"), values)
                raise self._failure(module, header)
            except _Timeout:
                self._stop()
                raise a.SubmissionError(
                    f"{module}: time limit of {self.wall_seconds:g} s exceeded — an infinite loop? "
                    "(or very slow code: keep the work in vectorized torch operations)"
                ) from None
            except _ChildGone:
                tail = self._child.capture.last_lines("stderr")
                self._stop()
                raise a.SubmissionError(
                    f"{module}: the sandbox process died unexpectedly" + (f"; its last output:\n{tail}" if tail else "")
                ) from None
            except ProtocolError as exc:
                self._stop()
                raise a.SubmissionError(f"{module}: the answer could not be read: {exc}") from None
            finally:
                if self._child is not None:
                    self.last_output = {name: self._child.capture.text(name) for name in ("stdout", "stderr")}
                    with self._child.capture.lock:
                        dropped = sum(self._child.capture.dropped.values())
                    if dropped:
                        _dropped[0] += dropped  # the output cap was hit (the verdict itself does not change)
                        counts = self.stats["dropped_output"]
                        counts[module] = counts.get(module, 0) + dropped

    def _failure(self, module, header):
        """The SubmissionError for a reply that is not a result."""
        a = self.adapters
        kind = header.get("kind")
        if kind == "submission_error":
            return a.SubmissionError(str(header.get("message")))
        if kind == "exception":
            what = f"{header.get('type')}: {header.get('message')}"
            if header.get("memory"):
                what = f"{module}: memory limit of {self.memory_bytes / 2**30:g} GiB exceeded ({what})"
            trace = str(header.get("traceback") or "")
            return a.SubmissionError(what + (f"\nwhere (most recent call last):\n{trace.rstrip()}" if trace else ""))
        if kind == "ended":
            self._module = self._token = self._worker = None  # the worker is gone; the next call starts another
            return a.SubmissionError(self._describe_end(module, header.get("status")))
        return a.SubmissionError(f"{module}: unexpected answer {kind!r} from the sandbox")

    def _describe_end(self, module, status):
        status = status if isinstance(status, int) else -1
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            hint = {
                "SIGSEGV": " (a crash in native code: ctypes, or torch used out of bounds?)",
                "SIGKILL": " (killed: out of memory?)",
                "SIGXFSZ": f" (a file larger than {self.tmp_bytes >> 20} MiB was written)",
                "SIGABRT": " (an abort in native code)",
            }.get(name, "")
            text = f"{module}: the child process died with signal {name}{hint}"
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            text = (f"{module}: the child process exited with code {code} before answering "
                    "(sys.exit/os._exit at import or in the function?)")
        tail = self._child.capture.last_lines("stderr") if self._child else ""
        return text + (f"\nits last output on stderr:\n{tail}" if tail else "")

    # -- talking to the child

    def _send(self, header, blobs, deadline):
        data = memoryview(pack(header, blobs))
        fd = self._child.requests
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            _, writable, _ = select.select([], [fd], [], remaining)
            if writable:
                try:
                    data = data[os.write(fd, data[: 1 << 16]):]
                except BrokenPipeError:
                    raise _ChildGone from None

    def _read(self, size, deadline):
        fd, chunks = self._child.replies, []
        while size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, min(size, 1 << 20))
                if not chunk:
                    raise _ChildGone
                chunks.append(chunk)
                size -= len(chunk)
        return b"".join(chunks)

    def _receive(self, deadline):
        """One message from the child, checked against the size limits before it is read."""
        (size,) = LENGTH.unpack(self._read(LENGTH.size, deadline))
        if size > MAX_HEADER_BYTES:
            raise ProtocolError(f"header of {size} bytes")
        try:
            header = json.loads(self._read(size, deadline))
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"bad header ({type(exc).__name__})") from None
        sizes = header.pop("blobs", None) if isinstance(header, dict) else None
        if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
            raise ProtocolError("bad blob list")
        if sum(sizes) > self.result_bytes:
            raise ProtocolError(f"a result of {sum(sizes)} bytes (limit {self.result_bytes})")
        return header, [self._read(n, deadline) for n in sizes]

    def _worker_ended(self, header):
        """Whether ``header`` is the zygote's word that the current worker has gone (crashed, exited)."""
        return header.get("kind") == "ended" and self._worker is not None and header.get("token") == self._worker

    def _close_stage(self, deadline):
        """End the current stage, if any: the worker then stays for the next ("parked") or leaves."""
        if self._module is None:
            return
        self._send({"cmd": "close", "token": self._token}, [], deadline)
        while True:
            header, _ = self._receive(deadline)
            kind = header.get("kind")
            if (header.get("token") == self._token and kind in ("parked", "leaving")) or self._worker_ended(header):
                break
        if kind != "parked":
            self._worker = None  # the zygote forks a fresh one for the next stage
        if kind == "leaving":
            for what in header.get("changed") or []:
                self.stats["leaving"][str(what)] = self.stats["leaving"].get(str(what), 0) + 1
        self._module = self._token = None

    def _retire(self, deadline):
        """End the current stage and send the worker away; afterwards the zygote is alone."""
        self._close_stage(deadline)
        if self._worker is not None:
            self._send({"cmd": "exit"}, [], deadline)
            while not self._worker_ended(self._receive(deadline)[0]):
                pass
            self._worker = None

    def _open(self, module):
        """End the current stage, if any, and ask for one serving ``module``: the parked worker
        takes it, or the zygote forks one."""
        if self._module is not None:
            try:
                self._close_stage(time.monotonic() + 5)
            except (_Timeout, _ChildGone, ProtocolError):
                self._stop()  # a worker that will not answer costs a restart, no more
                self._ensure_child()
        self._token = secrets.token_hex(8)
        self._module = module
        self.stats["stages"] += 1
        if self._worker is None:
            self._worker = self._token
            self.stats["workers"] += 1
        try:
            self._send({"cmd": "open", "module": module, "token": self._token}, [], time.monotonic() + 5)
        except (_Timeout, _ChildGone):
            self._stop()
            raise SandboxUnavailable("the sandbox stopped listening while idle") from None

    # -- starting the child

    def _ensure_child(self):
        global _chosen_mode
        if self._child is not None:
            return
        if _warm["enabled"] and self._take_warm():
            return
        modes = [self.confine] if self.confine else ([_chosen_mode] if _chosen_mode else _modes())
        failures = []
        for mode in modes:
            started = time.monotonic()
            try:
                self._child = self._start(mode)
            except SandboxUnavailable as exc:
                failures.append(f"{mode}: {exc}")
                continue
            self.stats["starts"] += 1
            self.stats["start_seconds"].append(time.monotonic() - started)
            self.mode = mode
            if not self.confine:
                _chosen_mode = mode
            self.degraded = "; ".join(failures)
            if mode in WEAKNESS:
                _warn_once(mode, WEAKNESS[mode] + (f"; stronger ones failed: {self.degraded}" if failures else ""))
            child = self._child
            self._finalizer = weakref.finalize(self, child.kill)  # also runs at interpreter exit
            return
        raise SandboxUnavailable("cannot start the sandbox:\n  " + "\n  ".join(failures))

    def _start(self, mode):
        global _uid_counter
        a = self.adapters
        workdir = Path(tempfile.mkdtemp(prefix="attnkit-sandbox-"))
        box = workdir / "box"
        (box / "runtime").mkdir(parents=True)
        (box / "submission").mkdir()
        (workdir / "newroot").mkdir()
        (workdir / "tmp").mkdir()
        _fill(box / "submission", submission_sources(self.root))  # the child's whole view of the submission
        shutil.copyfile(CHILD_SCRIPT, box / "runtime" / "sandbox_child.py")
        shutil.copyfile(a.__file__, box / "runtime" / "adapters.py")
        for path in [workdir, *workdir.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)

        uid = None
        if mode in ("namespaces", "uid"):
            _uid_counter += 1
            uid = UID_BASE + (os.getpid() % 100_000) * 100 + _uid_counter % 100
            os.chown(workdir / "tmp", uid, uid)
            (workdir / "tmp").chmod(0o700)
        confined = mode in ("namespaces", "userns")
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        config = {
            "requests_fd": requests_r, "replies_fd": replies_w,
            "newroot": str(workdir / "newroot") if confined else None,
            "box": str(box),
            "runtime": "/sandbox/runtime" if confined else str(box / "runtime"),
            "submission": "/sandbox/submission" if confined else str(box / "submission"),
            "tmp": "/tmp" if confined else str(workdir / "tmp"),
            "secrets": [str(p) for p in (KIT, SOLUTIONS, TESTS, FIXTURES, self.root, self.root.parent)],
            "drop": {"namespaces": "uid", "userns": "userns", "uid": "uid"}.get(mode),
            "uid": uid,
            "memory_bytes": self.memory_bytes,
            "tmp_bytes": self.tmp_bytes,
            # RLIMIT_NPROC counts per real uid: only meaningful for a dedicated uid.
            "processes": self.processes if uid is not None else None,
            "threads": _torch_threads(),
        }
        command = [sys.executable, "-I", str(box / "runtime" / "sandbox_child.py"), json.dumps(config)]
        if confined:
            namespaces = ["--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child"]
            if mode == "userns":
                namespaces = ["--user", "--map-root-user", *namespaces]
            command = [shutil.which("unshare"), *namespaces, "--", *command]
        if _setpriv_pdeathsig():
            command = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", *command]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp" if confined else str(workdir / "tmp"),
               "TMPDIR": "/tmp" if confined else str(workdir / "tmp"), "LANG": "C.UTF-8",
               "USER": "learner", "LOGNAME": "learner"}
        try:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(requests_r, replies_w), cwd=workdir, env=env, start_new_session=True,
            )
        except OSError as exc:
            for fd in (requests_r, requests_w, replies_r, replies_w):
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            raise SandboxUnavailable(str(exc)) from None
        os.close(requests_r)
        os.close(replies_w)
        capture = _Capture({"stdout": proc.stdout, "stderr": proc.stderr}, self.output_bytes)
        child = _Child(proc, requests_w, replies_r, capture, workdir, uid, unshared=confined)
        self._child = child
        try:
            header, _ = self._receive(time.monotonic() + self.start_seconds)
        except (_Timeout, _ChildGone, ProtocolError) as exc:
            header = {"kind": "failed", "message": type(exc).__name__.strip("_")}
        finally:
            self._child = None
        if header.get("kind") != "ready":
            child.kill()
            tail = child.capture.last_lines("stderr", 5)
            lines = str(header.get("message")).strip().splitlines() or [""]
            message = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            raise SandboxUnavailable(message + (f" (stderr: {tail})" if tail else ""))
        return child


def _torch_threads():
    """The child computes with as many threads as this process (same float results)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else (os.cpu_count() or 1)


_setpriv_cache = []


def _setpriv_pdeathsig():
    """Whether util-linux's setpriv can set a parent-death signal (2.33 and later)."""
    if not _setpriv_cache:
        path = shutil.which("setpriv")
        ok = False
        if path:
            try:
                ok = "--pdeathsig" in subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                pass
        _setpriv_cache.append(ok)
    return _setpriv_cache[0]
