"""The Linux system calls the confined side makes, by number and with their flags, and the mounts it builds with.

Part of the confined side (``child``): the grader copies this file into the box's runtime folder, where the template
imports it before any sandbox exists, so it imports the standard library only. The trusted side reads its tables
(``AUDIT_ARCH``: which machines a seccomp filter can be written for).
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME is clone3's and unshare's only)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
BOX_NAMESPACES = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS  # (and a pid namespace: see child.spawn)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
KEYCTL_JOIN_SESSION_KEYRING = 1
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1

# System call numbers (glibc wraps few of these, and a seccomp filter names calls by number), per machine.
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "open": 2, "ioctl": 16, "shmget": 29, "shmat": 30, "shmctl": 31, "socket": 41, "socketpair": 53,
        "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62, "semget": 64, "semop": 65, "semctl": 66,
        "shmdt": 67, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "fcntl": 72, "truncate": 76,
        "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "chmod": 90,
        "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "ptrace": 101, "rt_sigqueueinfo": 129, "utime": 132,
        "mknod": 133, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165, "umount2": 166,
        "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
        "fremovexattr": 199, "tkill": 200, "semtimedop": 220, "tgkill": 234, "utimes": 235,
        "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144, "sched_setaffinity": 203,
        "ioprio_set": 251, "prlimit64": 302, "sched_setattr": 314, "vmsplice": 278, "rt_tgsigqueueinfo": 297,
        "mq_open": 240, "mq_unlink": 241, "add_key": 248, "request_key": 249, "keyctl": 250, "inotify_init": 253,
        "inotify_add_watch": 254, "openat": 257, "mkdirat": 258, "mknodat": 259, "fchownat": 260,
        "futimesat": 261, "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266, "fchmodat": 268,
        "unshare": 272, "utimensat": 280, "inotify_init1": 294, "perf_event_open": 298, "fanotify_init": 300,
        "fanotify_mark": 301, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "renameat2": 316, "memfd_create": 319,
        "bpf": 321, "execveat": 322, "userfaultfd": 323, "pidfd_send_signal": 424, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435, "openat2": 437,
        "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "memfd_secret": 447,
        "process_mrelease": 448, "fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467,
    },
    "aarch64": {  # the generic table (no open, creat, fork, mkdir ...: only their *at forms)
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
        "fcntl": 25, "inotify_init1": 26, "inotify_add_watch": 27, "ioctl": 29, "ioprio_set": 30, "mknodat": 33,
        "mkdirat": 34, "unlinkat": 35, "vmsplice": 75, "sched_setparam": 118, "sched_setscheduler": 119,
        "sched_setaffinity": 122, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "setpriority": 140, "rt_tgsigqueueinfo": 240, "prlimit64": 261, "sched_setattr": 274,
        "symlinkat": 36, "linkat": 37, "renameat": 38, "umount2": 39, "mount": 40, "pivot_root": 41,
        "truncate": 45, "chroot": 51, "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "openat": 56,
        "utimensat": 88, "acct": 89, "unshare": 97, "ptrace": 117, "mq_open": 180, "mq_unlink": 181,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191,
        "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197, "socket": 198,
        "socketpair": 199, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "execve": 221,
        "perf_event_open": 241, "fanotify_init": 262, "fanotify_mark": 263, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "renameat2": 276, "memfd_create": 279, "bpf": 280, "execveat": 281, "userfaultfd": 282,
        "pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "pidfd_open": 434, "clone3": 435, "openat2": 437, "pidfd_getfd": 438, "process_madvise": 440,
        "mount_setattr": 442, "memfd_secret": 447, "process_mrelease": 448, "fchmodat2": 452, "setxattrat": 463,
        "removexattrat": 466, "open_tree_attr": 467,
    },
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # the system call ABI a seccomp filter allows
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
DEVICES = ["null", "zero", "full", "random", "urandom"]


def libc() -> ctypes.CDLL:
    """The C library, with the argument types of the calls made through it."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib


def check(result: int, what: str) -> None:
    """Raise OSError (with errno's text) where a C call returned non-zero."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def syscall(lib: ctypes.CDLL, name: str, *args) -> int:
    numbers = SYSCALLS.get(os.uname().machine)
    if numbers is None:
        raise RuntimeError(f"{name}: unknown system call number on {os.uname().machine}")
    return lib.syscall(numbers[name], *args)


def mount(lib: ctypes.CDLL, source, target, fstype, flags: int, data=None) -> None:
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    check(lib.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def bind(lib: ctypes.CDLL, source: str, target: str, readonly: bool = True) -> None:
    """Bind ``source`` (a directory or a device file) at ``target``, with what is mounted below it;
    read-only by default, the mounts below it too."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(lib, source, target, None, MS_BIND | MS_REC)
    if readonly:
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0))
        if syscall(lib, "mount_setattr", AT_FDCWD, str(target).encode(), AT_RECURSIVE, attr, len(attr.raw)) == 0:
            return
        # A kernel before 5.12: only the top mount can be made read-only. The remount must keep
        # the flags the source mount already has (the kernel refuses to clear them in a user namespace).
        st = os.statvfs(source)
        keep = (st.f_flag & os.ST_NOSUID and MS_NOSUID) | (st.f_flag & os.ST_NODEV and MS_NODEV) | (
            st.f_flag & os.ST_NOEXEC and MS_NOEXEC)
        mount(lib, None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def tmpfs(lib: ctypes.CDLL, target: str, size_bytes: int, mode: str = "1777",
          flags: int = MS_NOSUID | MS_NODEV) -> None:
    os.makedirs(target, exist_ok=True)
    mount(lib, "tmpfs", target, "tmpfs", flags, f"size={size_bytes},mode={mode}")


def inside(path: str, parent: str) -> bool:
    """Whether ``path`` is ``parent`` or lies below it (real paths)."""
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def warn(text: str) -> None:
    sys.stderr.write(f"[sandbox] {text}\n")
    sys.stderr.flush()
