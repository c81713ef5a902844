"""The template process, and the boxes it forks: one ``Sandbox`` is one template.

    this process ──control socket──> template: confined, torch imported; never runs learner
         │                             code; forks a box when asked, kills it when asked
         └──the box's own 4 pipes──> box: fresh namespaces, /tmp, /dev/shm, keyring and uid;
                                        its pid 1 forks a worker per stage, which runs the
                                        learner's code

A process that grades many submissions keeps one template (torch is then imported once per grading
process) and asks it for a box per submission. Everything a box holds (processes, /tmp and /dev/shm, IPC
objects, sockets, keyring, uid) is its own and dies with it, and its only file descriptors are the four pipes
this process gave it. No message of a box decides anything about a process: the template, which learner code
cannot reach, kills boxes and reports them gone. The template runs ``child.py``, copied with the modules it
imports (``wire``, ``procfs``, the suite's adapter and stage names) into a runtime folder of its own.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
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

from ..kit import FIXTURES, KIT, SOLUTIONS, SUITE
from . import cgroups, lockdown, scratch
from .capture import Capture
from .cgroups import BoxGroup
from .channel import BoxGone, OutOfTime, first_message, receive, send
from .confinement import (
    Confinement,
    SandboxUnavailable,
    SandboxWarning,
    candidate_modes,
    cgroup_support,
    container_holds,
    refusal,
    refuse,
    unshare_command,
)
from .limits import ONE_THREAD, START_SECONDS, Limits
from .procfs import children, learner_cpu, ns_pids, own_cpu, processes_of, run_delays
from .wire import CONTROL_BYTES, ProtocolError, pack

CHILD_SCRIPT = Path(__file__).with_name("child.py")
# What a box imports besides the standard library, NumPy and torch: the confined side's modules, one per process
# role (``child``), and of the suite's runtime package its adapter and the stage names it reads (nothing else of the
# suite: kit_tests/test_kit.py). Found, not imported: the adapter imports torch, which this process need not.
RUNTIME_MODULES = [CHILD_SCRIPT.with_name(f"{name}.py") for name in (
    "syscalls", "seccomp", "box_process", "worker_process", "reference_proxy", "reference_process", "wire", "procfs")]
SUITE_RUNTIME = Path(importlib.util.find_spec("suite_runtime").origin).parent
SUITE_RUNTIME_MODULES = ("__init__.py", "adapters.py", "stage_names.py", "triton_compile.py")
UID_RANGE = (1_500_000_000, 2_100_000_000)  # fresh uids for boxes (no real user lives there)
BOX_SECONDS = 30.0  # a box must be ready, or gone, within this

@dataclass
class Box:
    """This process's side of one box."""

    token: str
    requests: int  # write end of the box's request pipe
    replies: int  # read end of its reply pipe
    capture: Capture  # its stdout and stderr
    incoming: Path  # the folder holding the submission's modules, bound read-only into the box
    tmp: Path | None  # its scratch folder (without a mount namespace only)
    init: int | None = None  # pid of the box's first process (for its CPU time), None if unknown
    group: BoxGroup | None = None  # its cgroup (the CPU time of all its processes), if one could be made
    last_cpu: float = 0.0  # the CPU time last read (what a box that died before its count had used)
    last_stalled: float = 0.0  # the time waiting for a processor last read
    fresh: bool = True  # no learner code has run in it yet
    uid: int | None = None  # its fresh uid, if it has one
    delays: dict = field(default_factory=dict)  # thread -> seconds it waited for a processor (no cgroup)
    role: str = "box"  # "box" (workers run learner code), or "reference" (its first process runs the references)
    received: bytearray = field(default_factory=bytearray)  # replies read ahead of the message being read (channel)

    def stalled(self) -> float:
        """Seconds the box's processes were ready to run but waited for a processor: its cgroup's pressure
        stall count, else the sum of its threads' run-queue delays (/proc/<pid>/task/<tid>/schedstat, kept
        for threads that have ended), 0 where the kernel says neither."""
        seconds = self.group.stalled_seconds() if self.group is not None else None
        if seconds is None and self.init is not None:
            self.delays.update(run_delays(self.init))
            seconds = sum(self.delays.values())
        if seconds is not None:
            self.last_stalled = max(self.last_stalled, seconds)
        return self.last_stalled

    def cpu(self) -> float:
        """CPU seconds the box has used: its cgroup's count, else what /proc shows of its processes (those under
        its first process; a reference process's first process is the one that computes)."""
        counted = own_cpu if self.role == "reference" else learner_cpu
        seconds = self.group.cpu_seconds() if self.group is not None else (
            counted(self.init) if self.init is not None else None)
        if seconds is not None:
            self.last_cpu = max(self.last_cpu, seconds)
        return self.last_cpu


