"""Jam the sandbox's channel at the end of this stage, so that the next request is never taken.

When the grader's "close" for this stage comes, the worker tries to shrink the request pipe to one page
(F_SETPIPE_SZ on the read end: the learner's filter refuses it now), answers "leaving" for the stage's token
itself and sleeps instead of leaving: the box's first process waits for it, and the grader's "open" for the next
stage stays in the pipe, unread. The grader must take that for the learner's doing (a new box for the next stage,
once no worker says it took the request), not for a broken sandbox that leaves the submission without a record.
"""
import fcntl as _fcntl
import sys as _sys
import time as _time

_F_SETPIPE_SZ = 1031


def _jam_on_close():
    serving = next((m for m in list(_sys.modules.values()) if isinstance(getattr(m, "__dict__", None), dict)
                    and "Channel" in vars(m) and "REQUESTS" in vars(m)), None)
    if serving is None:
        return  # not in a sandbox's worker
    original = serving.Channel.next

    def next_request(channel):
        message = original(channel)
        if message is not None and message[0].get("cmd") == "close":
            try:
                _fcntl.fcntl(serving.REQUESTS, _F_SETPIPE_SZ, 4096)
            except OSError:
                pass
            channel.send({"kind": "leaving", "token": message[0].get("token"), "changed": []})
            while True:
                _time.sleep(3600)
        return message

    serving.Channel.next = next_request


_jam_on_close()
