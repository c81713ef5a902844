"""[attnkit-tamper] daemon_common -- the prelude of the payloads that leave a daemon behind.

Not an attack by itself: it only defines functions and does nothing at import. kit_tests/tamper.py
(PRELUDES) appends it to a stage module before plant_abstract_socket, plant_tcp, hijack_frames,
hijack_gc and signal_ptrace_daemon, which call the functions below: each of them starts the same
kind of daemon, a process meant to outlive the worker that imported it.
"""


def _atk_harden():
    """Ignore the catchable signals a supervisor sends to stop a process, and block every blockable
    one (only SIGKILL and SIGSTOP still get through)."""
    import signal

    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGQUIT,
                   signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        try:
            signal.signal(number, signal.SIG_IGN)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP})


def _atk_daemon(serve):
    """Run ``serve()`` in a hardened daemon: fork, ``setsid`` (a session of its own: no terminal, out
    of the worker's process group), fork again (the grandchild is no session leader and its parent
    is gone, so nobody waits for it) and harden. The caller goes on once the first child is reaped (at once,
    where no process may be started)."""
    import os
    import sys

    sys.stdout.flush()  # (or the children would write the buffered output again)
    sys.stderr.flush()
    try:
        first = os.fork()
    except OSError:  # refused (graded code may start no process): the attack gives up quietly
        return
    if first == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                _atk_harden()
                serve()
        finally:
            os._exit(0)
    os.waitpid(first, 0)


def _atk_serve_bytes(server, data):
    """A daemon that hands ``data`` to every client of the listening socket ``server`` for 120 s;
    the caller's copy of the socket is closed (the daemon keeps its own)."""
    import time

    def serve():
        deadline = time.monotonic() + 120.0
        server.settimeout(1.0)
        while time.monotonic() < deadline:
            try:
                client, _ = server.accept()
            except OSError:
                continue
            try:
                client.sendall(data)
            except OSError:
                pass
            client.close()

    _atk_daemon(serve)
    server.close()


def _atk_take_over(serve, deadline):
    """Leave ``serve()`` running in a daemon and never return: the caller, hardened too, sleeps until
    ``deadline``, then exits. A hijacked worker must not go back to the sandbox's serving loop (it
    would read the requests meant for the daemon that answers in its place), and keeps the zygote
    waiting for it, so that the zygote neither reads the pipe nor kills the daemon."""
    import os
    import time

    _atk_daemon(serve)
    _atk_harden()
    while time.monotonic() < deadline:
        time.sleep(1.0)
    os._exit(0)
