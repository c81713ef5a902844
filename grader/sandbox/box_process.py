"""A box's first process: it confines the box, then forks a worker for each stage that needs one.

Part of the confined side (``child``): standard library only at the top, copied into the box's runtime folder.

The template forks it (confined: as the first process of a fresh pid namespace) when the grader asks for a box. Still
privileged, it keeps only the box's channel (requests, replies, stdout, stderr), enters fresh mount, network, IPC
and UTS namespaces (confined), mounts a fresh /proc, /tmp and /dev/shm and the submission's modules read-only,
joins a fresh session keyring, sets the box's resource limits and becomes a fresh unprivileged uid. It never runs
learner code: it forks workers (``worker_process``), which load the learner's filter before they import any.
Learner code cannot reach it: the filter lets a worker signal its own process only, it is not dumpable (no
/proc/<pid>/mem, no ptrace), and confined it is the init of its pid namespace, which ignores every signal sent from
inside the namespace that it has no handler for.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

if __package__:  # the trusted side (grader.sandbox.box_process)
    from . import reference_process, worker_process
    from .seccomp import KEYRING_CALLS, confine_learner, deny
    from .syscalls import (
        BOX_NAMESPACES,
        CLONE_NEWUSER,
        KEYCTL_JOIN_SESSION_KEYRING,
        MNT_DETACH,
        MS_NODEV,
        MS_NOEXEC,
        MS_NOSUID,
        MS_PRIVATE,
        MS_REC,
        PR_SET_DUMPABLE,
        PR_SET_NO_NEW_PRIVS,
        PR_SET_PDEATHSIG,
        bind,
        check,
        libc,
        mount,
        syscall,
        tmpfs,
        warn,
    )
    from .wire import read_message, write_message
else:  # the box's runtime folder, which child.py puts on the path while it imports its siblings
    import reference_process
    import worker_process
    from seccomp import KEYRING_CALLS, confine_learner, deny
    from syscalls import (
        BOX_NAMESPACES,
        CLONE_NEWUSER,
        KEYCTL_JOIN_SESSION_KEYRING,
        MNT_DETACH,
        MS_NODEV,
        MS_NOEXEC,
        MS_NOSUID,
        MS_PRIVATE,
        MS_REC,
        PR_SET_DUMPABLE,
        PR_SET_NO_NEW_PRIVS,
        PR_SET_PDEATHSIG,
        bind,
        check,
        libc,
        mount,
        syscall,
        tmpfs,
        warn,
    )
    from wire import read_message, write_message

REQUESTS, REPLIES = 3, 4  # the box's channel, as file descriptors of every process of the box
Box = dict  # what a box's processes know of it: {"submission": folder, "tmp": folder, "confined": bool}


def keep_only(fds: list[int]) -> None:
    """Make the box's channel file descriptors 0-4 (stdin from /dev/null, stdout, stderr, requests,
    replies) and close every other one: the control socket, and whatever else the template holds."""
    import fcntl

    requests, replies, out, err = fds
    null = os.open(os.devnull, os.O_RDONLY)
    # Copies above the targets first, so that placing one never overwrites another.
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in (null, out, err, requests, replies)]
    for target, fd in enumerate(moved):
        os.dup2(fd, target)
    os.closerange(5, max(os.sysconf("SC_OPEN_MAX"), 1 << 16))


def box_main(lib: ctypes.CDLL, config: dict, request: dict, fds: list[int], under_tmp: list[str]) -> None:
    """The box's first process (pid 1 of its namespace): take the box's channel and leave everything
    else of the template's behind, confine, then fork a worker per stage. Never returns."""
    code = 70
    try:
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        keep_only(fds)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a pid-1 process gets no signal it does not handle
        limits = request["limits"]
        if config["newroot"]:
            check(lib.unshare(BOX_NAMESPACES), "unshare")
            fresh_world(lib, request["token"], limits["tmp_bytes"], under_tmp)
            box = {"submission": "/sandbox/submission", "tmp": "/tmp", "confined": True}
        else:
            # (container, plain) the machine's /proc: a worker cannot tell its stage's processes from others'
            box = {"submission": request["submission"], "tmp": request["tmp"], "confined": False}
        set_limits(limits)
        drop_privileges(lib, config["drop"], request.get("uid"))
        join_fresh_session_keyring(lib)
        deny(lib, KEYRING_CALLS)  # keys outlive processes, and any uid may read one made readable
        # torch's compiler (which flex_attention runs even eagerly) makes its cache folder on import: made here,
        # in the box's own folder, since the learner's filter lets no code make one.
        compiler_cache = os.path.join(box["tmp"], "torchinductor")
        os.makedirs(compiler_cache, exist_ok=True)
        os.environ.update(HOME=box["tmp"], TMPDIR=box["tmp"], TORCHINDUCTOR_CACHE_DIR=compiler_cache)
        os.chdir(box["tmp"])
        sys.dont_write_bytecode = True  # (learner code may not write files: no __pycache__ either)
        from suite_runtime import adapters

        write_message(REPLIES, {"kind": "ready"})
        code = reference_process.serve(lib) if request.get("role") == "reference" else serve_box(adapters, box)
    except BaseException as exc:
        try:
            write_message(REPLIES, {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
    finally:
        os._exit(code)


def fresh_world(lib: ctypes.CDLL, token: str, tmp_bytes: int, under_tmp: list[str]) -> None:
    """The box's own /proc, /tmp, /dev/shm and submission folder, in its new mount namespace."""
    mount(lib, None, "/", None, MS_REC | MS_PRIVATE)
    # What the template placed under /tmp (a Python installation) must stay visible on the
    # box's fresh /tmp: hold on to it before the new tmpfs hides it.
    held = [(path, os.readlink(path) if os.path.islink(path) else os.open(path, os.O_PATH | os.O_DIRECTORY))
            for path in under_tmp]
    tmpfs(lib, "/tmp", tmp_bytes)
    tmpfs(lib, "/dev/shm", tmp_bytes)
    for path, kept in held:
        if isinstance(kept, str):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.symlink(kept, path)
        else:
            bind(lib, f"/proc/self/fd/{kept}", path)
            os.close(kept)
    try:
        mount(lib, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:  # then at least hide the template's (Python runs without a /proc)
        warn(f"no /proc of the box's own ({exc})")
        tmpfs(lib, "/proc", 4096, mode="555")
    # SysV shared memory counts against no process's address space: bound it by the tmpfs size.
    for name, value in (("shmmax", tmp_bytes), ("shmall", tmp_bytes // os.sysconf("SC_PAGE_SIZE"))):
        try:
            with open(f"/proc/sys/kernel/{name}", "w") as handle:
                handle.write(str(value))
        except OSError as exc:
            warn(f"no limit on SysV shared memory ({exc})")
    bind(lib, f"/sandbox/incoming/{token}", "/sandbox/submission")
    check(lib.umount2(b"/sandbox/incoming", MNT_DETACH), "hide the other submissions")


def set_limits(limits: dict) -> None:
    """The box's resource limits (``Limits.for_box``), soft and hard: no process of the box may raise them."""
    import resource

    values = {
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_FSIZE: limits["tmp_bytes"],
        resource.RLIMIT_NPROC: limits.get("processes"),
        # Open files bound what a box can hold outside its address space: pipe and socket buffers.
        resource.RLIMIT_NOFILE: limits.get("files"),
        # A backstop the kernel holds whatever happens to the grader: the box's own limits are checked from
        # outside, on the CPU time of all its processes (SIGXCPU at the soft limit, SIGKILL at the hard one).
        resource.RLIMIT_CPU: limits.get("cpu_seconds"),
    }
    for which, value in values.items():
        if value is not None:
            soft = int(value)
            resource.setrlimit(which, (soft, soft + 5 if which == resource.RLIMIT_CPU else soft))


def drop_privileges(lib: ctypes.CDLL, how: str | None, uid: int | None) -> None:
    """Give up every privilege for good: a fresh uid, or a nested user namespace that owns nothing."""
    if how == "uid":
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root to non-zero: every capability is gone
    elif how == "userns":
        # We are "root" of a user namespace that owns our mounts. A nested user
        # namespace owns none of them, so the mounts can no longer be undone.
        check(lib.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # Changing credentials cleared the parent-death signal; ask for it again. Not dumpable:
    # no other process of the box may ptrace this one or open its /proc files.
    check(lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    check(lib.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")


def join_fresh_session_keyring(lib: ctypes.CDLL) -> None:
    """A new, empty session keyring: the one inherited from the template is shared by every box."""
    if syscall(lib, "keyctl", KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != errno.ENOSYS:
        check(-1, "keyctl(JOIN_SESSION_KEYRING)")


def serve_box(adapters, box: Box) -> int:
    """Fork a worker for each stage that needs one (or the probe, see ``probe``); report its end. Returns when the
    grader closes the channel."""
    while True:
        message = read_message(REQUESTS)
        if message is None:
            return 0  # the grader closed the channel
        header, _ = message
        if header.get("cmd") not in ("open", "probe"):
            continue  # a stray request for a worker that has gone: ignore
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if header["cmd"] == "probe":
                    write_message(REPLIES, {"kind": "probe", "token": header.get("token"),
                                            "reached": probe(libc(), box, header)})
                else:
                    worker_process.serve(adapters, box, header)
            except SystemExit as exc:  # sys.exit() in learner code: report its exit code
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        status = wait_for(pid)
        write_message(REPLIES, {"kind": "ended", "token": header.get("token"), "status": status})


def probe(lib: ctypes.CDLL, box: Box, request: dict) -> list[str]:
    """Try, in a fresh box before any learner code has run, what learner code must not be able to do; returns
    what succeeded (nothing, where the confinement holds). With the box's own permissions: read the
    ``read`` paths (files, or folders to list) and write the ``write`` ones, and fail to read none of the
    ``need`` ones (the Python installation: a module not imported yet must still import); then under the
    learner's filter: run a program, start a process, create a file, open a socket, make an anonymous file,
    signal its parent (the box's first process), and reach the processes ``pids`` (their open files, memory,
    signals). The grader refuses to grade where anything was reached."""
    import socket

    reached = []

    def attempt(what, action, *args):
        try:
            action(*args)
        except OSError:
            return
        reached.append(what)

    def read(path):
        return os.listdir(path) if os.path.isdir(path) else os.close(os.open(path, os.O_RDONLY))

    for path in request.get("read", []):
        attempt(f"read {path}", read, path)
    for path in request.get("need", []):  # what learner code must be able to read: the Python installation
        try:
            read(path)
        except OSError as exc:
            reached.append(f"not read {path}, which it needs ({exc.strerror})")
    reached += [f"write {path}" for path in request.get("write", []) if os.access(path, os.W_OK)]
    confine_learner(lib)
    try:  # first: if it works, this process is gone and the grader sees it end without an answer
        os.execv(sys.executable, [sys.executable, "-c", "pass"])
    except OSError:
        pass
    try:
        child = os.fork()
    except OSError:
        pass
    else:
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        reached.append("start a process")
    attempt("create a file", lambda: os.close(os.open(os.path.join(box["tmp"], "probe"), os.O_WRONLY | os.O_CREAT)))
    attempt("open a socket", lambda: socket.socket().close())
    attempt("make an anonymous file", lambda: os.close(os.memfd_create("probe")))
    attempt("signal the box's first process", os.kill, os.getppid(), 0)
    for pid in request.get("pids", []):
        attempt(f"list the open files of process {pid}", os.listdir, f"/proc/{pid}/fd")
        attempt(f"open the memory of process {pid}", lambda path: os.close(os.open(path, os.O_RDONLY)),
                f"/proc/{pid}/mem")
        attempt(f"signal process {pid}", os.kill, pid, 0)
    return reached


def wait_for(pid: int) -> int:
    """Wait for the worker; then kill whatever it left behind. Returns its wait status."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0
        if done == pid:
            break
    if os.getpid() == 1:
        # We are init of the box's pid namespace: kill(-1) reaches every other process in
        # it (and nothing outside), e.g. the rest of a fork loop.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return status
