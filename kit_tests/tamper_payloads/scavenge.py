"""[attnkit-tamper] scavenge -- family (c), the scavenger: run another submission's planted source.

Append to the STUB of every stage (victim/scavenger submission: all stubs + this payload). At
import it looks, in every persistence channel the plant_*.py payloads use, for the source
planted for THIS module (found by the module's name, so stage k only finds what the attacker put
in channel k), and if it finds one, it installs the stage modules that source imports into
sys.modules and execs the source into this module's globals: the stub's functions and classes
are replaced by the attacker's correct ones. It prints "[scavenge] <module> <- <channel>" on
stderr. Its honest grade is 0 on every stage (stubs); any point it gets came through a channel.

Channels, in order: /tmp/.atk-plant-*, /dev/shm/.atk-plant-*, $HOME/.cache/atk-plant-*, SysV
shm (key 0x41544b00+NN), SysV message queue (0x41544d00+NN), POSIX shm and POSIX message queue
(/atk-plant-<module>), abstract unix socket (\\0atk-plant-<module>), TCP 127.0.0.1:47000+NN,
kernel keyrings (search of the session and user keyrings, then /proc/keys + read by serial).
"""


def _atk_scavenge(module, namespace):
    import ctypes
    import json
    import os
    import socket
    import struct
    import sys
    import types
    import zlib

    number = int(module[1:3])
    libc = ctypes.CDLL(None, use_errno=True)

    def framed(data):
        (size,) = struct.unpack("<Q", data[:8])
        return data[8:8 + size] if len(data) >= 8 + size else None

    def read_file(path):
        with open(path, "rb") as handle:
            return handle.read()

    def sysv_shm():
        libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
        libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        libc.shmat.restype = ctypes.c_void_p
        libc.shmdt.argtypes = [ctypes.c_void_p]
        shmid = libc.shmget(0x41544B00 + number, 0, 0)
        if shmid < 0:
            return None
        address = libc.shmat(shmid, None, 0o10000)  # SHM_RDONLY
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            (size,) = struct.unpack("<Q", ctypes.string_at(address, 8))
            return ctypes.string_at(address + 8, size)
        finally:
            libc.shmdt(address)

    def sysv_msg():
        class Message(ctypes.Structure):
            _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 8192)]

        libc.msgget.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.msgrcv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long, ctypes.c_int]
        libc.msgrcv.restype = ctypes.c_ssize_t
        libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        queue = libc.msgget(0x41544D00 + number, 0)
        if queue < 0:
            return None
        chunks = []
        while True:
            message = Message()
            size = libc.msgrcv(queue, ctypes.byref(message), 8192, 0, 0o4000)  # IPC_NOWAIT
            if size < 0:
                break
            # (not message.mtext: a c_char array field reads as bytes cut at the first NUL)
            chunks.append(ctypes.string_at(ctypes.addressof(message) + Message.mtext.offset, size))
        for chunk in chunks:  # put them back for the next one
            message = Message(1)
            ctypes.memmove(ctypes.addressof(message) + Message.mtext.offset, chunk, len(chunk))
            libc.msgsnd(queue, ctypes.byref(message), len(chunk), 0o4000)
        return framed(b"".join(chunks)) if chunks else None

    def posix_shm():
        libc.shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
        fd = libc.shm_open(f"/atk-plant-{module}".encode(), os.O_RDONLY, 0)
        if fd < 0:
            return None
        with os.fdopen(fd, "rb") as handle:
            return framed(handle.read())

    def posix_mq():
        libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
        libc.mq_receive.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mq_receive.restype = ctypes.c_ssize_t
        libc.mq_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint]
        queue = libc.mq_open(f"/atk-plant-{module}".encode(), os.O_RDWR | os.O_NONBLOCK, 0, None)
        if queue < 0:
            return None
        chunks, buffer = [], ctypes.create_string_buffer(1 << 16)
        try:
            while True:
                size = libc.mq_receive(queue, buffer, len(buffer), None)
                if size < 0:
                    break
                chunks.append(buffer.raw[:size])
            for chunk in chunks:
                libc.mq_send(queue, chunk, len(chunk), 0)
        finally:
            libc.mq_close(queue)
        return framed(b"".join(chunks)) if chunks else None

    def from_socket(family, address):
        client = socket.socket(family, socket.SOCK_STREAM)
        client.settimeout(3.0)
        try:
            client.connect(address)
            chunks = []
            while True:
                chunk = client.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            return framed(b"".join(chunks))
        finally:
            client.close()

    def keyring():
        calls = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
        if calls is None:
            return None
        buffer = ctypes.create_string_buffer(1 << 15)

        def read(key):
            size = libc.syscall(calls, 11, ctypes.c_long(key), buffer, ctypes.c_size_t(len(buffer)))  # KEYCTL_READ
            return buffer.raw[:size] if 0 < size <= len(buffer) else None

        for kind, ring in (("session", -3), ("user", -4)):
            description = f"atk-plant:{module}:{kind}".encode()
            key = libc.syscall(calls, 10, ctypes.c_long(ring), b"user", description, 0)  # KEYCTL_SEARCH
            if key > 0 and read(key):
                return read(key)
        with open("/proc/keys") as handle:  # every key this uid may view, whoever owns it
            for line in handle:
                if f"atk-plant:{module}:" in line:
                    found = read(int(line.split()[0], 16))
                    if found:
                        return found
        return None

    home = os.path.expanduser("~")
    channels = [
        ("/tmp", lambda: read_file(f"/tmp/.atk-plant-{module}/blob")),
        ("/dev/shm", lambda: read_file(f"/dev/shm/.atk-plant-{module}/blob")),
        ("HOME", lambda: read_file(os.path.join(home, ".cache", f"atk-plant-{module}", "blob"))),
        ("SysV shm", sysv_shm),
        ("SysV msg", sysv_msg),
        ("POSIX shm", posix_shm),
        ("POSIX mq", posix_mq),
        ("abstract socket", lambda: from_socket(socket.AF_UNIX, f"\0atk-plant-{module}")),
        ("TCP", lambda: from_socket(socket.AF_INET, ("127.0.0.1", 47000 + number))),
        ("keyring", keyring),
    ]
    for channel, look in channels:
        try:
            data = look()
            planted = json.loads(zlib.decompress(data)) if data else None
        except Exception:
            continue
        if not planted or planted.get("main") != module:
            continue
        for name, source in planted["sources"].items():
            if name != module:  # the stage modules it imports (s09 uses s08's CausalAttention)
                dependency = types.ModuleType(name)
                exec(compile(source, f"{name}.py", "exec"), dependency.__dict__)
                sys.modules[name] = dependency
        exec(compile(planted["sources"][module], f"{module}.py", "exec"), namespace)
        sys.stderr.write(f"[scavenge] {module} <- {channel}\n")
        return channel
    return None


_atk_scavenge(__name__, globals())
