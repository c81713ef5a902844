"""Seccomp filters: the learner's filter, which every process that runs learner code loads before it does.

Part of the confined side (``child``): standard library only, copied into the box's runtime folder.

What learner code may not do when graded, whatever the confinement, and why:

* run programs or start processes (threads only): a fresh process would escape the stage's memory ceiling
  (RLIMIT_AS is a number of bytes, checked against each process's own address space);
* reach other processes: memory, file descriptors, handles on them; signals only to its own process, so that
  the processes that serve its box (the box's first process, the template, the reference process, the grader)
  are out of its reach even where they share its uid: ``kill``, ``tgkill`` and ``rt_(tg)sigqueueinfo`` name
  its own pid or fail, ``tkill`` and ``pidfd_send_signal`` always fail, and no file descriptor can be given an
  owner that the kernel would signal on its behalf (``F_SETOWN``, ``FIOSETOWN``...);
* open a socket (a Unix socketpair included), watch files, use the keyrings, namespaces, mounts, BPF, perf,
  io_uring (its requests bypass seccomp);
* leave anything in the file system or in IPC objects for a later box: no file opened for writing or created
  (``O_TMPFILE`` included), no System V or POSIX IPC;
* hold memory that its address space does not count: no memfd (``memfd_create``, ``memfd_secret``), no
  ``vmsplice`` (pages given to a pipe stay there once unmapped), no larger pipe buffers (``F_SETPIPE_SZ``), no
  socket buffers (no sockets); what is left, pipes of the default size, is bounded by the box's limit on open
  files (``Limits.files``: 64 KiB a pipe, two files each).
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct

if __package__:  # the trusted side (grader.sandbox.seccomp)
    from .syscalls import (
        AUDIT_ARCH,
        CLONE_NEW,
        CLONE_THREAD,
        PR_SET_NO_NEW_PRIVS,
        PR_SET_SECCOMP,
        SECCOMP_MODE_FILTER,
        SYSCALLS,
        check,
    )
else:  # the box's runtime folder, which child.py puts on the path while it imports its siblings
    from syscalls import (
        AUDIT_ARCH,
        CLONE_NEW,
        CLONE_THREAD,
        PR_SET_NO_NEW_PRIVS,
        PR_SET_SECCOMP,
        SECCOMP_MODE_FILTER,
        SYSCALLS,
        check,
    )

KEYRING_CALLS = ("add_key", "request_key", "keyctl")
LEARNER_DENIED = (
    # run programs or start processes
    "execve", "execveat", "fork", "vfork",
    # reach other processes: memory, file descriptors, handles on them, signals through a handle or a thread id
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "process_mrelease", "kcmp", "pidfd_open",
    "pidfd_getfd", "pidfd_send_signal", "tkill",
    # the network, sockets (a Unix socketpair too: its buffers are memory no address space counts, and no stage
    # needs one); watching files for the grader's writes
    "socket", "socketpair", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark",
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
    # memory no address space counts: anonymous files, and user pages handed to a pipe
    "memfd_create", "memfd_secret", "vmsplice",
)
# Calls whose arguments a filter cannot read (they point to memory): "not implemented", so that the C library
# falls back to the older call, whose arguments are checked (clone3 -> clone, openat2 -> openat).
LEARNER_UNIMPLEMENTED = ("clone3", "openat2")
O_TMPFILE_BIT = 0o20000000  # __O_TMPFILE (with O_DIRECTORY it makes O_TMPFILE), the same on x86_64 and aarch64
OPEN_WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_TMPFILE_BIT  # (O_APPEND needs a write mode)
F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETPIPE_SZ = 8, 10, 15, 1031
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902  # ioctl's F_SETOWN, for files and sockets
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # type into a terminal
# fcntl and ioctl requests learner code may not make: an owner the kernel signals when the file is ready (a way to
# signal any process of the uid), a larger pipe buffer, typing into a terminal the grader's processes read
FCNTL_DENIED = (F_SETOWN, F_SETSIG, F_SETOWN_EX, F_SETPIPE_SZ)
IOCTL_DENIED = (TIOCSTI, TIOCLINUX, FIOSETOWN, SIOCSPGRP)

# Classic BPF for seccomp: instructions (code, jump if true, jump if false, k) over struct seccomp_data,
# whose fields are the call's number (offset 0), its ABI (4) and six 64-bit arguments (16 + 8 i; the low
# 32 bits first on these little-endian machines). Jumps count the instructions they skip.
BPF_LOAD, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_ALLOW, SECCOMP_ERRNO = 0x7FFF0000, 0x00050000
Instruction = tuple[int, int, int, int]
ALLOW: Instruction = (BPF_RET, 0, 0, SECCOMP_ALLOW)
DENY: Instruction = (BPF_RET, 0, 0, SECCOMP_ERRNO | errno.EPERM)


def _argument(i: int) -> int:
    return 16 + 8 * i


def seccomp_program(machine: str, denied=(), unimplemented=(), checks=()) -> list[Instruction]:
    """A seccomp filter (a list of BPF instructions) that makes the calls ``denied`` fail with EPERM and
    ``unimplemented`` with ENOSYS, and runs ``checks``: (call, instructions that end in a return, run with the
    call's number loaded). Every call through another ABI (i386's int 0x80, x32) fails: it could reach the
    same calls by other numbers. Calls this machine does not have are left out."""
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
    return program + [ALLOW]


def _flags_clear(argument: int, mask: int) -> list[Instruction]:
    """Allowed when none of ``mask``'s bits is set in the argument."""
    return [(BPF_LOAD, 0, 0, _argument(argument)), (BPF_JSET, 0, 1, mask), DENY, ALLOW]


