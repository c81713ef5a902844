"""[attnkit-tamper] plant_posix_shm -- family (c), persistence channel: POSIX shared memory.

Append to a correct stage module (attacker: the solution of stage k, here s06). At import it
creates the POSIX shared-memory object /atk-plant-<module> (``shm_open`` through ctypes, not
multiprocessing.shared_memory, whose resource tracker would unlink it at exit), mode 0666, holding
an 8-byte length and this module's source (payload cut off, plus the stage modules it imports,
zlib). ``scavenge.py`` opens it read-only and execs it.

Old design: POSIX shm objects are files of /dev/shm, and the reset deletes /dev/shm's entries (an
object cannot live in a read-only sub-folder): expected NOT to leak. Kept because a new design
must not share /dev/shm between submissions either.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_framed_source and
_atk_quietly.
"""


def _atk_plant_posix_shm(module, path):
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
    data = _atk_framed_source(module, path)
    fd = libc.shm_open(f"/atk-plant-{module}".encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    if fd < 0:
        return
    try:
        os.fchmod(fd, 0o666)  # (the umask trimmed it)
        os.write(fd, data)
    finally:
        os.close(fd)


_atk_quietly(_atk_plant_posix_shm, __name__, __file__)
