"""[attnkit-tamper] plant_sysv_msg -- family (c), persistence channel: a SysV message queue.

Append to a correct stage module (attacker: the solution of stage k, here s05). At import it
creates a SysV message queue (``msgget``, key 0x41544D00 + NN, mode 0666) and sends this module's
source (payload cut off, plus the stage modules it imports; zlib, an 8-byte length first) as
messages of at most 4000 bytes. ``scavenge.py`` receives them without waiting, puts them back
(for the next scavenger) and execs the source.

Old design: the warm zygote's IPC namespace outlives each submission and the reset ignores SysV
objects: expected to leak.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_framed_source and
_atk_quietly.
"""


def _atk_plant_sysv_msg(module, path):
    import ctypes

    class Message(ctypes.Structure):
        _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 4000)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.msgget.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.msgsnd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ipc_creat, ipc_excl, ipc_nowait = 0o1000, 0o2000, 0o4000
    queue = libc.msgget(0x41544D00 + int(module[1:3]), ipc_creat | ipc_excl | 0o666)
    if queue < 0:
        return
    data = _atk_framed_source(module, path)
    for start in range(0, len(data), 4000):
        chunk = data[start:start + 4000]
        message = Message(1)
        ctypes.memmove(ctypes.addressof(message) + Message.mtext.offset, chunk, len(chunk))  # (NULs too)
        libc.msgsnd(queue, ctypes.byref(message), len(chunk), ipc_nowait)


_atk_quietly(_atk_plant_sysv_msg, __name__, __file__)
