"""Failures of the grader's own machinery, made on purpose: the kit's fault-injection tests prove with them that no
failure of the grader is ever a grade, on any path (kit_tests/grading/test_grader_faults.py).

``ATTNKIT_INJECT_FAULT=KIND@N`` (in the environment of ``attnkit grade``, of nbgrader's autograde or of
``run_autograder``) makes every grading worker fail at the N-th check of each submission it grades (from 1: the checks
before it have run and passed), the way KIND fails for real:

    start      the sandbox cannot start (as when its template cannot import the Python installation): before any check
    template   the sandbox's template process is killed (SIGKILL), and every box with it
    box        the first process of the submission's box is killed (SIGKILL); the template lives on
    worker     the grading worker process dies (os._exit)
    reference  the reference solutions fail in the trusted process (the check's ``reference`` raises; at the first
               check from the N-th on that asks for it)

``KIND@N@PATH``: only once, in the first worker that creates the file PATH (so a retry in a fresh worker meets no
fault). Nothing reads this but the grading worker; the boxes' environment is the sandbox's own.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..sandbox.confinement import SandboxUnavailable
from ..sandbox.procfs import children

VARIABLE = "ATTNKIT_INJECT_FAULT"
KINDS = ("start", "template", "box", "worker", "reference")
TEMPLATE_SCRIPT = "child.py"  # what the sandbox's template runs (grader/sandbox/template.py); its boxes are forks


@dataclass
class Fault:
    kind: str
    at: int  # the check of each submission at which it strikes (1: the first)
    once: str | None = None  # a file: strike only if this process is the first to create it
    seen: int = 0  # checks of the current submission so far

    def begin(self):
        """A new submission."""
        self.seen = 0

    def armed(self) -> bool:
        if self.once is None:
            return True
        try:
            os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        return True

    def at_start(self):
        """Before the worker says it is ready: the sandbox's start fails."""
        if self.kind == "start" and self.armed():
            raise SandboxUnavailable(f"injected fault ({VARIABLE}): the sandbox's template could not start")

    def at_check(self, item):
        """At the start of a check's call (its fixtures set up), the N-th check of the submission strikes."""
        self.seen += 1
        if self.seen < self.at or self.kind == "start":
            return
        if self.kind == "reference":
            if "reference" in item.funcargs and self.armed():
                item.funcargs["reference"] = FailingReference()
                self.kind = "spent"
            return
        if self.seen != self.at or not self.armed():
            return
        if self.kind == "worker":
            os._exit(70)
        templates = template_processes()
        for pid in templates if self.kind == "template" else [box for t in templates for box in children(t)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FailingReference:
    """The reference solutions as a broken installation gives them: every use raises."""

    def __getattr__(self, name):
        raise RuntimeError(f"injected fault ({VARIABLE}): the reference solutions failed")


def template_processes() -> list[int]:
    """The sandbox templates below this process: the topmost processes of its tree that run the template's script."""
    found, pending = [], children(os.getpid())
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(TEMPLATE_SCRIPT.encode()) for part in command):
            found.append(pid)  # (its boxes, forks of it, run the same script: not searched)
        else:
            pending += children(pid)
    return found


def from_environment() -> Fault | None:
    """The fault ``ATTNKIT_INJECT_FAULT`` asks for, if any (a value that names none is an error: a test that meant
    to inject a fault must not pass without one)."""
    spec = os.environ.get(VARIABLE)
    if not spec:
        return None
    kind, _, rest = spec.partition("@")
    at, _, once = rest.partition("@")
    if kind not in KINDS or not at.isdigit() or int(at) < 1:
        raise ValueError(f"{VARIABLE}={spec!r}: expected KIND@N or KIND@N@PATH, KIND one of {', '.join(KINDS)}")
    return Fault(kind, int(at), once or None)
