"""[attnkit-tamper] plant_sysv_shm -- family (c), persistence channel: SysV shared memory.

Append to a correct stage module (attacker: the solution of stage k, here s04). At import it
creates a SysV shared-memory segment (``shmget`` through ctypes) with key 0x41544b00 + NN (NN:
the stage number), mode 0666, and copies into it an 8-byte length and this module's source
(payload cut off, plus the stage modules it imports, zlib). Nobody removes it (no IPC_RMID): it
lives as long as the IPC namespace. ``scavenge.py`` attaches it read-only and execs it.

Old design: the IPC namespace is the warm zygote's, shared by every submission it grades, and the
reset does not touch SysV objects: expected to leak.

Needs the prelude plant_common before it (kit_tests/tamper.py, PRELUDES), for _atk_framed_source and
_atk_quietly.
"""


def _atk_plant_sysv_shm(module, path):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmat.restype = ctypes.c_void_p
    libc.shmdt.argtypes = [ctypes.c_void_p]
    ipc_creat, ipc_excl = 0o1000, 0o2000
    data = _atk_framed_source(module, path)
    shmid = libc.shmget(0x41544B00 + int(module[1:3]), len(data), ipc_creat | ipc_excl | 0o666)
    if shmid < 0:
        return  # exists already (planted earlier) or not allowed
    address = libc.shmat(shmid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return
    ctypes.memmove(address, data, len(data))
    libc.shmdt(address)


_atk_quietly(_atk_plant_sysv_shm, __name__, __file__)
