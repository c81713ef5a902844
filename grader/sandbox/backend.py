"""``IsolatedBackend``: the suite's backend (``adapters.LocalBackend``'s interface) with the learner's code in a box.

``IsolatedBackend(root)`` answers ``run(op, module, **kwargs)`` with the same plain values as the suite's
LocalBackend, but the learner's modules are imported and run in a *box* (``template``), a confined tree of
processes that serves this one submission and is killed with it. This (trusted) process never imports learner
code. What comes back is plain data (numbers, strings, numeric/bool NumPy arrays, lists/tuples/dicts of
those), sent as JSON plus raw blobs without pickle and checked here (``wire``). Every conclusion is drawn in
this process: no box is ever used for a second submission, or again after anything went wrong in it
(time-out, crash, a message that does not parse). A stage that builds on another meets the other's reference
through proxies whose calls this process passes to the submission's reference process (``reference``): no box
holds any reference code.
"""
from __future__ import annotations

import os
import secrets
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from suite_runtime.stage_names import is_stage_module

from ..kit import SOLUTIONS, assignment_of
from ..submission import sources
from . import redaction
from .channel import AnswerTooLarge, BoxGone, OutOfTime, Waiting, receive, send
from .confinement import Confinement, SandboxUnavailable
from .limits import LOAD_FACTOR, WALL_FACTOR, Limit, Limits
from .reference import ReferenceServer, reference_imports
from .template import Box, Sandbox
from .wire import MESSAGE_CHARS, ProtocolError, clip, decode, encode, pack

CLOSE_SECONDS = 2.0  # CPU time a worker may take to close its stage before its box is replaced
ERROR_CHARS = 1000  # of a reference's error message, passed on to the box
DENIED_NOTE = ("\n(When graded, learner code may not run programs, start processes, write or create files, or open "
               "sockets: keep the stage's work in torch, in memory.)")

