"""The trusted side of the reference process: what a stage builds on, run where learner code cannot read it.

Stage 9's wrapper imports stage 8's ``CausalAttention``. So that a mistake costs points on its own stage only, stage 9
is graded with the reference behaviour of stage 8, not the learner's module; and so that no box ever holds hidden
code, that reference runs in a process of its own (``ReferenceServer``: a box whose first process is
``reference_process``, with its own namespaces, uid and limits, one per submission), and stage 9's box holds proxies
of it (``reference_proxy``). The grader passes each proxy's call on, after checking that the graded stage builds on
the stage it names: while stage 8 itself is graded, or any stage that does not build on it, no call reaches it.
"""
from __future__ import annotations

import time
from pathlib import Path

from suite_runtime.stage_names import builds_on, module_files

from .channel import BoxGone, OutOfTime, receive, send
from .confinement import SandboxUnavailable
from .limits import Limits
from .template import Box, Sandbox
from .wire import ProtocolError, pack

LOAD_SECONDS = 30.0  # a reference process must have loaded its modules within this (not the learner's time)


def reference_imports(folder) -> dict[str, dict[str, str]]:
    """For each stage module of ``folder`` (the reference solutions), the sources of the stage modules
    it builds on: those it imports, and those they import in turn, each after the ones it imports
    (the order the reference process runs them in). A stage is never among its own. Nothing
    where there is no such folder (a student's release)."""
    if not Path(folder).is_dir():
        return {}
    texts = {path.stem: path.read_text() for path in module_files(folder)}

    def built_on(stage):
        order, seen = [], {stage}

        def visit(name):
            for other in builds_on(texts[name]):
                if other in texts and other not in seen:
                    seen.add(other)
                    visit(other)
                    order.append(other)

        visit(stage)
        return {name: texts[name] for name in order}

    return {stage: built_on(stage) for stage in texts}


class ReferenceServer:
    """One submission's reference process: started with the sources it runs (stage module -> text, in order),
    ``specs`` says what each module holds (for the proxies), ``call`` runs one proxy's request there. ``cpu()``:
    the CPU seconds it has computed for the submission (its start-up left out)."""

    def __init__(self, sandbox: Sandbox, sources: dict[str, str], limits: Limits):
        self.sandbox, self.sources, self.calls = sandbox, dict(sources), 0
        self.box: Box | None = sandbox.spawn({}, limits, role="reference")
        self.limits = limits
        try:
            deadline = time.monotonic() + LOAD_SECONDS
            send(self.box, pack({"cmd": "load", "modules": list(self.sources.items())}), deadline, lambda: None)
            header, _ = receive(self.box, deadline, lambda: None, 0)
        except (OutOfTime, BoxGone, ProtocolError) as exc:
            header = {"kind": "failed", "message": type(exc).__name__}
        if header.get("kind") != "loaded" or not isinstance(header.get("specs"), dict):
            tail = self.box.capture.last_lines("stderr", 5)
            self.close()
            raise SandboxUnavailable(f"the reference process could not load the reference modules: "
                                     f"{header.get('message', header.get('kind'))}" + (f" ({tail})" if tail else ""))
        self.specs: dict[str, dict] = header["specs"]
        self.started_cpu = self.box.cpu()

    def cpu(self) -> float:
        return max(0.0, self.box.cpu() - self.started_cpu) if self.box is not None else 0.0

    def call(self, stage: str, request, blobs: list[bytes], deadline: float, charge) -> tuple[dict, list[bytes]]:
        """Run a proxy's ``request`` (its value as the box encoded it, with ``blobs``) for ``stage``: the reference
        process's answer, {"ok", "value", "error"} with its blobs. Raises BoxGone if the process died, OutOfTime as
        ``charge`` does (the process is then busy with it: close it)."""
        self.calls += 1
        send(self.box, pack({"cmd": "call", "call": self.calls, "stage": stage, "request": request}, blobs),
             deadline, charge)
        while True:
            header, values = receive(self.box, deadline, charge, self.limits.result_bytes)
            if header.get("call") == self.calls:
                return header, values

    def close(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            self.sandbox.kill(box)
