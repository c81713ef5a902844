"""[attnkit-tamper] thread_bomb -- family (d), threads without end.

Append to a stub. At import, start sleeping threads until the system refuses one (the box's process and
thread limit), then carry on. Expected: the box stays usable, the stub gets its 0 points, the run goes on.
"""


def _atk_threads():
    import threading
    import time

    for _ in range(10_000):
        try:
            threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        except (RuntimeError, OSError):
            break


_atk_threads()
