"""Jam the sandbox's request pipe at the end of this stage, so that the next request cannot be sent.

When the grader's "close" for this stage is the next request, the worker leaves it in the pipe
(it peeks with tee(2)), shrinks the pipe to one page (F_SETPIPE_SZ works on the read end), answers
"leaving" for the stage's token itself and sleeps. The grader's "open" for the next stage then
cannot be written. The grader must take that for the learner's doing (a new box for the next
stage), not for a broken sandbox that leaves the submission without a record.
"""
import ctypes as _ctypes
import fcntl as _fcntl
import json as _json
import os as _os
import select as _select
import sys as _sys
import time as _time

_F_SETPIPE_SZ = 1031


def _peek(fd):
    """The header of the next request on ``fd``, without taking it out of the pipe."""
    libc = _ctypes.CDLL(None, use_errno=True)
    read, write = _os.pipe()
    try:
        while True:
            _select.select([fd], [], [])
            count = libc.tee(fd, write, 65536, 2)  # SPLICE_F_NONBLOCK
            if count > 8:
                data = _os.read(read, count)
                size = int.from_bytes(data[:8], "little")
                if len(data) >= 8 + size:
                    return _json.loads(data[8:8 + size])
            elif count > 0:
                _os.read(read, count)
            _time.sleep(0.01)
    finally:
        _os.close(read)
        _os.close(write)


def _jam_on_close():
    serving = _sys.modules.get("__main__")
    requests = getattr(serving, "REQUESTS", None)
    if requests is None or not hasattr(serving, "read_message"):
        return  # not in a sandbox's worker
    original = serving.read_message

    def read_message(fd):
        if fd == requests:
            header = _peek(fd)
            if header.get("cmd") == "close":
                _fcntl.fcntl(fd, _F_SETPIPE_SZ, 4096)
                serving.write_message(serving.REPLIES, {"kind": "leaving", "token": header.get("token"), "changed": []})
                while True:
                    _time.sleep(3600)
        return original(fd)

    serving.read_message = read_message


_jam_on_close()
