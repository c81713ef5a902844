"""[attnkit-tamper] hoard_anonymous -- family (l), memory no address space counts: anonymous files and pipes.

Append to any stage module. RLIMIT_AS bounds a process's address space; memory held in an anonymous file or a pipe's
buffers is no address space, and without a cgroup nothing else would count it. At import this holds as much as it can
by every such route, up to ``_ATK_TARGET`` bytes in all: memfd_create (filled with ftruncate and fallocate, and
written), O_TMPFILE files (in its scratch folder and /dev/shm), files created in /dev/shm (POSIX shared memory
included), pipes (made larger with F_SETPIPE_SZ and filled; pages given with vmsplice), and Unix socketpairs (send
buffers raised and filled). ``hoarded()`` says what each route held, in bytes (what it refused: 0). If it held more
than ``_ATK_BREACH`` bytes in all, its import fails saying so (the stage then scores 0); it lets go of everything
before the stage goes on.

Expected: anonymous files and sockets refused; pipes bounded by the box's limit on open files, far below the breach.
"""

_ATK_TARGET = 1 << 30  # what it tries to hold beyond its address space
_ATK_BREACH = 128 << 20  # more than this, and the box's memory is not bounded by its limits


def _atk_hoard():
    import ctypes
    import errno
    import fcntl
    import os
    import socket
    import tempfile

    held, fds = {}, []
    chunk = b"\xaa" * (1 << 20)

    def total():
        return sum(held.values())

    def fill_file(fd, route):
        """Grow an anonymous file (up to 256 MiB, within the target): ftruncate and fallocate, else writes."""
        size, want = 0, min(256 << 20, _ATK_TARGET - total())
        try:
            os.ftruncate(fd, want)
            os.posix_fallocate(fd, 0, want)
            size = want
        except OSError:
            pass
        try:
            while size < want:
                size += os.write(fd, chunk)
        except OSError:
            pass
        held[route] = held.get(route, 0) + size

    # memfd: many of them (RLIMIT_FSIZE bounds each, not their number)
    for _ in range(8):
        try:
            fd = os.memfd_create("hoard")
        except OSError:
            held.setdefault("memfd", 0)
            break
        fds.append(fd)
        fill_file(fd, "memfd")
    # O_TMPFILE in its scratch folder and /dev/shm; files created in /dev/shm; POSIX shared memory
    for folder in (tempfile.gettempdir(), "/dev/shm"):
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError:
            held.setdefault("O_TMPFILE", 0)
            continue
        fds.append(fd)
        fill_file(fd, "O_TMPFILE")
    try:
        fd = os.open(f"/dev/shm/.atk-hoard-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        os.unlink(f"/dev/shm/.atk-hoard-{os.getpid()}")
        fds.append(fd)
        fill_file(fd, "/dev/shm")
    except OSError:
        held.setdefault("/dev/shm", 0)
    try:
        import _posixshmem

        fd = _posixshmem.shm_open(f"/atk-hoard-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        _posixshmem.shm_unlink(f"/atk-hoard-{os.getpid()}")
        fds.append(fd)
        fill_file(fd, "shm_open")
    except (OSError, ImportError):
        held.setdefault("shm_open", 0)
    # pipes: as many as it may open, each made as large as it may be, filled (and user pages given by vmsplice)
    libc = ctypes.CDLL(None, use_errno=True)
    page = ctypes.create_string_buffer(chunk[:65536])
    iov = (ctypes.c_void_p * 2)(ctypes.cast(page, ctypes.c_void_p), 65536)
    held["pipes"] = held["vmsplice"] = 0
    while total() < _ATK_TARGET:
        try:
            read, write = os.pipe2(os.O_NONBLOCK)
        except OSError:
            break  # (EMFILE: the box's limit on open files)
        fds += [read, write]
        try:
            fcntl.fcntl(write, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        if libc.vmsplice(write, iov, 1, 0) > 0:
            held["vmsplice"] += 65536
        try:
            while True:
                held["pipes"] += os.write(write, chunk)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                break
    # Unix socketpairs: send buffers raised as far as they go, filled
    held["sockets"], pairs = 0, []
    while total() < _ATK_TARGET:
        try:
            pair = socket.socketpair()
        except OSError:
            break
        pairs.append(pair)
        try:
            pair[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
            pair[0].setblocking(False)
            while True:
                held["sockets"] += pair[0].send(chunk[:65536])
        except OSError:
            pass
    for fd in fds:
        os.close(fd)
    for pair in pairs:
        pair[0].close()
        pair[1].close()
    return held


_ATK_HELD = _atk_hoard()
if sum(_ATK_HELD.values()) > _ATK_BREACH:
    raise RuntimeError(f"HOARDED {sum(_ATK_HELD.values()) >> 20} MiB beyond its address space: {_ATK_HELD}")


def hoarded():
    return dict(_ATK_HELD)
