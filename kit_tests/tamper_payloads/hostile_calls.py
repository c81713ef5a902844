"""Functions that misbehave when the grader calls them (appended to a correct s01 module).

tests/test_sandbox.py reaches each one through the adapter's "call" operation, which runs any
function of a stage module. Some break limits (time, memory, processes, output), some tamper
with what they can reach, some try to leave something behind for the next submission
(``plant``) or to find what an earlier one left (``scavenge``).
"""
import ctypes
import json
import os
import signal
import socket
import sys
import time

import numpy as np
import torch

LOOT = b"left behind by another submission"
KEY = 0x5A7E  # SysV IPC key of the planted segment


def spin():
    while True:
        pass


def nap():
    time.sleep(3600)


def doze(seconds):
    """Sleep ``seconds``, then answer correctly (within each check's limit on waiting)."""
    time.sleep(float(seconds))
    return torch.ones(1)


def burn(seconds):
    """Use ``seconds`` of CPU time, then answer correctly (slow but honest)."""
    end = time.process_time() + float(seconds)
    while time.process_time() < end:
        pass
    return torch.ones(1)


def burn_hidden(seconds):
    """Use ``seconds`` of CPU time in children the kernel reaps by itself (SIGCHLD ignored): /proc
    shows none of it once they are gone."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    done = 0.0
    while done < seconds:
        for _ in range(2):
            if os.fork() == 0:
                burn(0.2)
                os._exit(0)
        time.sleep(0.25)
        done += 0.4
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return torch.ones(1)


def hog_in_background(seconds, parallel):
    """Keep ``parallel`` cores busy for ``seconds`` after answering, unseen by /proc's counts: a manager
    (child subreaper, SIGCHLD ignored) adopts chains of short-lived processes, each in a session of
    its own (a scheduling group of its own), each burning a slice, forking the next and exiting."""
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        end = time.monotonic() + float(seconds)
        for _ in range(int(parallel)):
            if os.fork() == 0:
                os.setsid()
                while time.monotonic() < end:
                    burn(0.03)
                    if os.fork() != 0:
                        os._exit(0)
                    os.setsid()
                os._exit(0)
        time.sleep(float(seconds) + 1)
        os._exit(0)
    return torch.ones(1)


def live_processes():
    """How many processes of this box live (zombies do not), besides its first one and this worker."""
    alive = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                alive += stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            pass
    return torch.tensor(alive - 2)


def spread_memory(children, megabytes):
    """Hold ``megabytes`` of written memory in each of ``children`` processes (each under its own
    address-space limit, all together above the box's memory). Returns once every child has
    written its share, or died trying."""
    import select

    pipes = []
    for _ in range(int(children)):
        read, write = os.pipe()
        if os.fork() == 0:
            os.close(read)
            hoard = bytearray(int(megabytes) << 20)
            hoard[::4096] = b"x" * len(hoard[::4096])
            os.write(write, b"x")
            time.sleep(60)
            os._exit(0)
        os.close(write)
        pipes.append(read)
    deadline = time.monotonic() + 30
    while pipes and time.monotonic() < deadline:
        ready, _, _ = select.select(pipes, [], [], 1)
        for read in ready:
            os.read(read, 1)  # done, or b"" once it was killed
            pipes.remove(read)
    return torch.ones(1)


def answer_ahead(value):
    """Send a result for the next operation before it is asked for (with this one's token)."""
    from wire import write_message
    from worker_process import REPLIES

    token = None
    frame = sys._getframe()
    while frame is not None and token is None:
        header = frame.f_locals.get("header")
        if isinstance(header, dict) and header.get("cmd") == "op":
            token = header.get("token")
        frame = frame.f_back
    from wire import encode

    blobs = []
    write_message(REPLIES, {"kind": "result", "token": token, "value": encode(float(value), blobs)}, blobs)
    return torch.tensor(float(value))


def eat_memory():
    hoard = []
    while True:
        # 256 MiB at a time; RLIMIT_AS counts reserved memory, so pages need not be
        # written (writing 2 GiB takes seconds on a small VM).
        hoard.append(torch.empty(1 << 26))


def leave_quietly():
    sys.exit(0)


def leave_abruptly():
    os._exit(3)


def crash():
    ctypes.string_at(0)  # read address 0: SIGSEGV


def shout():
    line = "x" * (1 << 20)
    for _ in range(1024):  # 1 GiB
        sys.stdout.write(line)
    return torch.zeros(1)


def fork_loop():
    made = 0
    for _ in range(500):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    return torch.tensor(made)


def tamper():
    """Patch the libraries and the adapter; the grader must not notice beyond the returned values."""
    from suite_runtime import adapters

    np.allclose = np.array_equal = lambda *a, **k: True
    np.testing.assert_allclose = lambda *a, **k: None
    torch.allclose = lambda *a, **k: True
    adapters.to_plain = lambda value, what: "tampered"
    return torch.full((3,), 7.0)


def forge():
    """Break the wire format: the grader must reject the answer, not believe it."""
    json.dumps = lambda *a, **k: '{"kind": "result", "value": "forged"}'
    return torch.zeros(1)


def impersonate():
    """Answer for the sandbox on every file descriptor this process holds: 'ended', 'parked' and a
    forged result, with every token found in the stack frames of the serving code."""
    from wire import write_message

    tokens = set()
    frame = sys._getframe()
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, dict) and isinstance(value.get("token"), str):
                tokens.add(value["token"])
        frame = frame.f_back
    for fd in map(int, os.listdir("/proc/self/fd")):
        for token in tokens:
            for message in ({"kind": "ended", "token": token, "status": 0}, {"kind": "parked", "token": token},
                            {"kind": "result", "token": token, "value": "forged"}):
                try:
                    write_message(fd, message)
                except OSError:
                    pass
    return torch.tensor(len(tokens))


def run_program():
    """Replace this worker with a fresh Python (which would start without the stage's memory ceiling)."""
    os.execv(sys.executable, [sys.executable, "-c", "pass"])


def read_bytes(path):
    with open(path, "rb") as handle:
        return torch.tensor(list(handle.read(64)), dtype=torch.uint8)


def write_file(path):
    with open(path, "w") as handle:
        handle.write("pwned")
    return torch.tensor(os.path.exists(path))


def list_dir(path):
    # Entries a learner could have made: root's are the sandbox's own (a venv bound under /tmp).
    return torch.tensor(sum(e.stat(follow_symlinks=False).st_uid != 0 for e in os.scandir(path)))


def connect():
    socket.create_connection(("1.1.1.1", 80), timeout=1)
    return torch.tensor(True)


def whoami():
    return torch.tensor([os.getuid(), os.getgid()])


def world():
    """What this process sees of the machine: its file descriptors (and what they are), the
    processes, whether it can be traced, its threads."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    dumpable = ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
    with open("/proc/self/mountinfo") as mounts:  # mount point and its own options, per line
        writable = sorted(line.split()[4] for line in mounts if "rw" in line.split()[5].split(","))
    return {"fds": fds, "pids": pids, "dumpable": dumpable, "writable_mounts": writable,
            "torch_threads": torch.get_num_threads(), "omp_threads": os.environ.get("OMP_NUM_THREADS")}


# ---------------------------------------------------------------- leaving traces for the next submission

def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.shmat.restype = ctypes.c_void_p
    return lib


def _keyctl(*args):
    return _libc().syscall({"x86_64": 250, "aarch64": 219}[os.uname().machine], *args)


def _add_key(description, payload):
    number = {"x86_64": 248, "aarch64": 217}[os.uname().machine]
    return _libc().syscall(number, b"user", description, payload, len(payload), -3)  # the session keyring


def plant():
    """Leave LOOT in every channel that could outlive this submission; returns the ones that took it."""
    took = []
    for folder in ("/tmp/attnkit-loot", "/dev/shm/attnkit-loot", os.path.expanduser("~/attnkit-loot")):
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "loot"), "wb") as handle:
                handle.write(LOOT)
            os.chmod(folder, 0o555)  # an unprivileged clean-up cannot remove it any more
            took.append(folder)
        except OSError:
            pass
    lib = _libc()
    shmid = lib.shmget(KEY, 4096, 0o1666)  # IPC_CREAT | 0666
    if shmid >= 0:
        address = lib.shmat(shmid, None, 0)
        ctypes.memmove(address, LOOT, len(LOOT))
        took.append("sysv-shm")
    if _add_key(b"attnkit-loot", LOOT) > 0:
        took.append("keyring")
    # A daemon that outlives this process, ignores what signals it can and serves LOOT on an
    # abstract unix socket.
    try:
        daemon = os.fork()
    except OSError:
        return sorted(took)
    if daemon == 0:
        os.setsid()
        if os.fork() == 0:
            for number in set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD}:
                try:
                    signal.signal(number, signal.SIG_IGN)
                except (OSError, ValueError):
                    pass
            try:
                server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                server.bind("\0attnkit-loot")
                server.listen(8)
                server.settimeout(120)
                while True:
                    connection, _ = server.accept()
                    connection.sendall(LOOT)
                    connection.close()
            finally:
                os._exit(0)
        os._exit(0)
    time.sleep(0.2)
    took.append("daemon")
    return sorted(took)


def scavenge():
    """The channels in which LOOT from an earlier submission is found."""
    found = []
    for folder in ("/tmp/attnkit-loot", "/dev/shm/attnkit-loot", os.path.expanduser("~/attnkit-loot")):
        try:
            with open(os.path.join(folder, "loot"), "rb") as handle:
                if handle.read() == LOOT:
                    found.append(folder)
        except OSError:
            pass
    lib = _libc()
    shmid = lib.shmget(KEY, 4096, 0)
    if shmid >= 0:
        address = lib.shmat(shmid, None, 0)
        if address not in (None, ctypes.c_void_p(-1).value) and ctypes.string_at(address, len(LOOT)) == LOOT:
            found.append("sysv-shm")
    if _keyctl(10, -3, b"user", b"attnkit-loot", 0) > 0:  # KEYCTL_SEARCH in the session keyring
        found.append("keyring")
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(1)
        client.connect("\0attnkit-loot")
        if client.recv(64) == LOOT:
            found.append("daemon")
    except OSError:
        pass
    return sorted(found)
