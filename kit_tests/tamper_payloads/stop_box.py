"""[attnkit-tamper] stop_box -- family (m), stopping the processes that serve one's own box.

Append to any stage module (a solution: the attack, not the work, is what is graded). The box's first process
forks the worker that runs learner code and waits for it; once it is stopped or gone, no later stage of the
submission would be taken. At import this tries to reach it and every other process it can see: signal 0 to each
(a permission check), then SIGSTOP and SIGKILL to its parent by every call that takes a pid or a handle: kill,
killpg, kill(0) and kill(-1), tgkill, tkill, rt_sigqueueinfo, pidfd_send_signal on a /proc/<pid> folder, and a
file descriptor given its parent as owner (F_SETOWN, F_SETOWN_EX, FIOSETOWN) with SIGSTOP as the signal the kernel
sends when the file is ready. ``reached()`` names what worked; if anything did, its import fails saying so.

Expected: nothing reached; the stage and the next ones get their honest grades, in the same box.
"""

_ATK_CALLS = {  # the raw system calls, by machine
    "x86_64": {"tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "pidfd_send_signal": 424},
    "aarch64": {"tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138, "pidfd_send_signal": 424},
}


def _atk_stop_box():
    import ctypes
    import fcntl
    import os
    import signal
    import socket
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    calls = _ATK_CALLS.get(os.uname().machine, {})
    me, parent = os.getpid(), os.getppid()
    reached = []

    def attempt(what, action):
        try:
            result = action()
        except (OSError, ValueError):
            return
        if result is None or result == 0 or result is True:
            reached.append(what)

    for pid in sorted({int(p) for p in os.listdir("/proc") if p.isdigit()} - {me}):
        attempt(f"signal process {pid}", lambda pid=pid: os.kill(pid, 0))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        name = signal.Signals(sig).name
        attempt(f"{name} its parent", lambda: os.kill(parent, sig))
        attempt(f"{name} its parent's group", lambda: os.killpg(os.getpgid(parent), sig))
        for pid in (0, -1):  # (its own group; every process of its uid)
            attempt(f"{name} to kill({pid})", lambda pid=pid: os.kill(pid, sig) if sig != signal.SIGKILL else 1)
        if calls:
            attempt(f"{name} its parent with tgkill", lambda: libc.syscall(calls["tgkill"], parent, parent, sig))
            attempt(f"{name} its parent with tkill", lambda: libc.syscall(calls["tkill"], parent, sig))
            info = ctypes.create_string_buffer(struct.pack("iii", sig, 0, -1) + bytes(116))  # si_code SI_QUEUE
            attempt(f"{name} its parent with rt_sigqueueinfo",
                    lambda: libc.syscall(calls["rt_sigqueueinfo"], parent, sig, info))
            try:
                handle = os.open(f"/proc/{parent}", os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                handle = None
            if handle is not None:
                attempt(f"{name} its parent with pidfd_send_signal",
                        lambda: libc.syscall(calls["pidfd_send_signal"], handle, sig, None, 0))
                os.close(handle)
    # A file whose owner is its parent, the signal SIGSTOP: the kernel would send it when the file is ready.
    read, write = os.pipe()
    attempt("make its parent a pipe's owner (F_SETOWN)", lambda: fcntl.fcntl(read, fcntl.F_SETOWN, parent) and None)
    attempt("make its parent a pipe's owner (F_SETOWN_EX)",
            lambda: fcntl.fcntl(read, 15, struct.pack("ii", 1, parent)) and None)
    try:
        fcntl.fcntl(read, 10, signal.SIGSTOP)  # F_SETSIG
        fcntl.fcntl(read, fcntl.F_SETFL, os.O_ASYNC)
        os.write(write, b"x")
    except OSError:
        pass
    try:
        pair = socket.socketpair()
    except OSError:  # (graded code may open no socket: the ioctl is tried on the pipe)
        pair = None
    attempt("make its parent a file's owner (FIOSETOWN)",
            lambda: fcntl.ioctl(pair[0] if pair else read, 0x8901, struct.pack("i", parent)) and None)
    for end in pair or ():
        end.close()
    os.close(read)
    os.close(write)
    return reached


_ATK_REACHED = _atk_stop_box()
if _ATK_REACHED:
    raise RuntimeError("REACHED the processes around it: " + "; ".join(_ATK_REACHED[:6]))


def reached():
    return list(_ATK_REACHED)