def _equals(argument: int, value: int) -> list[Instruction]:
    """Allowed when the argument (its low 32 bits, an int or a pid) is ``value``."""
    return [(BPF_LOAD, 0, 0, _argument(argument)), (BPF_JEQ, 0, 1, value), ALLOW, DENY]


def _none_of(argument: int, values: tuple[int, ...]) -> list[Instruction]:
    """Allowed unless the argument (its low 32 bits) is one of ``values``."""
    count = len(values)
    return [(BPF_LOAD, 0, 0, _argument(argument)), *[(BPF_JEQ, count - i, 0, value) for i, value in enumerate(values)],
            ALLOW, DENY]


def learner_checks(own_pid: int) -> list[tuple[str, list[Instruction]]]:
    """The calls the learner's filter allows only with some arguments (see ``seccomp_program``); ``own_pid``: the
    process that loads the filter (its threads share it), the only one its signals may reach."""
    return [
        # threads, never processes (nor new namespaces)
        ("clone", [(BPF_LOAD, 0, 0, _argument(0)), (BPF_JSET, 2, 0, CLONE_NEW), (BPF_JSET, 0, 1, CLONE_THREAD),
                   ALLOW, DENY]),
        # files are opened to be read, never written or created
        ("open", _flags_clear(1, OPEN_WRITES)),
        ("openat", _flags_clear(2, OPEN_WRITES)),
        # signals to this process only (its threads: tgkill with its own pid; raise() and abort() use that)
        *[(name, _equals(0, own_pid)) for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")],
        # limits, priorities and CPUs of this process only: not the box's first process, whose next workers would
        # inherit them (the pid or "who" argument 0 means the caller)
        *[(name, _equals(index, 0)) for name, index in (
            ("prlimit64", 0), ("sched_setparam", 0), ("sched_setscheduler", 0), ("sched_setaffinity", 0),
            ("sched_setattr", 0), ("setpriority", 1), ("ioprio_set", 1))],
        ("fcntl", _none_of(1, FCNTL_DENIED)),
        ("ioctl", _none_of(1, IOCTL_DENIED)),
    ]


def install_seccomp(lib: ctypes.CDLL, program: list[Instruction]) -> None:
    """Load ``program`` for this thread and everything it starts (needs no_new_privs)."""
    code = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
    filters = ctypes.create_string_buffer(code)

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    compiled = Program(len(program), ctypes.cast(filters, ctypes.c_void_p))
    check(lib.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(compiled), 0, 0), "seccomp")


def deny(lib: ctypes.CDLL, names) -> None:
    """A seccomp filter for this process and all it starts: the system calls ``names`` fail with EPERM."""
    install_seccomp(lib, seccomp_program(os.uname().machine, denied=names))


def confine_learner(lib: ctypes.CDLL) -> None:
    """The learner's filter (see the module docstring), loaded by a process before it runs learner code: for it
    and its threads, for good."""
    check(lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    install_seccomp(lib, seccomp_program(os.uname().machine, LEARNER_DENIED, LEARNER_UNIMPLEMENTED,
                                         learner_checks(os.getpid())))
