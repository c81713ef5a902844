"""A box's worker: the only process that runs learner code. It loads the learner's filter, imports a stage's module
and answers the grader's operations on it.

Part of the confined side (``child``): standard library only at the top, copied into the box's runtime folder.

The box's first process (``box_process``) forks a worker for an "open" request. The worker says it took the request
("opened"), loads the learner's filter (``seccomp``), imports the learner's module of the stage beside proxies of the
stages it builds on (``reference_proxy``: their reference runs in the grader's reference process, never here) and
answers operations until "close". It then serves the next stage of the same submission only if the last left the
process as it found it (``process_state``); else it leaves and the box forks a fresh one.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import sys

if __package__:  # the trusted side (grader.sandbox.worker_process)
    from . import reference_proxy
    from .seccomp import confine_learner
    from .syscalls import PR_SET_PDEATHSIG, inside, libc
    from .wire import clip, decode, encode, read_message, write_message
else:  # the box's runtime folder, which child.py puts on the path while it imports its siblings
    import reference_proxy
    from seccomp import confine_learner
    from syscalls import PR_SET_PDEATHSIG, inside, libc
    from wire import clip, decode, encode, read_message, write_message

REQUESTS, REPLIES = 3, 4  # the box's channel, as file descriptors of every process of the box
MEMORY_SLACK = 256 << 20  # a stage may leave this much more address space in use than the zygote
Message = tuple[dict, list[bytes]]


class Channel:
    """The worker's end of the box's channel. Requests come in order, except that a proxy's call to a reference
    (``call``) takes the grader's answer out of them: a request read while it waits (the stage's first operation,
    sent while the module was still importing) is kept for ``next``."""

    def __init__(self):
        self.inbox: collections.deque[Message] = collections.deque()
        self.calls = 0

    def next(self) -> Message | None:
        """The next request (None: the grader closed the channel)."""
        return self.inbox.popleft() if self.inbox else read_message(REQUESTS)

    def send(self, header: dict, blobs=()) -> None:
        write_message(REPLIES, header, blobs)

    def call(self, header: dict, blobs=()) -> Message:
        """Ask the grader to run a reference (``reference_proxy``); its answer."""
        self.calls += 1
        number = self.calls
        self.send({**header, "kind": "reference", "call": number}, blobs)
        while True:
            message = read_message(REQUESTS)
            if message is None:
                raise RuntimeError("the grader closed the channel")
            if message[0].get("kind") == "reference_answer" and message[0].get("call") == number:
                return message
            self.inbox.append(message)


def serve(adapters, box: dict, opened: dict) -> None:
    """A worker: serve stage after stage, for as long as each leaves the process as it found it.

    ``opened`` is the "open" request the worker was forked for. Each stage imports its module
    afresh and answers operations until "close". Then the worker compares the process with the
    one it was forked from (``process_state``): unchanged, it says "parked" and serves the next
    "open" itself (a fork and torch's first-touch costs saved per stage); changed (torch
    patched, threads or processes started, the default dtype set, memory held...), it says
    "leaving" and exits, and the box forks a clean worker for the next stage, as after a crash.
    This only decides how fairly one submission's stages are kept apart: the worker's answer
    is the learner's to forge, and the grader never acts on it beyond this submission. Without
    a private /proc the check cannot see processes, so a worker serves one stage only.
    """
    import faulthandler

    os.setpgid(0, 0)
    libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (without a pid namespace: die with the box)
    faulthandler.enable()  # a segfault prints the Python stack to the captured stderr
    randomness = random_states()
    baseline = process_state(adapters) if box["confined"] else None
    # Python's tempfile looks for a folder it can write a file in, and none is left once the learner's filter is
    # on: it gets the box's own (torch's compiler asks for it even when flex_attention runs eagerly).
    import tempfile

    tempfile.tempdir = box["tmp"]
    confine_learner(libc())  # before any learner code: this process and its threads, for good
    channel = Channel()
    header = opened
    while header is not None and header.get("cmd") == "open":
        # The grader takes the stage as begun only when a worker says so (a request written is not one read).
        channel.send({"kind": "opened", "token": header.get("token")})
        restore_random_states(randomness)  # every stage starts from the template's random state
        ceiling = header.get("memory_headroom")
        header = serve_stage(adapters, box, header, channel)
        if header is None or header.get("cmd") != "close":
            return
        changed = changes(baseline, process_state(adapters)) if baseline is not None else ["no private /proc to check"]
        if ceiling:
            changed.append("memory ceiling")  # it cannot be raised again: the next stage gets a fresh worker
        if changed:
            channel.send({"kind": "leaving", "token": header.get("token"), "changed": changed[:5]})
            return
        channel.send({"kind": "parked", "token": header.get("token")})
        message = channel.next()
        header = message[0] if message else None


def serve_stage(adapters, box: dict, opened: dict, channel: Channel) -> dict | None:
    """Import the stage module of the "open" request ``opened``, beside proxies of the reference modules it builds
    on (``provided``: their descriptions), then answer operations on it; returns the request that ended it."""
    import traceback

    submission, module = box["submission"], opened["module"]
    if opened.get("memory_headroom"):
        hold_address_space(int(opened["memory_headroom"]))
    provided = {name: reference_proxy.proxy_module(name, spec, channel)
                for name, spec in (opened.get("provided") or {}).items()}
    try:
        loaded = adapters.load_stage_module(submission, module, provided)
    except adapters.SubmissionError as exc:
        loaded = exc
    while True:
        message = channel.next()
        if message is None or message[0].get("cmd") != "op":
            return message and message[0]
        header, blobs = message
        try:
            if isinstance(loaded, adapters.SubmissionError):
                raise adapters.SubmissionError(str(loaded))
            kwargs = decode(header["kwargs"], blobs)
            result = adapters.OPS[header["op"]](loaded, **kwargs)
            out = []
            reply = {"kind": "result", "value": encode(result, out)}
        except adapters.SubmissionError as exc:
            out, reply = [], {"kind": "submission_error", "message": clip(str(exc))}
        except Exception as exc:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if inside(f.filename, submission)]
            for frame in frames:  # the learner knows the file by its name, not our copy's path
                frame.filename = os.path.basename(frame.filename)
            out, reply = [], {
                "kind": "exception", "type": type(exc).__name__, "message": clip(str(exc)),
                "memory": isinstance(exc, MemoryError) or "can't allocate memory" in str(exc),
                "traceback": "".join(traceback.format_list(frames[-4:])),
            }
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        reply["token"] = header.get("token")
        channel.send(reply, out)


def hold_address_space(headroom: int) -> None:
    """Lower this process's RLIMIT_AS to its address space now plus ``headroom`` bytes (never above the
    limit it has). Hard as well as soft: a process without privileges cannot raise it again, so
    whatever the learner's code does, an allocation beyond it fails."""
    import resource

    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + headroom if hard == resource.RLIM_INFINITY else min(hard, size + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def changes(before: dict, after: dict) -> list[str]:
    """The names of the parts of ``process_state`` that differ. Two may grow a little: the address
    space (by the slack), and the operating-system threads (by torch's own intra-op pool, which
    OpenMP starts on the first parallel operation when torch computes with several threads)."""
    import torch

    allowed = {"address space": MEMORY_SLACK, "threads": torch.get_num_threads() - 1}
    changed = []
    for key, value in after.items():
        old = before.get(key)
        if key in allowed and value is not None and old is not None:
            if value - old > allowed[key]:
                changed.append(key)
        elif value != old:
            changed.append(key)
    return changed


def process_state(adapters) -> dict:
    """What a stage could leave behind for the next one to trip over, as comparable values.

    Covers the ways code changes a Python process for the code that runs after it: names
    rebound in the modules and classes the stages and this worker use (by object identity),
    torch's global modes and hooks, the interpreter's import machinery, streams, signal
    handlers and warning filters, and the operating system's view (threads, processes, open
    files, address space).
    """
    import builtins
    import threading
    import warnings

    import numpy
    import torch

    nn = torch.nn
    spaces = [builtins, torch, nn, nn.functional, nn.init, torch.Tensor, nn.Module, nn.Linear, nn.Dropout,
              nn.ModuleList, nn.Parameter, nn.modules.module, numpy, adapters, adapters.Allocations,
              sys.modules[__name__], reference_proxy, json]
    # Copies of their dictionaries: comparing two is C code with an identity shortcut per entry.
    state = {f"names of {getattr(s, '__name__', s)}": dict(vars(s)) for s in spaces}
    state["adapters.OPS"] = {k: id(v) for k, v in adapters.OPS.items()}
    # Two readings have no public API, so they use torch's private names, here only and with defaults
    # should a torch release drop them: whether a __torch_function__ mode was left pushed
    # (torch._C), and the global hooks every nn.Module runs (nn.modules.module._global_*).
    state["torch modes"] = (
        torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.is_anomaly_enabled(), torch.get_num_threads(),
        torch.get_float32_matmul_precision(), str(getattr(torch, "get_default_device", str)()),
        getattr(torch._C, "_len_torch_function_stack", int)(), torch._C._is_torch_function_enabled(),
    )
    state["torch.nn global hooks"] = {k: len(v) for k, v in vars(nn.modules.module).items()
                                      if k.startswith("_global_") and isinstance(v, dict)}
    state["python threads"] = threading.active_count()
    state["interpreter"] = (
        [id(f) for f in sys.meta_path], [id(h) for h in sys.path_hooks], list(sys.path), id(sys.stdout),
        id(sys.stderr), id(sys.excepthook), sys.getrecursionlimit(), [id(f) for f in warnings.filters],
        [id(signal.getsignal(n)) for n in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)],
        os.getcwd(), sorted(os.environ.items()), numpy.geterr(),
    )
    try:
        state["processes"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        state["threads"] = len(os.listdir("/proc/self/task"))  # Python's and native ones
        state["open files"] = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/statm") as statm:
            state["address space"] = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        state["processes"] = None
    return state


def random_states() -> tuple:
    import random

    import numpy
    import torch

    return torch.get_rng_state(), numpy.random.get_state(), random.getstate()


def restore_random_states(states: tuple) -> None:
    import random

    import numpy
    import torch

    torch.set_rng_state(states[0])
    numpy.random.set_state(states[1])
    random.setstate(states[2])
