"""Fork up to 300 children that sleep for two minutes, at import."""
import os as _os
import time as _time

for _ in range(300):
    try:
        _pid = _os.fork()
    except OSError:
        break
    if _pid == 0:
        _time.sleep(120)
        _os._exit(0)
