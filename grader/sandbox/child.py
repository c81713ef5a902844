"""The confined side of the sandbox (``grader.sandbox.template``).

The grader copies this file, ``wire.py``, ``procfs.py`` and the suite's ``adapters.py`` and
``stage_names.py`` into a private folder and runs ``python -I child.py CONFIG`` there. Three
kinds of process come out of it:

template  One per grading process; it never runs learner code. It confines
          itself: in a fresh mount namespace it builds a root file system that
          holds only the operating system, the Python installation and the
          kit's runtime (these files), and pivots into it. Then
          it imports NumPy, torch and the adapter once and waits on its control
          socket, which only the grader holds, for two requests: "spawn" a box
          for a submission, "kill" a box.
box       One per submission (a fresh one after a crash or a time-out), forked
          from the template as the first process of a fresh pid namespace. Still
          privileged, it closes every file descriptor but the box's own channel,
          which the grader passed in with the request (requests, replies, stdout,
          stderr), enters fresh mount, network, IPC and UTS namespaces, mounts
          a fresh /proc, a fresh tmpfs at
          /tmp and /dev/shm, the submission's own modules read-only at
          /sandbox/submission, joins a fresh session keyring and becomes a fresh
          unprivileged uid. It never runs learner code either: it forks workers.
worker    Imports the learner's module of a stage (beside the reference versions
          of the stages it builds on, when the grader's request brings them) and
          answers the operations on it. It serves the next stage of the same
          submission only if the last left the process as it found it (see
          ``serve``); else the box forks a fresh one.

When a submission is done, or its box misbehaves, the grader asks the template
to kill the box: killing the pid namespace's first process makes the kernel kill
every process of the box, and its mounts, IPC objects, sockets and keyring go
with the namespaces. No process that ran learner code ever serves another
submission, and whatever a box says is data about its own submission only
(the wire format: ``wire``).

This module imports nothing but the standard library and its two siblings at the top so
that the bootstrap can run before the sandbox exists; NumPy is imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time

if __package__:  # the trusted side reads this module as grader.sandbox.child (its system call tables)
    from .procfs import children, processes_of
    from .wire import CONTROL_BYTES, clip, decode, encode, read_message, write_message
else:  # run from the box's runtime folder (python -I: no folder of its own on the path), beside its siblings
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from procfs import children, processes_of
    from wire import CONTROL_BYTES, clip, decode, encode, read_message, write_message

    del sys.path[0]

REQUESTS, REPLIES = 3, 4  # the box's channel, as file descriptors of every process of the box

# ---------------------------------------------------------------- Linux system calls

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
BOX_NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS  # (and a pid namespace: see spawn)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
# System call numbers (glibc wraps few of these, and a seccomp filter names calls by number), per machine.
SYSCALLS = {
    "x86_64": {
        "open": 2, "ioctl": 16, "shmget": 29, "shmat": 30, "shmctl": 31, "socket": 41, "socketpair": 53,
        "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "semget": 64, "semop": 65, "semctl": 66, "shmdt": 67,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "truncate": 76, "rename": 82, "mkdir": 83,
        "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "chmod": 90, "fchmod": 91, "chown": 92,
        "fchown": 93, "lchown": 94, "ptrace": 101, "utime": 132, "mknod": 133, "pivot_root": 155, "chroot": 161,
        "acct": 163, "mount": 165, "umount2": 166, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
        "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "semtimedop": 220, "utimes": 235,
        "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
        "ioprio_set": 251, "prlimit64": 302, "sched_setattr": 314,
        "mq_open": 240, "mq_unlink": 241, "add_key": 248, "request_key": 249, "keyctl": 250, "inotify_init": 253,
        "inotify_add_watch": 254, "openat": 257, "mkdirat": 258, "mknodat": 259, "fchownat": 260,
        "futimesat": 261, "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266, "fchmodat": 268,
        "unshare": 272, "utimensat": 280, "inotify_init1": 294, "perf_event_open": 298, "fanotify_init": 300,
        "fanotify_mark": 301, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "renameat2": 316, "bpf": 321,
        "execveat": 322, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435, "openat2": 437, "pidfd_getfd": 438,
        "process_madvise": 440, "mount_setattr": 442, "fchmodat2": 452, "setxattrat": 463, "removexattrat": 466,
        "open_tree_attr": 467,
    },
    "aarch64": {  # the generic table (no open, creat, fork, mkdir ...: only their *at forms)
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
        "inotify_init1": 26, "inotify_add_watch": 27, "ioctl": 29, "ioprio_set": 30, "mknodat": 33, "mkdirat": 34,
        "unlinkat": 35, "sched_setparam": 118, "sched_setscheduler": 119, "sched_setaffinity": 122, "setpriority": 140,
        "prlimit64": 261, "sched_setattr": 274,
        "symlinkat": 36, "linkat": 37, "renameat": 38, "umount2": 39, "mount": 40, "pivot_root": 41,
        "truncate": 45, "chroot": 51, "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "openat": 56,
        "utimensat": 88, "acct": 89, "unshare": 97, "ptrace": 117, "mq_open": 180, "mq_unlink": 181,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191,
        "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197, "socket": 198,
        "socketpair": 199, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "execve": 221,
        "perf_event_open": 241, "fanotify_init": 262, "fanotify_mark": 263, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "renameat2": 276, "bpf": 280, "execveat": 281, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435, "openat2": 437,
        "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "fchmodat2": 452, "setxattrat": 463,
        "removexattrat": 466, "open_tree_attr": 467,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # the system call ABI a seccomp filter allows
KEYRING_CALLS = ("add_key", "request_key", "keyctl")
# What learner code may not do when graded, whatever the confinement (the learner's filter, ``confine_learner``):
# no attention stage needs any of it, and each is a way out of a box or into another. Calls a machine lacks
# (x86_64's open, fork ... on aarch64) are skipped.
LEARNER_DENIED = (
    # run programs or start processes: a fresh process would escape the stage's memory ceiling (RLIMIT_AS is a
    # number of bytes, checked against each process's own address space), and the box is held to one process
    "execve", "execveat", "fork", "vfork",
    # reach other processes: memory, file descriptors, handles on them
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp", "pidfd_open", "pidfd_getfd",
    # the network and sockets other than the socketpairs below; watching files for the grader's writes
    "socket", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
    # kernel keyrings, namespaces and mounts, kernel programs and counters, io_uring (its requests bypass seccomp)
    *KEYRING_CALLS, "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "open_tree",
    "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "acct", "bpf", "perf_event_open",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "name_to_handle_at", "open_by_handle_at",
    # leave anything in the file system for a later box (opening for writing is checked below)
    "creat", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "symlink", "symlinkat", "mknod", "mknodat", "truncate", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown",
    "fchown", "lchown", "fchownat", "setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr",
    "lremovexattr", "fremovexattr", "removexattrat", "utime", "utimes", "futimesat", "utimensat",
    # System V and POSIX IPC objects, which outlive their makers and any uid may be given access to
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl",
    "semtimedop", "mq_open", "mq_unlink",
)
# Calls whose arguments a filter cannot read (they point to memory): "not implemented", so that the C library
# falls back to the older call, whose arguments are checked (clone3 -> clone, openat2 -> openat).
LEARNER_UNIMPLEMENTED = ("clone3", "openat2")
CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME is clone3's and unshare's only)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
OPEN_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC  # (O_TMPFILE and O_APPEND need a write mode)
AF_UNIX = 1
TERMINAL_INJECTION = (0x5412, 0x541C)  # ioctl TIOCSTI, TIOCLINUX: type into a terminal
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
DEVICES = ["null", "zero", "full", "random", "urandom"]


def libc():
    import ctypes

    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def check(result, what):
    if result != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def syscall(lib, name, *args):
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise RuntimeError(f"{name}: unknown system call number on {os.uname().machine}")
    return lib.syscall(numbers[name], *args)


def mount(lib, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    check(lib.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def bind(lib, source, target, readonly=True):
    """Bind ``source`` (a directory or a device file) at ``target``, with what is mounted below it;
    read-only by default, the mounts below it too."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(lib, source, target, None, MS_BIND | MS_REC)
    if readonly:
        import ctypes

        attr = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0))
        if syscall(lib, "mount_setattr", AT_FDCWD, str(target).encode(), AT_RECURSIVE, attr, len(attr.raw)) == 0:
            return
        # A kernel before 5.12: only the top mount can be made read-only. The remount must keep
        # the flags the source mount already has (the kernel refuses to clear them in a user namespace).
        st = os.statvfs(source)
        keep = (st.f_flag & os.ST_NOSUID and MS_NOSUID) | (st.f_flag & os.ST_NODEV and MS_NODEV) | (
            st.f_flag & os.ST_NOEXEC and MS_NOEXEC)
        mount(lib, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def tmpfs(lib, target, size_bytes, mode="1777", flags=MS_NOSUID | MS_NODEV):
    os.makedirs(target, exist_ok=True)
    mount(lib, "tmpfs", target, "tmpfs", flags, f"size={size_bytes},mode={mode}")


def inside(path, parent):
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")

def warn(text):
    sys.stderr.write(f"[sandbox] {text}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------- the template

def build_root(lib, config):
    """Make ``config['newroot']`` a root file system with only what Python needs, and enter it.

    Runs as root of the new mount namespace that ``unshare`` created (its mounts are
    private: nothing done here is visible outside). Returns the paths placed under /tmp
    (a Python installation that lives there): each box puts them back on its own /tmp.
    """
    new = config["newroot"]

    def expose(path, readonly=True):
        for secret in config["secrets"]:
            if inside(secret, path):
                raise RuntimeError(f"{path} contains {secret}: the sandbox cannot hide it")
        bind(lib, path, new + path, readonly)

    tmpfs(lib, new, 1 << 20, mode="755")
    # /tmp comes first: a Python installation under /tmp (a venv in a clone under /tmp) is
    # then bound inside it instead of being hidden by it.
    tmpfs(lib, new + "/tmp", 1 << 20)
    exposed = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), new + path)
        elif os.path.isdir(path):
            expose(path)
            exposed.append(path)
    # The Python installation, at the same absolute paths (the venv's interpreter is a
    # symlink into the base installation, which may sit under /root's 0700 home).
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    for prefix in sorted({os.path.realpath(p) for p in prefixes}):
        if not any(inside(prefix, done) for done in exposed):
            expose(prefix)
            exposed.append(prefix)
    for prefix in prefixes:  # a prefix reached through a symlink keeps working
        if os.path.normpath(prefix) != os.path.realpath(prefix) and not os.path.lexists(new + prefix):
            os.makedirs(os.path.dirname(new + prefix), exist_ok=True)
            os.symlink(os.path.realpath(prefix), new + prefix)
            exposed.append(os.path.normpath(prefix))
    # The kit's runtime and the folder the grader fills with each box's submission.
    bind(lib, config["runtime_host"], new + "/sandbox/runtime")
    bind(lib, config["incoming_host"], new + "/sandbox/incoming")
    os.makedirs(new + "/sandbox/submission")  # each box binds its own submission here
    # /dev: a few harmless devices (each box gets its own /dev/shm).
    os.makedirs(new + "/dev")
    tmpfs(lib, new + "/dev", 64 << 10, mode="755", flags=MS_NOSUID | MS_NOEXEC)
    for name in DEVICES:
        bind(lib, "/dev/" + name, f"{new}/dev/{name}", readonly=False)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    mount(lib, None, new + "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    # The template's /proc (each box mounts its own over it; inside a user namespace the kernel
    # allows that only where a proc is mounted already). A convenience: a container may refuse.
    os.makedirs(new + "/proc")
    try:
        mount(lib, "proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        warn(f"no /proc in the sandbox ({exc})")
    try:
        bind(lib, "/sys", new + "/sys")  # read-only; torch reads the CPU layout there
    except OSError as exc:
        warn(f"no /sys in the sandbox ({exc})")
    # Enter the new root; the old one is detached, so nothing outside stays reachable.
    os.chdir(new)
    check(syscall(lib, "pivot_root", b".", b"."), "pivot_root")
    check(lib.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(lib, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return [p for p in exposed if inside(p, "/tmp")]


def writable_shared_memory():
    """Writable shared mappings of this process: a box forked from it would share them."""
    try:
        with open("/proc/self/maps") as maps:
            return [line.split(None, 5)[-1].strip() for line in maps if line.split()[1][1:4:2] == "ws"]
    except OSError:
        return []


def main():
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=config["control_fd"])
    confined = bool(config["newroot"])
    try:
        lib = libc()
        under_tmp = build_root(lib, config) if confined else []
        if not confined:
            # What a box leaves behind (a daemon whose parent died) becomes ours to kill.
            lib.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        lib.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.chdir("/")
        import numpy.random
        import torch

        torch.set_num_threads(1)  # (the environment says so too: see ONE_THREAD in grader/sandbox/limits.py)
        sys.path.insert(0, config["runtime"])
        from suite_runtime import adapters  # noqa: F401

        warm_up(torch, numpy)
        shared = writable_shared_memory()
        if shared:
            raise RuntimeError(f"the template holds writable shared memory ({shared[0]}), which boxes would share")
    except BaseException as exc:
        send(control, {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"})
        return 1
    own_pids = os.open("/proc/self/ns/pid", os.O_RDONLY) if confined else None  # see spawn()
    send(control, {"kind": "ready", "pid": os.getpid()})
    boxes = {}  # token -> (pid of the box's first process, its uid)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, CONTROL_BYTES, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            break  # the grader closed the socket (or died)
        try:
            request = json.loads(data)
        except ValueError:
            request = {}
        token = str(request.get("token", ""))
        if request.get("cmd") == "spawn" and len(fds) == 4 and token not in boxes:
            pid = spawn(lib, config, request, fds, under_tmp, own_pids)
            boxes[token] = (pid, request.get("uid"))
            reply = {"kind": "spawned", "token": token, "pid": pid}
        elif request.get("cmd") == "kill":
            gone = kill_box(*boxes.pop(token), config) if token in boxes else True
            reply = {"kind": "gone" if gone else "failed", "token": token,
                     "message": "" if gone else "processes of the box's uid outlived it"}
        else:
            reply = {"kind": "error", "message": f"bad request {request.get('cmd')!r}"}
        for fd in fds:
            os.close(fd)
        reap_strays(boxes)
        send(control, reply)
    for pid, uid in boxes.values():
        kill_box(pid, uid, config)
    os._exit(0)  # (no interpreter teardown: torch's takes most of a second)


def send(control, message):
    control.send(json.dumps(message).encode())


def kill_box(init, uid, config) -> bool:
    """Kill one box and wait until it is gone; False if a process of its uid could not be killed.

    Confined, the box's first process is the init of its pid namespace: killing it makes the
    kernel kill every other process of the box, and it can be reaped once the namespace is
    empty. In a container (no pid namespace), every process of the box's uid is killed by a process
    of that uid (``kill_uid``): the box's world is its uid. Otherwise (plain) every process of the
    box's tree is killed (what escaped it, an orphan reparented to this template, by ``reap_strays``).
    """
    if config["mode"] == "container":
        return kill_uid(uid, init)
    confined = bool(config["newroot"])
    doomed, pending = [init], [] if confined else [init]
    while pending:
        more = children(pending.pop())
        doomed += more
        pending += more
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(init, 0)
    except ChildProcessError:
        pass
    return True


KILL_SECONDS = 5.0  # a box's uid must have no process left within this


def kill_uid(uid, init) -> bool:
    """Kill every process of ``uid`` (and reap those that were ours), then check with /proc that none is
    left. The kernel lets a process of the uid signal all the others (kill(-1)), and with the learner's
    filter they cannot start new ones, so the killing is not a race."""
    deadline = time.monotonic() + KILL_SECONDS
    while True:
        killer = os.fork()
        if killer == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                for _ in range(3):
                    os.kill(-1, signal.SIGKILL)  # every process this uid may signal, but itself
            except ProcessLookupError:
                pass
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(init, 0)
        reap_strays({})
        if not processes_of(uid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)

def reap_strays(boxes):
    """Kill and reap children of the template that are no box's first process: what a box left
    behind without namespaces (reparented here, the subreaper)."""
    inits = {pid for pid, _ in boxes.values()}
    for pid in children(os.getpid()):
        if pid not in inits:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def warm_up(torch, np):
    """Run torch's usual module paths once here, so that every forked worker finds them initialised
    (lazy set-up done once per template, not once per stage). Leaves torch's random state as it
    was: a worker starts from the state of a freshly imported torch, as in a fresh process."""
    state = torch.get_rng_state()
    try:
        for bias in (False, True):
            linear = torch.nn.Linear(4, 4, bias=bias)
            model = torch.nn.Sequential(linear, torch.nn.Dropout(0.5), torch.nn.ModuleList([torch.nn.Linear(4, 2)])[0])
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, strict=False)
            model.register_buffer("mask", torch.triu(torch.ones(3, 3), diagonal=1))
            x = torch.from_numpy(np.array(np.ones((2, 3, 4), np.float32)))
            for train in (True, False):
                model.train(train)
                with torch.no_grad():
                    q = linear(x)
                    s = (q @ q.transpose(1, 2) / q.shape[-1] ** 0.5).masked_fill(model.mask.bool()[:3, :3], -torch.inf)
                    out = (torch.softmax(s, dim=-1) @ q).view(2, 3, 2, 2).transpose(1, 2).contiguous().reshape(2, 3, 4)
                    torch.cat([out, out], dim=-1)
                    model(x).detach().cpu().float().numpy()
            model.to(device="cpu", dtype=torch.bfloat16)(x.to(torch.bfloat16)).detach().float().numpy()
            list(model.named_parameters(remove_duplicate=False))
            list(model.named_buffers())
            list(model.named_modules())
    except Exception:
        pass  # only a head start: the workers do the same work anyway
    finally:
        torch.set_rng_state(state)


# ---------------------------------------------------------------- a box

def spawn(lib, config, request, fds, under_tmp, own_pids):
    """Fork the first process of a new box (confined: the init of a new pid namespace); returns its
    pid. Its other namespaces it makes itself (see box_main)."""
    if own_pids is not None:
        check(lib.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # for the next child only
    try:
        pid = os.fork()
        if pid == 0:
            box_main(lib, config, request, fds, under_tmp)  # never returns
    finally:
        if own_pids is not None:  # the template's later children are its own pid namespace's again
            check(lib.setns(own_pids, CLONE_NEWPID), "setns(CLONE_NEWPID)")
    return pid


def keep_only(fds):
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


def box_main(lib, config, request, fds, under_tmp):
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
        code = serve_box(adapters, box)
    except BaseException as exc:
        try:
            write_message(REPLIES, {"kind": "failed", "message": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
    finally:
        os._exit(code)


def fresh_world(lib, token, tmp_bytes, under_tmp):
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


def set_limits(limits):
    import resource

    values = {
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_FSIZE: limits["tmp_bytes"],
        resource.RLIMIT_NPROC: limits.get("processes"),
        # A backstop the kernel holds whatever happens to the grader: the box's own limits are checked from
        # outside, on the CPU time of all its processes (SIGXCPU at the soft limit, SIGKILL at the hard one).
        resource.RLIMIT_CPU: limits.get("cpu_seconds"),
    }
    for which, value in values.items():
        if value is not None:
            soft = int(value)
            resource.setrlimit(which, (soft, soft + 5 if which == resource.RLIMIT_CPU else soft))


def hold_address_space(headroom):
    """Lower this process's RLIMIT_AS to its address space now plus ``headroom`` bytes (never above the
    limit it has). Hard as well as soft: a process without privileges cannot raise it again, so
    whatever the learner's code does, an allocation beyond it fails."""
    import resource

    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + headroom if hard == resource.RLIM_INFINITY else min(hard, size + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def drop_privileges(lib, how, uid):
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


def join_fresh_session_keyring(lib):
    """A new, empty session keyring: the one inherited from the template is shared by every box."""
    import ctypes
    import errno

    if syscall(lib, "keyctl", KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != errno.ENOSYS:
        check(-1, "keyctl(JOIN_SESSION_KEYRING)")


# Classic BPF for seccomp: instructions (code, jump if true, jump if false, k) over struct seccomp_data,
# whose fields are the call's number (offset 0), its ABI (4) and six 64-bit arguments (16 + 8 i; the low
# 32 bits first on these little-endian machines). Jumps count the instructions they skip.
BPF_LOAD, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_ALLOW, SECCOMP_ERRNO = 0x7FFF0000, 0x00050000


def _argument(i):
    return 16 + 8 * i


def seccomp_program(machine, denied=(), unimplemented=(), checks=()):
    """A seccomp filter (a list of BPF instructions) that makes the calls ``denied`` fail with EPERM and
    ``unimplemented`` with ENOSYS, and runs ``checks``: (call, instructions that end in a return, run with the
    call's number loaded). Every call through another ABI (i386's int 0x80, x32) fails: it could reach the
    same calls by other numbers. Calls this machine does not have are left out."""
    import errno

    numbers = SYSCALLS[machine]
    fail = lambda code: (BPF_RET, 0, 0, SECCOMP_ERRNO | code)  # noqa: E731
    program = [(BPF_LOAD, 0, 0, 4), (BPF_JEQ, 1, 0, AUDIT_ARCH[machine]), fail(errno.EPERM), (BPF_LOAD, 0, 0, 0)]
    if machine == "x86_64":
        program += [(BPF_JGE, 0, 1, 0x40000000), fail(errno.EPERM)]  # x32 system calls
    for names, code in ((denied, errno.EPERM), (unimplemented, errno.ENOSYS)):
        for name in names:
            if name in numbers:
                program += [(BPF_JEQ, 0, 1, numbers[name]), fail(code)]
    for name, body in checks:
        if name in numbers:
            program += [(BPF_JEQ, 0, len(body), numbers[name]), *body]
    return program + [(BPF_RET, 0, 0, SECCOMP_ALLOW)]


def learner_checks():
    """The calls the learner's filter allows only with some arguments (see ``seccomp_program``)."""
    import errno

    allow, deny = (BPF_RET, 0, 0, SECCOMP_ALLOW), (BPF_RET, 0, 0, SECCOMP_ERRNO | errno.EPERM)

    def flags_clear(argument, mask):  # allowed when none of ``mask``'s bits is set in the argument
        return [(BPF_LOAD, 0, 0, _argument(argument)), (BPF_JSET, 0, 1, mask), deny, allow]

    return [
        # threads, never processes (nor new namespaces)
        ("clone", [(BPF_LOAD, 0, 0, _argument(0)), (BPF_JSET, 2, 0, CLONE_NEW), (BPF_JSET, 0, 1, CLONE_THREAD),
                   allow, deny]),
        # files are opened to be read, never written or created
        ("open", flags_clear(1, OPEN_WRITES)),
        ("openat", flags_clear(2, OPEN_WRITES)),
        # a pair of connected Unix sockets (Python's multiprocessing helpers), nothing that reaches out
        ("socketpair", [(BPF_LOAD, 0, 0, _argument(0)), (BPF_JEQ, 0, 1, AF_UNIX), allow, deny]),
        # limits, priorities and CPUs of this process only: not the box's first process, whose next workers would
        # inherit them (the pid or "who" argument 0 means the caller)
        *[(name, [(BPF_LOAD, 0, 0, _argument(index)), (BPF_JEQ, 0, 1, 0), allow, deny]) for name, index in (
            ("prlimit64", 0), ("sched_setparam", 0), ("sched_setscheduler", 0), ("sched_setaffinity", 0),
            ("sched_setattr", 0), ("setpriority", 1), ("ioprio_set", 1))],
        # no typing into a terminal the grader's processes read
        ("ioctl", [(BPF_LOAD, 0, 0, _argument(1)), *[(BPF_JEQ, 2 - i, 0, request)
                                                     for i, request in enumerate(TERMINAL_INJECTION)], allow, deny]),
    ]


def install_seccomp(lib, program):
    """Load ``program`` for this thread and everything it starts (needs no_new_privs)."""
    import ctypes

    code = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    filters = ctypes.create_string_buffer(code)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    compiled = Program(len(program), ctypes.cast(filters, ctypes.c_void_p))
    check(lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(compiled), 0, 0), "seccomp")


def deny(lib, names):
    """A seccomp filter for this process and all it starts: the system calls ``names`` fail with EPERM."""
    install_seccomp(lib, seccomp_program(os.uname().machine, denied=names))


def confine_learner(lib):
    """The learner's filter, loaded by a worker before it imports learner code: see LEARNER_DENIED."""
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    install_seccomp(lib, seccomp_program(os.uname().machine, LEARNER_DENIED, LEARNER_UNIMPLEMENTED,
                                         learner_checks()))


def serve_box(adapters, box):
    """The box's first process: fork a worker for each stage that needs one (or the probe, see ``probe``);
    report its end."""
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
                    serve(adapters, box, header)
            except SystemExit as exc:  # sys.exit() in learner code: report its exit code
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        status = wait_for(pid)
        write_message(REPLIES, {"kind": "ended", "token": header.get("token"), "status": status})


def probe(lib, box, request) -> list[str]:
    """Try, in a fresh box before any learner code has run, what learner code must not be able to do; returns
    what succeeded (nothing, where the confinement holds). With the box's own permissions: read the
    ``read`` paths (files, or folders to list) and write the ``write`` ones, and fail to read none of the
    ``need`` ones (the Python installation: a module not imported yet must still import); then under the
    learner's filter:
    run a program, start a process, create a file, open a socket, and reach the processes ``pids`` (their
    open files, memory, signals). The grader refuses to grade where anything was reached."""
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
    for pid in request.get("pids", []):
        attempt(f"list the open files of process {pid}", os.listdir, f"/proc/{pid}/fd")
        attempt(f"open the memory of process {pid}", lambda path: os.close(os.open(path, os.O_RDONLY)),
                f"/proc/{pid}/mem")
        attempt(f"signal process {pid}", os.kill, pid, 0)
    return reached


def wait_for(pid):
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


# ---------------------------------------------------------------- a worker

def serve(adapters, box, opened):
    """A worker: serve stage after stage, for as long as each leaves the process as it found it.

    ``opened`` is the "open" request the worker was forked for. Each stage imports its module
    afresh and answers operations until "close". Then the worker compares the process with the
    one it was forked from (``process_state``): unchanged, it says "parked" and serves the next
    "open" itself (a fork and torch's first-touch costs saved per stage); changed (torch
    patched, threads or processes started, the default dtype set, memory held...), it says
    "leaving" and exits, and the box forks a clean worker for the next stage, as after a crash.
    This only decides how fairly one submission's stages are kept apart: the worker's answer
    is the learner's to forge, and the grader never acts on it beyond this submission. Without
    a private /proc the check cannot see processes, so a worker serves one stage only.
    """
    import faulthandler

    os.setpgid(0, 0)
    libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (without a pid namespace: die with the box)
    faulthandler.enable()  # a segfault prints the Python stack to the captured stderr
    randomness = random_states()
    baseline = process_state(adapters) if box["confined"] else None
    # Python's tempfile looks for a folder it can write a file in, and none is left once the learner's filter is
    # on: it gets the box's own (torch's compiler asks for it even when flex_attention runs eagerly).
    import tempfile

    tempfile.tempdir = box["tmp"]
    confine_learner(libc())  # before any learner code: this process and its threads, for good
    header = opened
    while header is not None and header.get("cmd") == "open":
        restore_random_states(randomness)  # every stage starts from the template's random state
        ceiling = header.get("memory_headroom")
        header = serve_stage(adapters, box, header)
        if header is None or header.get("cmd") != "close":
            return
        changed = changes(baseline, process_state(adapters)) if baseline is not None else ["no private /proc to check"]
        if ceiling:
            changed.append("memory ceiling")  # it cannot be raised again: the next stage gets a fresh worker
        if changed:
            write_message(REPLIES, {"kind": "leaving", "token": header.get("token"), "changed": changed[:5]})
            return
        write_message(REPLIES, {"kind": "parked", "token": header.get("token")})
        message = read_message(REQUESTS)
        header = message[0] if message else None

def serve_stage(adapters, box, opened):
    """Import the stage module of the "open" request ``opened``, with the reference modules it brings
    (``provided``), then answer operations on it; returns the request that ended it."""
    import traceback

    submission, module = box["submission"], opened["module"]
    if opened.get("memory_headroom"):
        hold_address_space(int(opened["memory_headroom"]))
    try:
        loaded = adapters.load_stage_module(submission, module, opened.get("provided"))
    except adapters.SubmissionError as exc:
        loaded = exc
    while True:
        message = read_message(REQUESTS)
        if message is None or message[0].get("cmd") != "op":
            return message and message[0]
        header, blobs = message
        try:
            if isinstance(loaded, adapters.SubmissionError):
                raise adapters.SubmissionError(str(loaded))
            kwargs = decode(header["kwargs"], blobs)
            result = adapters.OPS[header["op"]](loaded, **kwargs)
            out = []
            reply = {"kind": "result", "value": encode(result, out)}
        except adapters.SubmissionError as exc:
            out, reply = [], {"kind": "submission_error", "message": clip(str(exc))}
        except Exception as exc:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if inside(f.filename, submission)]
            for frame in frames:  # the learner knows the file by its name, not our copy's path
                frame.filename = os.path.basename(frame.filename)
            out, reply = [], {
                "kind": "exception", "type": type(exc).__name__, "message": clip(str(exc)),
                "memory": isinstance(exc, MemoryError) or "can't allocate memory" in str(exc),
                "traceback": "".join(traceback.format_list(frames[-4:])),
            }
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        reply["token"] = header.get("token")
        write_message(REPLIES, reply, out)


MEMORY_SLACK = 256 << 20  # a stage may leave this much more address space in use than the zygote


def changes(before, after):
    """The names of the parts of ``process_state`` that differ. Two may grow a little: the address
    space (by the slack), and the operating-system threads (by torch's own intra-op pool, which
    OpenMP starts on the first parallel operation when torch computes with several threads)."""
    import torch

    allowed = {"address space": MEMORY_SLACK, "threads": torch.get_num_threads() - 1}
    changed = []
    for key, value in after.items():
        old = before.get(key)
        if key in allowed and value is not None and old is not None:
            if value - old > allowed[key]:
                changed.append(key)
        elif value != old:
            changed.append(key)
    return changed


def process_state(adapters):
    """What a stage could leave behind for the next one to trip over, as comparable values.

    Covers the ways code changes a Python process for the code that runs after it: names
    rebound in the modules and classes the stages and this worker use (by object identity),
    torch's global modes and hooks, the interpreter's import machinery, streams, signal
    handlers and warning filters, and the operating system's view (threads, processes, open
    files, address space).
    """
    import builtins
    import signal
    import threading
    import warnings

    import numpy
    import torch

    nn = torch.nn
    spaces = [builtins, torch, nn, nn.functional, nn.init, torch.Tensor, nn.Module, nn.Linear, nn.Dropout,
              nn.ModuleList, nn.Parameter, nn.modules.module, numpy, adapters, adapters.Allocations,
              sys.modules[__name__], json]
    # Copies of their dictionaries: comparing two is C code with an identity shortcut per entry.
    state = {f"names of {getattr(s, '__name__', s)}": dict(vars(s)) for s in spaces}
    state["adapters.OPS"] = {k: id(v) for k, v in adapters.OPS.items()}
    # Two readings have no public API, so they use torch's private names, here only and with defaults
    # should a torch release drop them: whether a __torch_function__ mode was left pushed
    # (torch._C), and the global hooks every nn.Module runs (nn.modules.module._global_*).
    state["torch modes"] = (
        torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(), torch.get_num_threads(),
        torch.get_float32_matmul_precision(), str(getattr(torch, "get_default_device", str)()),
        getattr(torch._C, "_len_torch_function_stack", int)(), torch._C._is_torch_function_enabled(),
    )
    state["torch.nn global hooks"] = {k: len(v) for k, v in vars(nn.modules.module).items()
                                      if k.startswith("_global_") and isinstance(v, dict)}
    state["python threads"] = threading.active_count()
    state["interpreter"] = (
        [id(f) for f in sys.meta_path], [id(h) for h in sys.path_hooks], list(sys.path), id(sys.stdout),
        id(sys.stderr), id(sys.excepthook), sys.getrecursionlimit(), [id(f) for f in warnings.filters],
        [id(signal.getsignal(n)) for n in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
        os.getcwd(), sorted(os.environ.items()), numpy.geterr(),
    )
    try:
        state["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        state["threads"] = len(os.listdir("/proc/self/task"))  # Python's and native ones
        state["open files"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/statm") as statm:
            state["address space"] = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        state["processes"] = None
    return state


def random_states():
    import random

    import numpy
    import torch

    return torch.get_rng_state(), numpy.random.get_state(), random.getstate()


def restore_random_states(states):
    import random

    import numpy
    import torch

    torch.set_rng_state(states[0])
    numpy.random.set_state(states[1])
    random.setstate(states[2])


if __name__ == "__main__":
    sys.exit(main())
