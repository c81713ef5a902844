"""Spend CPU time where /proc does not show it: children that the kernel reaps by itself.

With SIGCHLD ignored, an exiting child is reaped at once and its CPU time is added to nobody's
(not to its parent's children-time either), so a grader that sums what /proc shows of a box's
processes never sees it. Six seconds of such work at import, in two children at a time: the
grader must count it against the check's time limit (a cgroup counts every process that ran).
Each pair of children is waited for through a pipe (there is no wait() for them), so all six
seconds are spent before the import returns, however loaded the machine is.
"""
import os as _os
import signal as _signal
import time as _time


def _burn_hidden(total, slice_seconds=0.25, parallel=2):
    _signal.signal(_signal.SIGCHLD, _signal.SIG_IGN)
    done = 0.0
    while done < total:
        done_r, done_w = _os.pipe()
        for _ in range(parallel):
            if _os.fork() == 0:
                _os.close(done_r)
                end = _time.process_time() + slice_seconds
                while _time.process_time() < end:
                    pass
                _os._exit(0)  # closes this child's end of the pipe
        _os.close(done_w)
        _os.read(done_r, 1)  # end of file once every child of the pair has exited
        _os.close(done_r)
        done += slice_seconds * parallel
    _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)


_burn_hidden(6.0)
