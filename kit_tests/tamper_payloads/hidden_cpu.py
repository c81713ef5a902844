"""Spend CPU time where /proc does not show it: children that the kernel reaps by itself.

With SIGCHLD ignored, an exiting child is reaped at once and its CPU time is added to nobody's
(not to its parent's children-time either), so a grader that sums what /proc shows of a box's
processes never sees it. Six seconds of such work at import, in two children at a time: the
grader must count it against the check's time limit (a cgroup counts every process that ran).
"""
import os as _os
import signal as _signal
import time as _time


def _burn_hidden(total, slice_seconds=0.25, parallel=2):
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    done = 0.0
    while done < total:
        for _ in range(parallel):
            if _os.fork() == 0:
                end = _time.process_time() + slice_seconds
                while _time.process_time() < end:
                    pass
                _os._exit(0)
        _time.sleep(slice_seconds * 1.2)  # (no wait(): there is nothing to wait for)
        done += slice_seconds * parallel
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)


_burn_hidden(6.0)