class IsolatedBackend:
    """Like ``adapters.LocalBackend``, but the learner's code runs in boxes (see the module docstring).

    One backend per submission: its modules are read once, here. ``sandbox``: the template to
    take boxes from (None: a template of its own, stopped by ``close()``). The test harness calls
    ``start_check()`` at the start of each test; without it, every operation is a check of its
    own. ``last_output`` holds what the learner printed during the most recent operation.

    A stage that builds on others (stage 9's wrapper imports stage 8's ``CausalAttention``) is run
    with the reference versions of those (``provided``: stage -> {module: source},
    ``reference_imports``; default: those of the kit's solutions/), so that a mistake costs points
    on its own stage only. Those run in the submission's reference process (``reference``), never in
    a box: the box holds proxies of them, whose calls are answered only while a stage that builds on
    them is graded. Without solutions/ (a release has none), nothing is provided. ``passed``: whether every
    check of a stage passed in this submission (the grading plugin's verdicts): a stage built on one that passed
    meets the learner's own module of it instead (no proxy, no reference process), as a student's pytest does.

    A stage may come with a memory ceiling (``ceilings``: stage -> bytes, what its test module declares
    as ``MEMORY_HEADROOM``): its worker's address space is then held by the kernel (RLIMIT_AS) to what it
    was when the stage started plus that much, before the learner's module is imported. Code inside the
    learner's process can hide what it allocates from any measurement taken there, not from that.
    """

    def __init__(self, root, limits: Limits | None = None, *, sandbox: Sandbox | None = None, confine=None,
                 provided: dict[str, dict[str, str]] | None = None, ceilings: dict[str, int] | None = None,
                 passed: Callable[[str], bool] | None = None):
        self.root = Path(root).resolve()
        self.limits = limits or Limits()
        self.sources = sources(self.root)
        self.provided = reference_imports(SOLUTIONS) if provided is None else provided
        self.ceilings = dict(ceilings or {})
        self.passed = passed
        self.sandbox = sandbox or Sandbox(confine=confine)
        self._own_sandbox = sandbox is None
        from suite_runtime import (
            adapters,  # (torch: imported where a backend is made, not where the sandbox is merely named)
        )

        self.adapters = adapters
        self.stats = {"boxes": 0, "workers": 0, "stages": 0, "leaving": {}, "dropped_output": {},
                      "cpu_seconds": 0.0, "wall_seconds": 0.0}
        self.last_output = {"stdout": "", "stderr": ""}
        self._box: Box | None = None
        self._module = None  # the stage module the box's current worker serves
        self._token = None  # names the current stage's requests and replies
        self._worker = None  # the token the current worker was forked for (None: no worker)
        self._reference: ReferenceServer | None = None  # the reference process, once a stage needed it
        self._cpu_before = 0.0  # CPU time of this submission's earlier boxes and reference processes
        self._wall = 0.0  # wall time of this submission's operations so far
        self._check_cpu = 0.0  # CPU time used when the current check started
        self._check_wall = 0.0  # wall time of the current check's operations so far
        self._checks_from_caller = False
        self._exhausted = False
        self._own = None  # fingerprints of the submission's own modules (``redaction``), made when first needed
        # Whose release the student has (what needs no hiding): the assignment of the submission's modules.
        self._assignment = next((assignment_of(Path(name).stem) for name in self.sources), None)
        self._lock = threading.Lock()
        self.infrastructure: SandboxUnavailable | None = None  # the sandbox's first failure under an operation

    @property
    def mode(self):
        return self.sandbox.mode

    @property
    def confinement(self) -> Confinement | None:
        return self.sandbox.confinement

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            self._end_box()
            self._end_reference()
            if self._own_sandbox:
                self.sandbox.close()

    # -- time

    def cpu_used(self) -> float:
        """CPU seconds the learner's code has used so far, over every box of this submission, with what the
        reference process computed for it."""
        current = self._box.cpu() if self._box is not None else None
        served = self._reference.cpu() if self._reference is not None else 0.0
        return self._cpu_before + (current or 0.0) + served

    def start_check(self):
        """A check (one test) begins: its time limit counts from here."""
        self._checks_from_caller = True
        with self._lock:
            self._begin_check()

    def _begin_check(self):
        self._check_cpu, self._check_wall = self.cpu_used(), 0.0
        if self._check_cpu >= self.limits.budget or self._wall >= self.limits.budget_wall:
            self._exhausted = True

    def _charger(self, waited: Waiting, closing=False):
        """The function that ends an operation once a time limit is reached (``waited``: its waiting
        so far): the check's own limits and the submission's budget; ``closing`` (a stage's end, no
        check's time): the budget, CLOSE_SECONDS of CPU time and WALL_FACTOR times that of waiting."""
        limits, cpu_at_start = self.limits, self.cpu_used() if closing else self._check_cpu

        def charge():
            wall = waited()
            cpu = self.cpu_used()
            if cpu >= limits.budget or self._wall + wall >= limits.budget_wall:
                raise OutOfTime("budget")
            if closing:
                if cpu - cpu_at_start >= CLOSE_SECONDS or wall >= WALL_FACTOR * CLOSE_SECONDS:
                    raise OutOfTime("close")
            elif cpu - cpu_at_start >= limits.check_seconds:
                raise OutOfTime("check")
            elif self._check_wall + wall >= limits.check_wall:
                raise OutOfTime("wall")

        return charge

    def _time_message(self, module, what):
        limits = self.limits
        if what == "budget":
            return (f"{module}: the time budget of this submission ran out ({limits.budget:g} s of CPU time, or "
                    f"{limits.budget_wall:g} s of waiting, for all its checks together); this check and the "
                    "remaining ones were not run")
        if what == "wall":
            return (f"{module}: time limit of {limits.check_wall:g} s (wall clock, waiting) exceeded while the code "
                    "was waiting or sleeping (time.sleep, input(), a lock?)")
        return (f"{module}: time limit of {limits.check_seconds:g} s of CPU time for one check exceeded — an "
                "infinite loop? (or very slow code: keep the work in vectorized torch operations)")

    # -- the interface

    def run(self, op, module, **kwargs):
        try:
            return self._run(op, module, **kwargs)
        except SandboxUnavailable as exc:
            # Kept, so that the grader sees the sandbox's failure even where the suite catches the error (a check
            # that expects the learner's code to raise, a diagnosis that tries what the code does).
            self.infrastructure = self.infrastructure or exc
            raise

    def _run(self, op, module, **kwargs):
        if op not in self.adapters.OPS:
            raise KeyError(op)
        if not is_stage_module(module):
            raise ValueError(f"{module!r} is not a stage module name (sNN_topic)")
        blobs = []
        value = encode(kwargs, blobs)
        with self._lock:
            if not self._checks_from_caller:
                self._begin_check()
            if self._exhausted:
                raise self._error(self._time_message(module, "budget"), "budget")
            box = waited = None
            try:
                if self._box is None or self._module != module:
                    before = self.cpu_used()
                    box = self._ready_box(module)
                    # Start-up and the end of the last stage are no check's time (only the budget's).
                    self._check_cpu += self.cpu_used() - before
                else:
                    box = self._box
                box.capture.reset()
                waited = Waiting(box)
                charge = self._charger(waited)
                deadline = waited.started + LOAD_FACTOR * self.limits.check_wall + 1
                token = secrets.token_hex(8)  # this operation's: a reply sent ahead answers nothing
                send(box, pack({"cmd": "op", "op": op, "kwargs": value, "token": token}, blobs), deadline, charge)
                while True:
                    header, values = receive(box, deadline, charge, self.limits.result_bytes)
                    if header.get("kind") == "reference":  # a proxy's call, while the stage runs
                        self._pass_on(box, module, header, values, deadline, charge)
                    elif header.get("token") == token or self._worker_ended(header):
                        break  # anything else is left over from an earlier worker
                if header.get("kind") == "result":
                    return self._said_in(decode(header.get("value"), values))
                failure = self._failure(module, header)  # the learner's code raised: the box serves on
            except OutOfTime as exc:
                self._end_box()
                if exc.what == "budget":
                    self._exhausted = True
                limit = "budget" if exc.what == "budget" else "time"  # (a check's CPU time or waiting: its time limit)
                raise self._error(self._time_message(module, exc.what), limit) from None
            except BoxGone:
                self._end_box()
                raise box_gone(module) from None
            except ProtocolError as exc:
                self._end_box()
                raise self._error(f"{module}: the answer could not be read: {exc}",
                                  "output" if isinstance(exc, AnswerTooLarge) else None) from None
            except BaseException:
                self._end_box()  # e.g. interrupted: the box is in an unknown state
                raise
            finally:
                if waited is not None:
                    elapsed = waited()
                    self._wall += elapsed
                    self._check_wall += elapsed
                    self.stats["wall_seconds"] = round(self._wall, 3)
                if box is not None:
                    self._collect_output(box, module)
        raise failure

    def _collect_output(self, box, module):
        self.last_output = {name: box.capture.text(name) for name in ("stdout", "stderr")}
        dropped = box.capture.dropped_bytes()
        if dropped:
            self.sandbox.dropped_output += dropped  # the output cap was hit (the verdict itself does not change)
            counts = self.stats["dropped_output"]
            counts[module] = counts.get(module, 0) + dropped
            box.capture.reset()

    def _error(self, message: str, limit: Limit | None = None):
        """The suite's SubmissionError with ``message``, and in its ``limit`` the sandbox limit the operation ran
        into (grader.sandbox.limits.Limit; None: none): what the check's verdict records, said where it happens."""
        error = self.adapters.SubmissionError(message)
        error.limit = limit
        return error

    def _failure(self, module, header):
        """The SubmissionError for a reply that is not a result."""
        kind = header.get("kind")
        if kind == "submission_error":  # (the adapter's word in the box: an import that failed, a name missing)
            message = self._said(header.get("message"))
            return self._error(message + (DENIED_NOTE if "Operation not permitted" in message else ""))
        if kind == "exception":
            what = f"{self._said(header.get('type'), 200)}: {self._said(header.get('message'))}"
            if header.get("type") == "PermissionError" or "Operation not permitted" in str(header.get("message")):
                what += DENIED_NOTE
            if header.get("memory") and module in self.ceilings:
                what = (f"{module}: out of memory: when graded, this stage may allocate "
                        f"{self.ceilings[module] / 2**20:g} MiB beyond what its process held when the stage "
                        f"started ({what})")
            elif header.get("memory"):
                what = f"{module}: memory limit of {self.limits.memory_bytes / 2**30:g} GiB exceeded ({what})"
            trace = self._said(header.get("traceback") or "")
            return self._error(what + (f"\nwhere (most recent call last):\n{trace.rstrip()}" if trace else ""),
                               "memory" if header.get("memory") else None)
        if kind == "ended":
            self._module = self._token = self._worker = None  # the worker is gone; the next call starts another
            return self._error(*self._describe_end(module, header.get("status")))
        return self._error(f"{module}: unexpected answer {kind!r} from the sandbox")

    def _said(self, text, limit=MESSAGE_CHARS) -> str:
        """A text from the box, as a student may read it: cut to ``limit`` characters, and without any stretch
        that quotes hidden material (``redaction``: a stage built on another holds the other's reference)."""
        text = clip(text, limit)
        if len(text) < redaction.WINDOW:
            return text
        if self._own is None:
            self._own = redaction.fingerprints(self.sources)
        return redaction.kit_redactor(self._assignment).clean(text, self._own)

    def _said_in(self, value):
        """A result from the box with every string in it passed through ``_said`` (what checks may print)."""
        if isinstance(value, str):
            return self._said(value, len(value))
        if isinstance(value, dict):
            return {self._said_in(k): self._said_in(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(map(self._said_in, value))
        return value

    def _describe_end(self, module, status) -> tuple[str, Limit | None]:
        """What a worker's end says (its status, the box's word: checked), and the limit it counts as."""
        if not (type(status) is int and 0 <= status < 1 << 16):
            return f"{module}: the child process ended before answering", None
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            hint = {
                "SIGSEGV": " (a crash in native code: ctypes, or torch used out of bounds?)",
                "SIGKILL": " (killed: out of memory?)",
                "SIGXFSZ": f" (a file larger than {self.limits.tmp_bytes >> 20} MiB was written)",
                "SIGABRT": " (an abort in native code)",
            }.get(name, "")
            text, limit = f"{module}: the child process died with signal {name}{hint}", "crash"
        else:
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
            text, limit = (f"{module}: the child process exited with code {code} before answering "
                           "(sys.exit/os._exit at import or in the function?)"), "exit"
        tail = self._said(self._box.capture.last_lines("stderr")) if self._box else ""
        return text + (f"\nits last output on stderr:\n{tail}" if tail else ""), limit

    # -- boxes and stages

    def _worker_ended(self, header):
        """Whether ``header`` says that the current worker has gone (crashed, exited)."""
        return header.get("kind") == "ended" and self._worker is not None and header.get("token") == self._worker

    def _ready_box(self, module) -> Box:
        """The box, with a worker serving ``module``: the current one, or a new box after a stage that
        would not end cleanly, a channel its worker jammed, or a box that did not take the stage (stopped,
        gone: the learner's doing, so no check fails for it, but the time counts against the budget). A new
        box that will not take its first request is the sandbox's failure, not the learner's: SandboxUnavailable."""
        if self._box is not None and self._module not in (None, module) and not self._close_stage():
            self._end_box()  # a worker that will not close its stage costs a new box, no more
        while True:
            if self._box is None:
                self._box = self.sandbox.spawn(self.sources, self.limits)
                self.stats["boxes"] += 1
            if self._module == module or self._open(module):
                return self._box
            fresh = self._box.fresh
            self._end_box()
            if fresh:
                raise SandboxUnavailable("a new box did not take its first stage before any learner code ran")

    def _close_stage(self) -> bool:
        """End the current stage: its worker then stays for the next ("parked") or leaves. False if
        the box misbehaved (no answer in time, garbage, gone)."""
        box, token = self._box, self._token
        waited = Waiting(box)
        charge = self._charger(waited, closing=True)
        try:
            deadline = waited.started + LOAD_FACTOR * WALL_FACTOR * CLOSE_SECONDS
            send(box, pack({"cmd": "close", "token": token}), deadline, charge)
            while True:
                header, _ = receive(box, deadline, charge, 0)
                kind = header.get("kind")
                if (header.get("token") == token and kind in ("parked", "leaving")) or self._worker_ended(header):
                    break
        except (OutOfTime, BoxGone, ProtocolError) as exc:
            if isinstance(exc, OutOfTime) and exc.what == "budget":
                self._exhausted = True
            return False
        finally:
            self._wall += waited()
        if kind != "parked":
            self._worker = None  # the box forks a fresh one for the next stage
        if kind == "leaving":
            self._count_leaving(header.get("changed"))
        self._module = self._token = None
        return True

    def _count_leaving(self, changed):
        """What made workers leave (for the kit's own measurements): the worker's word, so a few
        short names at most."""
        counts = self.stats["leaving"]
        for what in (changed if isinstance(changed, list) else [])[:5]:
            if isinstance(what, str) and len(what) <= 64 and (what in counts or len(counts) < 32):
                counts[what] = counts.get(what, 0) + 1

    def _open(self, module) -> bool:
        """Ask for a worker serving ``module``, with proxies of the stages it builds on (their descriptions, from
        the submission's reference process): the parked one takes it, or the box forks one, and the worker says
        so. The module's import is learner code: it runs on the first operation's time. False if the box did
        not take the request in time (a worker may have jammed the channel, the box may be stopped or gone);
        the wait counts against the budget."""
        token = secrets.token_hex(8)
        specs = self._specs(module)
        waited = Waiting(self._box)
        charge = self._charger(waited, closing=True)
        deadline = waited.started + LOAD_FACTOR * WALL_FACTOR * CLOSE_SECONDS
        try:
            # (a request this small, a few kB, waits for nothing but a pipe jammed on purpose)
            send(self._box, pack({"cmd": "open", "module": module, "token": token, "provided": specs,
                                   "memory_headroom": self.ceilings.get(module)}),
                 waited.started + CLOSE_SECONDS, charge)
            while True:  # a request written is not a request taken: the worker says it has it
                header, _ = receive(self._box, deadline, charge, self.limits.result_bytes)
                if header.get("token") == token:
                    if header.get("kind") != "opened":
                        return False  # (its worker ended before it could take the stage)
                    break
        except OutOfTime as exc:
            if exc.what == "budget":
                self._exhausted = True
                raise
            return False
        except (BoxGone, ProtocolError):
            return False
        finally:
            self._wall += waited()
        self._box.fresh = False
        self._token, self._module = token, module
        self.stats["stages"] += 1
        if self._worker is None:
            self._worker = token
            self.stats["workers"] += 1
        return True

    # -- the stages a stage builds on

    def _proxied(self, module) -> dict[str, str]:
        """The stages ``module`` builds on that its box gets proxies of (stage -> reference source): those whose own
        checks did not all pass (``passed``). A stage whose checks all passed is met as the learner's own module,
        already in the box: the same behaviour as far as its checks can tell, without a call to another process."""
        return {name: text for name, text in self.provided.get(module, {}).items()
                if self.passed is None or not self.passed(name)}

    def _specs(self, module) -> dict[str, dict]:
        """What the proxies of the stages ``module`` is given need (stage -> description), from the submission's
        reference process, started here (before the stage: its start-up is no check's time) on first need;
        {} for a stage given none."""
        proxied = self._proxied(module)
        return {name: self._server().specs[name] for name in proxied} if proxied else {}

    def _server(self) -> ReferenceServer:
        """The submission's reference process, started on first need with every reference its stages may ask for
        (those of the stages it holds: never another assignment's, whose references may need what this one's
        installation lacks, Triton for the kernels)."""
        if self._reference is None:
            held = {Path(name).stem for name in self.sources}
            sources = {name: text for stage, given in self.provided.items() if stage in held
                       for name, text in given.items()}
            self._reference = ReferenceServer(self.sandbox, sources, self.limits)
        return self._reference

    def _pass_on(self, box: Box, module, header, blobs, deadline, charge):
        """Answer a proxy's call (``header``, ``blobs``: what the box sent) with what the reference process
        computes, if the stage being graded builds on the stage it names; else with an error. A reference
        process that dies is replaced and the call tried once more; if it dies again, the call's inputs are the
        cause (the learner's code chose them): an error for the box. The process's time is the check's."""
        # Charged before each call: the channel charges only while it waits, and a box that calls a proxy in a loop
        # keeps it from waiting (every call answered within its poll), while its time and the reference's add up.
        charge()
        stage, call = header.get("stage"), header.get("call") if type(header.get("call")) is int else None
        answer, values = {"ok": False, "error": {"type": "PermissionError", "message": (
            f"{module} does not build on {stage}: no reference of it runs for this stage")}}, []
        if isinstance(stage, str) and stage in self._proxied(module):
            for _ in range(2):  # (once more on a fresh process, if it died)
                try:
                    answer, values = self._server().call(stage, header.get("request"), blobs, deadline, charge)
                    break
                except BoxGone:
                    self._end_reference()
                    answer = {"ok": False, "error": {"type": "RuntimeError", "message": (
                        f"the reference of {stage} could not run on these inputs (its process died)")}}
                except BaseException:
                    self._end_reference()  # (busy with a call nobody waits for any more)
                    raise
        error = answer.get("error") if isinstance(answer.get("error"), dict) else {}
        reply = {"kind": "reference_answer", "call": call, "ok": answer.get("ok") is True, "value": answer.get("value"),
                 "error": {"type": str(error.get("type", "RuntimeError"))[:40],
                           "message": self._said(error.get("message", ""), ERROR_CHARS)}}
        send(box, pack(reply, values), deadline, charge)

    def _end_reference(self):
        """Stop the submission's reference process, its CPU time kept."""
        server, self._reference = self._reference, None
        if server is not None:
            self._cpu_before += server.cpu()
            server.close()

    def _end_box(self):
        """Kill the current box (never used again) and count the CPU time it used."""
        box, self._box = self._box, None
        self._module = self._token = self._worker = None
        if box is None:
            return
        cpu = box.cpu()
        self.sandbox.kill(box)
        self._cpu_before += cpu or 0.0
        self.stats["cpu_seconds"] = round(self._cpu_before, 3)


def box_gone(module) -> SandboxUnavailable:
    """The error for a box whose channel closed under an operation: its first process is gone (a worker that dies is
    reported by it, "ended"), and with it the box; or the template, which every box dies with. Neither is the learner's
    code, which runs in the box's workers only: the grader's failure, so that the submission is graded again in a fresh
    box rather than scored (grader.grading.plugin)."""
    return SandboxUnavailable(f"the box grading {module} went away under an operation (its first process, or the "
                              "sandbox's template, died)")
