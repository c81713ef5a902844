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

Needs the preludes daemon_common (_atk_serve_bytes, the daemon) and plant_common
(_atk_framed_source, _atk_quietly) before it (kit_tests/tamper.py, PRELUDES).
"""


def _atk_plant_abstract_socket(module, path):
    import socket

    data = _atk_framed_source(module, path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(f"\0atk-plant-{module}")
    except OSError:
        server.close()
        return  # already served
    server.listen(16)
    _atk_serve_bytes(server, data)


_atk_quietly(_atk_plant_abstract_socket, __name__, __file__)
