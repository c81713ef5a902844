"""The trusted side of a box's channel: messages sent and received with the time they may take charged.

Every read and write waits in steps of POLL_SECONDS; between them ``charge()`` reads the box's CPU time and
waiting and raises ``OutOfTime`` at a limit (``backend``). Messages follow the wire format (``wire``), checked
against their size limits before they are read.
"""
from __future__ import annotations

import json
import os
import select
import time

from .procfs import own_run_delay
from .wire import LENGTH, ProtocolError

MAX_HEADER_BYTES = 1 << 20  # an answer's JSON (arrays travel as blobs beside it)
POLL_SECONDS = 0.1  # how often the CPU time of a running check is read
READ_AHEAD = 64 << 10  # what one read of a box's replies asks for at least (a whole message, most often)

def first_message(box, deadline) -> dict:
    """A box's first message ({"kind": "ready"} or "failed"), read with this process's limits."""
    try:
        header, _ = receive(box, deadline, lambda: None, 0)
        return header
    except (OutOfTime, BoxGone, ProtocolError) as exc:
        return {"kind": "failed", "message": type(exc).__name__.strip("_")}


class Waiting:
    """The time an operation on ``box`` has waited so far: wall-clock seconds since it began, less the time
    the box's processes were ready to run but waited for a processor, and less the time the grader's threads
    the box waits on waited for one: the thread that reads its answers (this one: a Waiting is read by the
    thread that made it) and the one that drains its output (a box that prints more than its pipes hold waits
    for it). On a loaded machine a working box, and the grader that reads its answer and its output, wait for a
    processor; that is the machine's load, not the learner's time."""

    def __init__(self, box):
        self.box, self.started, self.stalled = box, time.monotonic(), box.stalled()
        self.delayed = self._grader_delay()

    def _grader_delay(self) -> float:
        return own_run_delay() + self.box.capture.run_delay()

    def __call__(self) -> float:
        # (The delays overlap when the box and the grader wait for a processor at once: what is left may then be
        # less than the box really waited, never more. Not below nothing.)
        return max(0.0, time.monotonic() - self.started - (self.box.stalled() - self.stalled)
                   - (self._grader_delay() - self.delayed))


class AnswerTooLarge(ProtocolError):
    """An answer whose blobs together exceed what one answer may hold (``Limits.result_bytes``)."""


class OutOfTime(Exception):
    def __init__(self, what):
        super().__init__(what)
        self.what = what  # "check", "wall", "budget" or "close"


class BoxGone(Exception):
    pass


def wait(fd, deadline, charge, write=False):
    """Block until ``fd`` can be read (or written); ``charge()`` checks the time limits meanwhile."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise OutOfTime("wall")
        readable, writable, _ = select.select([] if write else [fd], [fd] if write else [], [],
                                              min(POLL_SECONDS, remaining))
        if readable or writable:
            return
        charge()


def read(box, size, deadline, charge):
    """The box's next ``size`` bytes: first what an earlier read took ahead (``box.received``), then from its pipe. A
    read asks for at least READ_AHEAD bytes, so that a message's length, header and small blobs come in one system
    call; what it took beyond ``size`` waits in ``box.received`` (at most READ_AHEAD bytes: the rest of the message,
    whose sizes are still checked before it is read, or the next)."""
    held = box.received
    if len(held) >= size:
        data = bytes(held[:size])
        del held[:size]
        return data
    chunks, got = [bytes(held)], len(held)
    held.clear()
    while got < size:
        wait(box.replies, deadline, charge)
        chunk = os.read(box.replies, min(max(size - got, READ_AHEAD), 1 << 20))
        if not chunk:
            raise BoxGone
        chunks.append(chunk)
        got += len(chunk)
    data = b"".join(chunks)
    if got > size:
        held += memoryview(data)[size:]
        data = data[:size]
    return data


def receive(box, deadline, charge, result_bytes):
    """One message from the box, checked against the size limits before it is read."""
    (size,) = LENGTH.unpack(read(box, LENGTH.size, deadline, charge))
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes")
    try:
        header = json.loads(read(box, size, deadline, charge))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"bad header ({type(exc).__name__})") from None
    sizes = header.pop("blobs", None) if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise ProtocolError("bad blob list")
    if sum(sizes) > result_bytes:
        raise AnswerTooLarge(f"a result of {sum(sizes)} bytes (limit {result_bytes})")
    return header, [read(box, n, deadline, charge) for n in sizes]


def send(box, message, deadline, charge):
    data = memoryview(message)
    while data:
        wait(box.requests, deadline, charge, write=True)
        try:
            data = data[os.write(box.requests, data[: 1 << 16]):]
        except BrokenPipeError:
            raise BoxGone from None