class Sandbox:
    """One template process (see the module docstring): started on first use, kept until close().

    ``confine``: a mode name to insist on (None: the strongest that works here, ``plain`` only if
    ``allow_plain``). ``private``: paths the boxes must not reach besides the kit's own (a course, the
    records): where boxes are only other uids (``container``), they are made private to root before the
    first box starts (``grader.sandbox.lockdown``). Wherever boxes run, a probe box proves they cannot reach them
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
        self.import_path: list[str] = []  # the folders boxes import from (the template's word, once ready)
        self.left_out: list[str] = []  # folders of the grader's sys.path not shown to boxes (they hold secrets)
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
                    refuse(modes[0])
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
                    refuse(mode)
                    if mode == "container" and container_holds():
                        raise SandboxUnavailable(container_holds())
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
                self.confinement = Confinement(mode, *cgroup_support(), why=why, private=private)
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
                   "write": [str(p) for p in private if Path(p).exists()],
                   "need": [*lockdown.python_witnesses(), *self.import_path]}
        if self.confinement.mode == "container":  # (elsewhere these pids are not in the box's world)
            request["pids"] = [pid for pid in (os.getpid(), os.getppid(), self._template) if pid]
        box = self.spawn({}, Limits())
        try:
            deadline = time.monotonic() + BOX_SECONDS
            send(box, pack(request), deadline, lambda: None)
            header, _ = receive(box, deadline, lambda: None, 0)
        except (OutOfTime, BoxGone, ProtocolError) as exc:
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
        shutil.copyfile(CHILD_SCRIPT, root / "runtime" / CHILD_SCRIPT.name)
        for module in RUNTIME_MODULES:
            shutil.copyfile(module, root / "runtime" / module.name)
        (root / "runtime" / SUITE_RUNTIME.name).mkdir()
        for name in SUITE_RUNTIME_MODULES:
            shutil.copyfile(SUITE_RUNTIME / name, root / "runtime" / SUITE_RUNTIME.name / name)
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
            # No folder shown to boxes may hold one of these, nor lie inside the kit's private folders or the
            # course; the grader's import path is theirs (less what would show those: ``child.import_path``).
            "secrets": [str(p) for p in (KIT, SOLUTIONS, SUITE, FIXTURES, *self.private)],
            "hidden": [str(p) for p in (*lockdown.kit_private(), *self.private)],
            "path": lockdown.import_folders(),
            "drop": {"namespaces": "uid", "userns": "userns", "container": "uid"}.get(mode),
        }
        command = [*unshare_command(mode), sys.executable, "-I", str(root / "runtime" / CHILD_SCRIPT.name),
                   json.dumps(config)]
        if setpriv_pdeathsig():
            command = [shutil.which("setpriv"), "--pdeathsig", "KILL", "--", *command]
        home = "/tmp" if namespaced else str(root / "tmp")
        # TRITON_INTERPRET: learner Triton kernels run in Triton's interpreter in a box: compiling one for a GPU runs
        # ptxas and writes a cache, which the learner's filter denies, and a box has no GPU device (see
        # docs/kernels-sandbox.md for how a GPU could be given to one).
        env = {**ONE_THREAD, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "USER": "learner", "LOGNAME": "learner",
               "HOME": home, "TMPDIR": home, "TRITON_INTERPRET": "1"}
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
        self._capture = Capture({"stdout": proc.stdout, "stderr": proc.stderr}, 64 << 10)
        self._finalizer = weakref.finalize(self, kill_template, proc, ours, folder)
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
        self._template = next(iter(children(proc.pid)), None) if namespaced else proc.pid
        self.import_path, self.left_out = list(reply.get("path") or []), list(reply.get("left_out") or [])

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

    def spawn(self, sources: dict[str, bytes], limits: Limits, role: str = "box") -> Box:
        """A new box holding ``sources`` (file name -> module source), ready to serve stages; with ``role``
        "reference", a submission's reference process (``grader.sandbox.reference``)."""
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
                       "uid": uid, "role": role,
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
            box = Box(token, pipes[0][1], pipes[1][0], Capture(streams, limits.output_bytes), incoming, tmp, uid=uid,
                      role=role)
            if reply.get("kind") != "spawned":
                self._discard(box)
                self._stop()
                raise SandboxUnavailable(f"the sandbox could not start a box: {reply.get('message')}")
            self.stats["boxes"] += 1
            init = self._global_pid(reply.get("pid"))
        # The box's first message says it is confined and ready (no learner code has run yet).
        first = first_message(box, time.monotonic() + BOX_SECONDS)
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
        depth = len(ns_pids(self._template)) - 1  # the template's own namespace, among its child's
        for child in children(self._template):
            numbers = ns_pids(child)
            if len(numbers) > depth >= 0 and numbers[depth] == pid:
                return child
        return None

    def kill(self, box: Box):
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
            if not gone and box.uid is not None and not none_left(box.uid):
                raise SandboxUnavailable(f"a box's processes (uid {box.uid}) outlived it: nothing it did is trusted")

    def _discard(self, box: Box):
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


def none_left(uid, seconds=2.0) -> bool:
    """Whether every process of ``uid`` is gone within ``seconds`` (killed with their template: they die with
    their parents)."""
    deadline = time.monotonic() + seconds
    while processes_of(uid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_template(proc, control, folder):
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
    for pid in [*children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    folder.remove()

@cache
def setpriv_pdeathsig() -> bool:
    """Whether util-linux's setpriv can set a parent-death signal (2.33 and later)."""
    path = shutil.which("setpriv")
    if not path:
        return False
    try:
        return "--pdeathsig" in subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
