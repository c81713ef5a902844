"""A process that has imported nbgrader once and forks a child for each nbgrader command a test runs
(kit_tests/runs.py's ``nbgrader``): from ``NbGraderApp.launch_instance`` on, each child is ``python -m nbgrader
ARGS``, without importing nbgrader anew each time (2-3 s of CPU time per command).

One JSON request per line on stdin, {"args", "cwd", "env", "said": [stdout file, stderr file]}; one line back
on stdout, the command's exit status. The server ends when its stdin closes (the test process has ended).
"""
import atexit
import importlib.util
import json
import os
import sys
import traceback

import nbgrader.apps.nbgraderapp as app  # what `python -m nbgrader` imports first, and most of its time

ENTRY = importlib.util.find_spec("nbgrader.__main__").origin


def command(request) -> int:
    """In the child: what ``python -m nbgrader ARGS`` does once Python has started in ``cwd`` with ``env``."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path.insert(0, request["cwd"])  # (python -m puts the working folder first)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in zip((1, 2), request["said"]):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.argv = [ENTRY, *request["args"]]
    status = 0
    try:
        app.main()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # as the interpreter does at its end (logging's flush among them)
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def main():
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            status = 1  # (whatever command() raised past its own handlers)
            try:
                status = command(request)
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")


if __name__ == "__main__":
    main()
