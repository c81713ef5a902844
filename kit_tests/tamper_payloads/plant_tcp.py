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

Needs the preludes daemon_common (_atk_serve_bytes, the daemon) and plant_common
(_atk_framed_source, _atk_quietly) before it (kit_tests/tamper.py, PRELUDES).
"""


def _atk_plant_tcp(module, path):
    import socket

    data = _atk_framed_source(module, path)
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
    _atk_serve_bytes(server, data)


_atk_quietly(_atk_plant_tcp, __name__, __file__)
