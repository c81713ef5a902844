"""grader.sandbox: boxes give LocalBackend's answers, survive hostile code, and never mix submissions.

Limits are short (1 s of CPU time per
check) so that the whole file stays fast; one sandbox (one template, torch imported once) serves
the whole module, as one serves a grading worker. Every test that uses it runs twice as root: with the
confinement the README promises here (namespaces), and with the one a container gets (``container``:
a fresh uid, the learner's filter, the kit private to root), which this machine also allows.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from grader.course.samples import write_modules
from grader.kit import EXERCISES, FIXTURES, KIT, SOLUTIONS, SUITE, stages
from grader.sandbox import lockdown, procfs, scratch
from grader.sandbox.backend import IsolatedBackend
from grader.sandbox.confinement import Confinement, SandboxUnavailable, SandboxWarning, probe
from grader.sandbox.limits import Limits
from grader.sandbox.reference import reference_imports
from grader.sandbox.template import Sandbox
from runs import kit_modes_kept
from suite_runtime.adapters import LocalBackend, SubmissionError
from suite_runtime.cases import draw_weights
from suite_runtime.stage_names import builds_on
from tamper import attacked, payload, reading_dependency, solution, stealing_wrapper, stub

LIMITS = Limits(check_seconds=1.0, memory_bytes=2 << 30, output_bytes=64 << 10, processes=48)
# What the README promises on such a machine; kit_tests/sandbox/test_container.py runs this file in a container as
# Docker makes one (kit_tests/docker_default.sh), where the promise is the container confinement.
PROMISED = os.environ.get("ATTNKIT_TEST_CONFINEMENT") or ("namespaces" if os.geteuid() == 0 else "userns")

HOSTILE_CALLS = Path(__file__).parent.parent / "tamper_payloads" / "hostile_calls.py"

# Stages 2 to 4 misbehave at import; stage 6 is the stub of exercises/.
HOSTILE_IMPORTS = {
    "s02_normalization": "while True:\n    pass\n",
    "s03_context_vectors": "import os\nos._exit(0)\n",
    "s04_trainable_projections": "import sys\nsys.exit(0)\n",
}


def same(actual, expected, where="result"):
    """The same plain values: same types and structure; arrays of the same dtype and shape, equal.
    Floats get a few units in the last place of slack: both sides ran on this machine with the
    same number of threads, but BLAS may split the work differently in another process."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        if expected.dtype.kind in "fc":
            np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7, err_msg=where)
        else:
            assert np.array_equal(actual, expected), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def sandbox():
    """One template for the module, as a grading worker keeps one for all its submissions (the container
    confinement makes the kit's secrets private to root: given back after)."""
    with kit_modes_kept(), Sandbox() as sandbox:
        sandbox.start()
        yield sandbox


@pytest.fixture(scope="module")
def isolated_reference(sandbox):
    with IsolatedBackend(SOLUTIONS, LIMITS, sandbox=sandbox) as backend:
        yield backend


def write_submission(root, extra=""):
    """The reference with hostile functions in stage 1, hostile imports in stages 2-4, the stub of stage 6."""
    root.mkdir(parents=True, exist_ok=True)
    for name in stages():
        shutil.copyfile(SOLUTIONS / f"{name}.py", root / f"{name}.py")
    s01 = root / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + "\n\n" + HOSTILE_CALLS.read_text() + extra)
    for name, code in HOSTILE_IMPORTS.items():
        (root / f"{name}.py").write_text(code)
    shutil.copyfile(EXERCISES / "s06_causal_mask.py", root / "s06_causal_mask.py")
    return root


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory):
    return write_submission(tmp_path_factory.mktemp("submission") / "hostile")


@pytest.fixture
def hostile(hostile_root, sandbox):
    """A hostile submission of its own for each test (its boxes are killed when the test ends)."""
    with IsolatedBackend(hostile_root, LIMITS, sandbox=sandbox) as backend:
        yield backend


def call(backend, func, *args, module="s01_attention_scores"):
    return backend.run("call", module, func=func, args=args)


def good_call_works(backend, module="s01_attention_scores"):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    same(backend.run("call", module, func="attention_scores_matmul", args=(x, x[0])), x @ x[0])


def processes_of(uid):
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                owners += [int(line.split()[1]) for line in status if line.startswith("Uid:")]
        except OSError:
            pass
    return owners.count(uid)


# ---------------------------------------------------------------- same answers as LocalBackend

def weights(reference, module, cls, init):
    return draw_weights(np.random.default_rng(0), reference.stage(module), cls, init)


def test_answers_are_identical_to_the_local_backend(isolated_reference, reference):
    local = reference.backend
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    mha = dict(d_in=4, d_out=6, context_length=5, dropout=0.0, num_heads=2)
    cases = [
        ("call", "s01_attention_scores", dict(func="attention_scores_loop", args=(x[0], x[0, 1]))),
        ("call", "s02_normalization", dict(func="softmax_by_hand", args=(x[0],), kwargs={"dim": 0})),
        ("call", "s07_dropout", dict(func="dropout_by_hand", args=(np.ones((4, 4), np.float32), 0.5), seed=123)),
        ("forward", "s08_causal_attention", dict(
            cls="CausalAttention", init=dict(d_in=4, d_out=3, context_length=5, dropout=0.0), x=x,
            weights=weights(reference, "s08_causal_attention", "CausalAttention",
                                   dict(d_in=4, d_out=3, context_length=5, dropout=0.0)))),
        ("forward", "s10_multihead_attention", dict(
            cls="MultiHeadAttention", init=mha, x=x,
            weights=weights(reference, "s10_multihead_attention", "MultiHeadAttention", mha))),
        ("heads_forward", "s09_multihead_wrapper", dict(
            cls="MultiHeadAttentionWrapper", init=mha, x=x,
            weights=weights(reference, "s09_multihead_wrapper", "MultiHeadAttentionWrapper", mha))),
        ("inspect", "s11_other_forms", dict(cls="MultiHeadAttentionCombinedQKV", init=mha)),
        ("transfer_v2_to_v1", "s05_self_attention", dict(
            d_in=4, d_out=3, x=x[0],
            v2_weights=weights(reference, "s05_self_attention", "SelfAttention_v2", dict(d_in=4, d_out=3)))),
    ]
    for op, module, kwargs in cases:
        same(isolated_reference.run(op, module, **kwargs), local.run(op, module, **kwargs), f"{op} {module}")


def test_adapter_errors_are_the_local_backend_errors(isolated_reference, reference):
    local = reference.backend
    with pytest.raises(SubmissionError) as expected:
        local.run("call", "s01_attention_scores", func="no_such_function")
    with pytest.raises(SubmissionError) as actual:
        isolated_reference.run("call", "s01_attention_scores", func="no_such_function")
    assert str(actual.value) == str(expected.value)
    with pytest.raises(ValueError):
        isolated_reference.run("call", "../solutions/s01", func="x")


def test_the_machine_confines_as_the_readme_promises(sandbox):
    """As root: fresh namespaces and a fresh uid for each submission; without root: the same in a
    user namespace, without the fresh uid. A machine that confines less fails here (no skip). In a
    container (root, no namespaces, no cgroups): a fresh uid and the learner's filter; not a private root
    file system or pid namespace (the kit's secrets are made private to root instead), nor cgroups."""
    missing = {"namespaces": [], "userns": ["uid"],
               "container": ["mount", "pid", "cgroup", "cgroup limits"]}[PROMISED]
    assert sandbox.mode == PROMISED, sandbox.confinement.summary()
    assert sandbox.confinement.missing == missing, sandbox.confinement.summary()
    assert probe().mode == PROMISED
    assert probe().missing == missing
    if sandbox.mode == "container":
        assert set(map(str, lockdown.kit_private())) <= set(sandbox.confinement.private)
        assert all(not path.stat().st_mode & 0o077 for path in lockdown.kit_private() if path.exists())


def test_attnkit_doctor_says_which_confinement_holds_and_what_each_guarantee_rests_on():
    """The same confinement a grading run gets here, each guarantee with what enforces it or what to change."""
    import subprocess
    import sys

    from grader.sandbox.confinement import GUARANTEES

    run = subprocess.run([sys.executable, "-m", "grader.cli", "doctor"], capture_output=True, text=True, timeout=300,
                         cwd=KIT)
    assert run.returncode == (0 if PROMISED == "namespaces" else 1), run.stdout + run.stderr
    assert f"sandbox: {PROMISED}" in run.stdout
    for guarantee in GUARANTEES:
        assert f"] {guarantee}: {GUARANTEES[guarantee]}" in run.stdout, guarantee
    assert run.stdout.count("rests on: ") + run.stdout.count("to get it: ") == len(GUARANTEES)
    if PROMISED == "container":
        assert "[MISSING] mount" in run.stdout and "CAP_SYS_ADMIN" in run.stdout


def test_a_machine_without_cgroup_limits_says_so():
    """Without the memory and pids controllers a box's processes are bounded one by one only: the
    run's first line and every record say what is missing."""
    weaker = Confinement("namespaces", cgroup=True, bounded=False)
    assert weaker.missing == ["cgroup limits"]
    assert "WEAKER" in weaker.summary() and "memory and number" in weaker.summary()
    assert weaker.record() == {"mode": "namespaces", "missing": ["cgroup limits"]}


# ---------------------------------------------------------------- the wire format

def test_the_wire_format_round_trips_plain_values():
    from grader.sandbox.wire import decode, encode

    value = {"a": (np.arange(3, dtype=np.int64), [1, 2.5, None, True]), "b": np.float32(2), 3: "x",
             "c": np.zeros((2, 0), dtype=bool), "d": np.array(1 + 2j),
             "e": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))}
    blobs = []
    same(decode(encode(value, blobs), blobs), value)


def deep(levels):
    nested = []
    for _ in range(levels):
        nested = [nested]
    return nested


def npy(array):
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


@pytest.mark.parametrize("data, blobs", [
    ({"__array__": 0}, [npy(np.array([object()], dtype=object))]),  # would need pickle
    ({"__array__": 0}, [npy(np.zeros(2, dtype=[("x", "f4")]))]),  # structured
    ({"__array__": 0}, [npy(np.array(["text"]))]),  # not numeric
    ({"__array__": 0}, [npy(np.zeros(10))[:-8]]),  # truncated
    ({"__array__": 1}, []),  # dangling reference
    ({"__class__": "os.system"}, []),
    ({"__tuple__": [], "extra": 1}, []),
    ({"__dict__": [[[1], 2]]}, []),  # unhashable key
    (deep(100), []),  # nested beyond MAX_DEPTH
    # Raw arrays (the fast path): every field is checked as strictly as an .npy header.
    ({"__raw__": [0, "|O", [1], False]}, [bytes(8)]),  # object dtype would need pickle
    ({"__raw__": [0, "<U4", [1], False]}, [bytes(16)]),  # not numeric
    ({"__raw__": [0, "<f4", [3], False]}, [bytes(8)]),  # 8 bytes cannot hold 3 float32
    ({"__raw__": [0, "<f4", [-1], False]}, [bytes(4)]),  # negative dimension
    ({"__raw__": [0, "<f4", [1] * 64, False]}, [bytes(4)]),  # too many dimensions
    ({"__raw__": [1, "<f4", [1], False]}, [bytes(4)]),  # dangling reference
    ({"__raw__": [0, "<f4", [1], "yes"]}, [bytes(4)]),  # memory order not a bool
    ({"__raw__": [0, "<f4", [1]]}, [bytes(4)]),  # missing field
    ({"__rawscalar__": [0, "<f4"]}, [bytes(2)]),  # truncated scalar
])
def test_the_grader_rejects_anything_but_plain_data(data, blobs):
    from grader.sandbox.wire import ProtocolError, decode

    with pytest.raises(ProtocolError):
        decode(data, blobs)


def test_the_channel_reads_messages_in_order_whatever_it_read_ahead():
    """A read of a box's replies takes what the pipe holds (up to channel.READ_AHEAD): messages that arrive together
    are each read whole and in order, a message larger than a read is read to its end, and a header beyond its limit
    is refused from its length alone."""
    from types import SimpleNamespace

    from grader.sandbox.channel import MAX_HEADER_BYTES, READ_AHEAD, receive
    from grader.sandbox.wire import LENGTH, ProtocolError, decode, encode, pack

    large = np.arange(3 * READ_AHEAD, dtype=np.float32)  # (12 times what one read asks for)
    messages = [({"kind": "result", "token": str(i)}, value) for i, value in enumerate([1, "two", large, None])]
    readable, writable = os.pipe()
    box = SimpleNamespace(replies=readable, received=bytearray())
    wire = b""
    for header, value in messages:
        blobs = []
        wire += pack({**header, "value": encode(value, blobs)}, blobs)
    wire += LENGTH.pack(MAX_HEADER_BYTES + 1) + b"{}"
    writer = threading.Thread(target=os.write, args=(writable, wire))  # (a pipe holds less than the whole stream)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        for header, value in messages:
            got, values = receive(box, deadline, lambda: None, 1 << 30)
            assert got["token"] == header["token"], f"message {got['token']} came where {header['token']} was due"
            same(decode(got["value"], values), value)
        with pytest.raises(ProtocolError, match="header of"):
            receive(box, deadline, lambda: None, 1 << 30)
    finally:
        os.close(readable)  # (a writer left blocked gets a broken pipe)
        writer.join()
        os.close(writable)


# ---------------------------------------------------------------- learner errors and limits

def test_the_stub_message_comes_through(hostile):
    with pytest.raises(SubmissionError) as info:
        hostile.run("call", "s06_causal_mask", func="causal_weights_simple", args=(np.ones((3, 3), np.float32),))
    message = str(info.value)
    assert message.startswith("NotImplementedError: s06_causal_mask: causal_weights_simple: ")
    assert 'File "s06_causal_mask.py", line' in message  # the learner's frame, from the short traceback
    assert hostile.stats["boxes"] == 1  # an exception in learner code costs no box


def test_an_endless_loop_costs_one_check_of_cpu_time(hostile):
    with pytest.raises(SubmissionError, match=r"s01_attention_scores: time limit of 1 s of CPU time for one check "
                                              r"exceeded — an infinite loop") as stopped:
        call(hostile, "spin")
    assert stopped.value.limit == "time"  # the limit hit, said where it happened (what the verdict records)
    assert 1.0 <= hostile.stats["cpu_seconds"] < 1.5
    good_call_works(hostile)  # in a new box
    assert hostile.stats["boxes"] == 2


def test_code_that_waits_hits_the_wall_clock_limit(hostile_root, sandbox):
    limits = Limits(check_seconds=0.3)
    with IsolatedBackend(hostile_root, limits, sandbox=sandbox) as backend:
        started = time.monotonic()
        with pytest.raises(SubmissionError,
                           match=r"time limit of 1.5 s \(wall clock, waiting\) exceeded while the code was waiting") \
                as stopped:
            call(backend, "nap")
        assert stopped.value.limit == "time"
        assert time.monotonic() - started < 1.5 + 1.0
        good_call_works(backend)


def test_the_limit_is_per_check_not_per_operation(hostile):
    hostile.start_check()
    call(hostile, "burn", 0.4)
    call(hostile, "burn", 0.4)
    with pytest.raises(SubmissionError, match="time limit of 1 s of CPU time for one check"):
        call(hostile, "burn", 0.4)  # the check's third 0.4 s
    hostile.start_check()
    call(hostile, "burn", 0.4)  # a new check starts afresh


def test_the_budget_bounds_a_submission_then_every_check_fails_at_once(hostile_root, sandbox):
    """A correct but slow submission: each check within its limit, all of them together over the budget."""
    limits = Limits(check_seconds=1.0, budget_seconds=1.0)
    with IsolatedBackend(hostile_root, limits, sandbox=sandbox) as backend:
        for _ in range(2):
            backend.start_check()
            call(backend, "burn", 0.4)
        backend.start_check()
        with pytest.raises(SubmissionError, match=r"the time budget of this submission ran out \(1 s of CPU time") \
                as stopped:
            call(backend, "burn", 0.4)
        assert stopped.value.limit == "budget"
        for _ in range(3):  # every later check fails at once, without running anything
            backend.start_check()
            started = time.monotonic()
            with pytest.raises(SubmissionError, match="time budget of this submission ran out"):
                good_call_works(backend)
            assert time.monotonic() - started < 0.1
        assert 1.0 <= backend.cpu_used() < 1.5


def test_a_submission_that_sleeps_in_every_check_waits_its_budget_at_most(hostile_root, sandbox):
    """Each check sleeps well within its own limit on waiting (5 x 1 s); together they wait the submission's
    budget (4 s, with a tenth more for the channel's own delays) and no more: then every check fails at once.
    (Before, the whole submission could wait five times its budget: a grading worker held 10 minutes.)"""
    limits = Limits(check_seconds=1.0, budget_seconds=4.0)
    started = time.monotonic()
    with IsolatedBackend(hostile_root, limits, sandbox=sandbox) as backend:
        good_call_works(backend)  # (the box's start is nobody's waiting)
        started, ran = time.monotonic(), 0
        for _ in range(20):
            backend.start_check()
            try:
                call(backend, "doze", 0.5)
                ran += 1
            except SubmissionError as exc:
                assert "time budget of this submission ran out" in str(exc)
                break
        waited = time.monotonic() - started
    assert 6 <= ran <= 9, ran
    assert limits.budget <= waited < limits.budget_wall + 1.5, waited


def test_start_up_is_not_the_learners_time(hostile_root):
    """A cold sandbox (a template to start, torch to import: seconds) and a check limit far shorter:
    the first check still passes, because the clock starts when the learner's code does."""
    with IsolatedBackend(hostile_root, Limits(check_seconds=0.2)) as backend:
        backend.start_check()
        good_call_works(backend)
        assert backend.sandbox.stats["start_seconds"][0] > 0.2


def test_memory_bomb_hits_the_memory_limit(hostile):
    with pytest.raises(SubmissionError, match=r"memory limit of 2 GiB exceeded \((MemoryError|RuntimeError)") as hit:
        call(hostile, "eat_memory")
    assert hit.value.limit == "memory"
    good_call_works(hostile)


@pytest.mark.parametrize("func, code", [("leave_quietly", 0), ("leave_abruptly", 3)])
def test_exiting_is_reported(hostile, func, code):
    with pytest.raises(SubmissionError, match=f"exited with code {code} before answering") as ended:
        call(hostile, func)
    assert ended.value.limit == "exit"
    good_call_works(hostile)


def test_segfault_is_reported(hostile):
    with pytest.raises(SubmissionError, match="died with signal SIGSEGV") as ended:
        call(hostile, "crash")
    assert ended.value.limit == "crash"
    good_call_works(hostile)


def test_a_gigabyte_of_printing_is_truncated(hostile):
    try:
        call(hostile, "shout")
    except SubmissionError as exc:
        assert "time limit" in str(exc)
    captured = hostile.last_output["stdout"]
    assert captured.startswith("x" * 1000)
    assert len(captured) < (64 << 10) + 8192 and "more bytes dropped" in captured
    good_call_works(hostile)


def test_learner_code_runs_no_program_and_starts_no_process(hostile):
    """Under the learner's filter (every confinement): no fork, no program (a fresh process would escape a
    stage's memory ceiling), so the box is its first process and one worker, whatever the code tries:
    a fork loop, children that hide their CPU time, a background hog, memory spread over processes."""
    uid = int(call(hostile, "whoami")[0])
    assert int(call(hostile, "fork_loop")) == 0
    for attack, args in [("burn_hidden", (4.0,)), ("hog_in_background", (8, 6)), ("spread_memory", (3, 900)),
                         ("run_program", ())]:
        with pytest.raises(SubmissionError, match=r"^PermissionError: \[Errno 1\] Operation not permitted") as info:
            call(hostile, attack, *args)
        assert "may not run programs, start processes" in str(info.value)  # said, for an honest learner
    good_call_works(hostile)
    if hostile.mode != "userns":  # (there the box keeps the grader's uid)
        assert processes_of(uid) == 2
        hostile.close()  # kills the box
        assert processes_of(uid) == 0


def test_a_box_holds_no_memory_its_limits_do_not_count(tmp_path, sandbox):
    """Without a cgroup, a box's memory is its processes' address space (RLIMIT_AS) and nothing else: learner code
    gets no anonymous file (memfd, O_TMPFILE, a file in /dev/shm, POSIX shared memory), gives no page to a pipe
    (vmsplice), makes no pipe larger (F_SETPIPE_SZ) and no socket; what its pipes hold is bounded by its limit on
    open files (tamper_payloads/hoard_anonymous.py tries to hold 1 GiB by all of them)."""
    s01 = "s01_attention_scores"
    root = write_modules(tmp_path / "hoarder", replaced={s01: attacked(solution(s01), "hoard_anonymous")},
                         assignment="attention")
    with IsolatedBackend(root, replace(LIMITS, check_seconds=10.0), sandbox=sandbox) as backend:
        held = backend.run("call", s01, func="hoarded")
        good_call_works(backend)
    refused = ("memfd", "O_TMPFILE", "/dev/shm", "shm_open", "vmsplice", "sockets")
    assert {route: held[route] for route in refused} == dict.fromkeys(refused, 0)
    assert 0 < held["pipes"] <= LIMITS.files // 2 * (64 << 10), held  # (pipes of the default size, 64 KiB)


def test_learner_code_cannot_signal_the_processes_that_serve_its_box(tmp_path, sandbox):
    """Its box's first process (which forks its workers), the template, the reference process, the grader: no
    signal reaches them, by any call that takes a pid or a handle, nor through a file given one of them as owner
    (tamper_payloads/stop_box.py). The stages after it are served as usual."""
    s07 = "s07_dropout"
    root = write_modules(tmp_path / "stopper", replaced={s07: attacked(solution(s07), "stop_box")},
                         assignment="attention")
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        assert backend.run("call", s07, func="reached") == ()
        good_call_works(backend)
        assert backend.stats["boxes"] == 1


@pytest.mark.parametrize("signal_name", ["SIGSTOP", "SIGKILL"])
def test_a_stopped_or_vanished_box_is_replaced_before_its_next_stage(signal_name, sandbox, monkeypatch):
    """A stage is taken as begun only when a worker says it took the request: a box whose processes were stopped
    (or killed) between two stages is replaced, and the next stage is graded as usual, in a new box (the wait
    counts against the submission's budget only; shortened here)."""
    import signal

    from grader.sandbox import backend as module

    monkeypatch.setattr(module, "CLOSE_SECONDS", 0.2)
    with IsolatedBackend(SOLUTIONS, LIMITS, sandbox=sandbox) as backend:
        good_call_works(backend)
        box = backend._box
        for pid in [box.init, *procfs.children(box.init)]:
            os.kill(pid, getattr(signal, signal_name))
        scores = np.array([1.0, 2.0, 3.0], np.float32)
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   np.exp(scores) / np.exp(scores).sum(), rtol=1e-6)
        assert backend.stats["boxes"] == 2


def test_tampering_reaches_only_the_submissions_own_answers(hostile, hostile_root, sandbox):
    # The learner's patched adapter decides what its own stage answers (already this call)...
    assert call(hostile, "tamper") == "tampered"
    assert call(hostile, "attention_scores_matmul", np.eye(2, dtype=np.float32), np.ones(2, np.float32)) == "tampered"
    # ...while this process's NumPy and json are untouched.
    assert not np.allclose(np.zeros(2), np.ones(2)) and json.dumps(1) == "1"
    # A forged reply is rejected (and costs a new box).
    with pytest.raises(SubmissionError, match="the answer could not be read") as forged:
        call(hostile, "forge")
    assert forged.value.limit is None  # (a forgery is no limit; an answer too large is: "output")
    good_call_works(hostile)


def test_impersonating_the_sandbox_reaches_no_other_submission(hostile, hostile_root, sandbox, tmp_path):
    """'ended', 'parked' and forged results written, with the tokens read from the serving code's
    frames, on every descriptor the learner holds: they are answers of this submission only."""
    try:
        call(hostile, "impersonate")
    except SubmissionError:
        pass  # the forged "ended" may end the call: the learner's own loss
    hostile.close()
    with IsolatedBackend(write_submission(tmp_path / "next"), LIMITS, sandbox=sandbox) as following:
        good_call_works(following)
        assert following.stats["boxes"] == 1


def test_import_time_failures_cost_only_their_stage(hostile):
    with pytest.raises(SubmissionError, match="s02_normalization: time limit of 1 s of CPU time"):
        hostile.run("call", "s02_normalization", func="softmax_torch", args=(np.ones(3, np.float32),))
    for module in ("s03_context_vectors", "s04_trainable_projections"):
        with pytest.raises(SubmissionError, match=r"exited with code 0 before answering \(sys.exit/os._exit at import"):
            hostile.run("call", module, func="anything")
    good_call_works(hostile)
    good_call_works(hostile, module="s01_attention_scores")


LEAVES_TRACES = """

def draw():
    torch.ones(512, 512) @ torch.ones(512, 512)  # with several threads, torch starts its pool (allowed)
    return torch.rand(3)  # unseeded: from whatever random state the stage starts with


def patch():
    import threading, time
    torch.softmax = lambda scores, dim=-1: torch.zeros_like(scores)
    torch.set_default_dtype(torch.float64)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return torch.zeros(1)
"""


def test_a_worker_serves_the_next_stage_only_if_the_last_left_no_trace(tmp_path, sandbox):
    """Without a pid namespace of its own (container), a worker cannot tell its stage's processes from the
    machine's, so it serves one stage only."""
    own_pids = sandbox.mode != "container"
    for name in ("s01_attention_scores", "s02_normalization"):
        shutil.copyfile(SOLUTIONS / f"{name}.py", tmp_path / f"{name}.py")
    s01 = tmp_path / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + LEAVES_TRACES)
    scores = np.array([1.0, 2.0, 3.0], np.float32)
    softmax = np.exp(scores) / np.exp(scores).sum()
    with IsolatedBackend(tmp_path, LIMITS, sandbox=sandbox) as backend:
        first = call(backend, "draw")
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   softmax, rtol=1e-6)
        # Back to stage 1 in the same worker, from the same random state as a fresh fork.
        same(call(backend, "draw"), first)
        assert backend.stats["workers"] == (1 if own_pids else 3) and backend.stats["stages"] == 3
        call(backend, "patch")  # torch.softmax replaced, float64 by default: the next stage must not see it
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   softmax, rtol=1e-6)
        assert backend.stats["workers"] == (2 if own_pids else 4) and backend.stats["boxes"] == 1
        if own_pids:
            assert {"names of torch", "torch modes", "python threads", "threads"} <= set(backend.stats["leaving"])


# ---------------------------------------------------------------- what a box can reach

SECRETS = [
    SOLUTIONS / "s01_attention_scores.py",
    FIXTURES / "hidden" / "s01_attention_scores.npz",
    SUITE / "test_s01_attention_scores.py",
]


@pytest.mark.parametrize("secret", SECRETS, ids=lambda p: p.name)
def test_the_kit_is_out_of_reach(hostile, secret):
    assert secret.is_file()
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "read_bytes", str(secret))


def test_other_submissions_are_out_of_reach(hostile, hostile_root):
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "list_dir", str(hostile_root.parent))
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "read_bytes", str(hostile_root / "s01_attention_scores.py"))
    if hostile.mode == "container":  # where the template puts the submissions: the boxes may pass through
        with pytest.raises(SubmissionError, match=r"^PermissionError"):
            call(hostile, "list_dir", str(hostile._box.incoming.parent))
    else:
        assert int(call(hostile, "list_dir", "/sandbox/incoming")) == 0  # where the template receives them


def test_a_box_cannot_read_another_live_box(hostile, hostile_root, sandbox, tmp_path):
    """Two submissions graded at once (boxes of one template): neither reaches the other's modules."""
    with IsolatedBackend(write_submission(tmp_path / "other"), LIMITS, sandbox=sandbox) as other:
        good_call_works(other)
        good_call_works(hostile)
        theirs = other._box.incoming / "s01_attention_scores.py"
        with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
            call(hostile, "read_bytes", str(theirs))


def test_writes_land_nowhere(hostile, hostile_root):
    """Learner code opens files to read them only: not the kit, not other submissions, not even the
    box's own /tmp or its copy of the submission."""
    for target in (KIT / "pwned.txt", SOLUTIONS / "pwned.txt", hostile_root / "pwned.txt", Path("/tmp/pwned.txt"),
                   Path("/dev/shm/pwned.txt")):
        with pytest.raises(SubmissionError, match=r"^PermissionError"):
            call(hostile, "write_file", str(target))
        assert not target.exists()


def test_no_network_and_no_root(hostile):
    with pytest.raises(SubmissionError, match=r"^(OSError|PermissionError|TimeoutError|ConnectionError)"):
        call(hostile, "connect")
    if hostile.mode in ("namespaces", "container"):
        assert (call(hostile, "whoami") >= 1_000_000).all()


def test_the_learner_holds_only_its_own_channel(hostile):
    """File descriptors 0-4 (stdin from /dev/null, stdout, stderr, requests, replies; the fifth is
    the listing's own), only its own box's processes, and it cannot be traced."""
    seen = call(hostile, "world")
    assert seen["fds"][0] == "/dev/null"
    assert all(seen["fds"][fd].startswith("pipe:") for fd in (1, 2, 3, 4))
    assert set(seen["fds"]) <= {0, 1, 2, 3, 4, 5}
    assert seen["dumpable"] == 0
    if hostile.mode == "container":  # the machine's processes are listed, none of the grader's is reachable
        for pid in (os.getpid(), hostile.sandbox._template):
            with pytest.raises(SubmissionError, match=r"^PermissionError"):
                call(hostile, "list_dir", f"/proc/{pid}/fd")
        return
    assert len(seen["pids"]) == 2 and seen["pids"][0] == 1  # the box's first process and this worker
    devices = {f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom")}
    assert set(seen["writable_mounts"]) <= {"/tmp", "/dev/shm", "/proc"} | devices, seen["writable_mounts"]


def test_learner_code_computes_with_one_thread(hostile):
    """Whatever the grading process uses (here torch's default, a thread per core): the limits are
    CPU seconds, and a pool's idle threads spin."""
    seen = call(hostile, "world")
    assert (seen["torch_threads"], seen["omp_threads"]) == (1, "1")


def test_nothing_can_be_left_for_the_next_submission(hostile_root, sandbox, tmp_path):
    """No file in /tmp, /dev/shm or the home folder, no SysV shared memory, no key, no setsid daemon
    serving an abstract socket: the learner's filter refuses each (files are read only, no IPC objects,
    no keyring, no processes, no sockets), and the next submission, under another uid, finds nothing."""
    with IsolatedBackend(hostile_root, LIMITS, sandbox=sandbox) as first:
        assert list(call(first, "plant")) == []
        uid = int(call(first, "whoami")[0])
    assert processes_of(uid) == 0
    with IsolatedBackend(write_submission(tmp_path / "next"), LIMITS, sandbox=sandbox) as second:
        assert list(call(second, "scavenge")) == []
        assert int(call(second, "whoami")[0]) != uid or sandbox.mode == "userns"


def test_userns_is_refused_as_root():
    """Run by root, the userns confinement would leave the boxes root's uid on the host (the owner of
    its files and sysctls), with no capability to lose: root gets namespaces, never userns."""
    if os.geteuid() != 0:
        pytest.skip("as root only (without root, userns is what an instructor gets: see the next test)")
    with pytest.raises(SandboxUnavailable, match="refused as root"):
        Sandbox(confine="userns").start()
    assert "userns" not in __import__("grader.sandbox.confinement", fromlist=["candidate_modes"]).candidate_modes()


def test_the_unprivileged_fallback_also_hides_the_kit(hostile_root, tmp_path):
    """userns is what an instructor without root gets."""
    if os.geteuid() == 0:
        pytest.skip("without root only (as root, userns is refused: see the test above)")
    with Sandbox(confine="userns") as userns:
        with pytest.warns(SandboxWarning, match="lacks a fresh unprivileged uid"):  # said at the start
            userns.start()
        with IsolatedBackend(hostile_root, LIMITS, sandbox=userns) as backend:
            for secret in (SECRETS[0], hostile_root / "s01_attention_scores.py"):
                with pytest.raises(SubmissionError, match="^FileNotFoundError"):
                    call(backend, "read_bytes", str(secret))
            assert list(call(backend, "plant"))
        with IsolatedBackend(write_submission(tmp_path / "next"), LIMITS, sandbox=userns) as following:
            assert list(call(following, "scavenge")) == []


# ---------------------------------------------------------------- the stages a stage builds on

# Appended to each stage module of a submission: the stage modules loaded when it is imported (name
# -> file), the reference ones among them named "<reference sNN_topic>".
LOADED_AT_IMPORT = '''

import sys as _sys

from suite_runtime.stage_names import is_stage_module as _is_stage_module

LOADED = {name: str(getattr(module, "__file__", "")) for name, module in list(_sys.modules.items())
          if _is_stage_module(name)}


def loaded():
    return LOADED
'''

PROXY = "<reference {}, run by the grader>"  # the file of the module a stage gets for one it builds on


def test_a_stage_is_given_a_proxy_of_exactly_what_its_reference_imports(tmp_path, sandbox):
    """Seen from inside the boxes: each stage module finds, at its import, proxies of the stage modules its
    reference solution imports (stage_names.builds_on: their reference run by the grader), and nothing else of
    the kit; its own module is the learner's."""
    root = write_modules(tmp_path / "spy", replaced={
        stage: (SOLUTIONS / f"{stage}.py").read_text() + LOADED_AT_IMPORT for stage in stages()})
    given = {}
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        for stage in stages():
            seen = backend.run("call", stage, func="loaded")
            assert seen.pop(stage).endswith(f"/{stage}.py"), stage
            given[stage] = {name for name, file in seen.items() if file == PROXY.format(name)}
            assert set(seen) == given[stage], f"{stage} found other stage modules: {seen}"
            assert given[stage] == set(builds_on((SOLUTIONS / f"{stage}.py").read_text())), stage
    assert given["s09_multihead_wrapper"] == {"s08_causal_attention"}


def test_a_stage_whose_checks_all_passed_is_met_as_the_learner_s_own(tmp_path, sandbox):
    """Where the grading plugin says stage 8's checks all passed, stage 9 imports the learner's own stage 8 (no
    proxy, no reference process started); where they did not, the proxy."""
    s08, s09 = "s08_causal_attention", "s09_multihead_wrapper"
    root = write_modules(tmp_path / "own", replaced={s09: solution(s09) + LOADED_AT_IMPORT}, assignment="attention")
    verdict = {"passed": True}
    with IsolatedBackend(root, LIMITS, sandbox=sandbox, passed=lambda stage: verdict["passed"]) as backend:
        assert backend.run("call", s09, func="loaded")[s08].endswith(f"/{s08}.py")
        assert backend._reference is None
    verdict["passed"] = False
    with IsolatedBackend(root, LIMITS, sandbox=sandbox, passed=lambda stage: verdict["passed"]) as backend:
        assert backend.run("call", s09, func="loaded")[s08] == PROXY.format(s08)


def test_no_box_holds_the_reference_it_builds_on(tmp_path, sandbox):
    """Stage 9, graded beside a stub stage 8, gets the reference's behaviour (its answers are the reference
    wrapper's, to the bit) and none of its code: tamper_payloads/read_dependency.py looks for the reference of
    stage 8 by every route learner code has (the class it got, sys.modules, gc, frames, files, other processes'
    memory and folders) and finds nothing. (Stage 8 gets not even the behaviour: see the next test.)"""
    s09 = "s09_multihead_wrapper"
    root = write_modules(tmp_path / "reader", replaced=reading_dependency(), assignment="attention")
    init = dict(d_in=4, d_out=3, context_length=6, dropout=0.5, num_heads=3, qkv_bias=True)
    x = np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32)
    with IsolatedBackend(root, replace(LIMITS, check_seconds=10.0), sandbox=sandbox) as backend:
        assert backend.run("call", s09, func="dependency_findings") == ()  # (it reads the whole heap: seconds)
        print(f"read_dependency's search: {backend.cpu_used():.2f} s of CPU time")
        for train in (False, True):  # (dropout in training mode: the same random numbers as the reference's)
            got = backend.run("forward", s09, cls="MultiHeadAttentionWrapper", init=init, x=x, seed=3, train=train)
            expected = LocalBackend(SOLUTIONS).run("forward", s09, cls="MultiHeadAttentionWrapper", init=init, x=x,
                                                   seed=3, train=train)
            np.testing.assert_array_equal(got, expected)
        info = backend.run("inspect", s09, cls="MultiHeadAttentionWrapper", init=init)
        same(info, LocalBackend(SOLUTIONS).run("inspect", s09, cls="MultiHeadAttentionWrapper", init=init))
    # Without solutions/ (a folder that does not exist, or nothing provided) nothing is given: stage 9
    # imports the learner's stage 8, here the stub.
    with IsolatedBackend(root, LIMITS, sandbox=sandbox, provided=reference_imports(tmp_path / "nowhere")) as backend:
        assert backend.provided == {}
    with IsolatedBackend(root, replace(LIMITS, check_seconds=10.0), sandbox=sandbox, provided={}) as backend:
        with pytest.raises(SubmissionError, match="s08_causal_attention: .*see its TODO"):
            backend.run("forward", s09, cls="MultiHeadAttentionWrapper", init=init, x=x)


# Appended to a stage module: a proxy of stage 8's reference made by learner code itself (the box's runtime is
# importable), its calls written to the box's channel as a stage-9 proxy's are.
FORGED_PROXY = '''

def forged_reference():
    import reference_proxy
    import worker_process

    spec = {"names": {"CausalAttention": {"kind": "class", "methods": ["forward"]}}}
    module = reference_proxy.proxy_module("s08_causal_attention", spec, worker_process.Channel())
    return module.CausalAttention(4, 3, 6, 0.0)(__import__("torch").ones(1, 2, 4))
'''


def test_the_reference_answers_only_a_stage_that_builds_on_it(tmp_path, sandbox):
    """A box may ask for the reference of stage 8 only while a stage that builds on it is graded: stage 8 itself
    (or stage 10) forging a proxy's calls gets an error, whatever order the stages come in; stage 9 gets answers."""
    s08, s09, s10 = "s08_causal_attention", "s09_multihead_wrapper", "s10_multihead_attention"
    root = write_modules(tmp_path / "forger", replaced={
        stage: text + FORGED_PROXY for stage, text in ((s08, stub(s08)), (s09, solution(s09)), (s10, solution(s10)))})
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        for stage in (s08, s10, s09, s08):
            if stage == s09:
                assert backend.run("call", stage, func="forged_reference").shape == (1, 2, 3)
            else:
                with pytest.raises(SubmissionError, match=f"{stage} does not build on {s08}"):
                    backend.run("call", stage, func="forged_reference")


# Appended to stage 9: the reference asked for more than its process may hold, or for work longer than a check.
REFERENCE_LIMITS = '''

def huge_reference():
    return CausalAttention(1 << 16, 1 << 16, 8, 0.0)


def busy_reference():
    import torch

    head = CausalAttention(64, 64, 256, 0.0)
    while True:
        head(torch.ones(64, 256, 64))
'''


def test_the_reference_s_work_is_the_check_s_and_its_limits_are_the_box_s(tmp_path, sandbox):
    """What the reference process computes for a stage counts as the stage's time (a proxy called in a loop meets
    the check's CPU limit), and its memory is bounded as a box's is: a reference built beyond it fails the
    learner's check, not the grader; the stage's next check finds the reference working."""
    s09 = "s09_multihead_wrapper"
    root = write_modules(tmp_path / "heavy", replaced={s09: solution(s09) + REFERENCE_LIMITS})
    x = np.ones((1, 4, 4), np.float32)
    init = dict(d_in=4, d_out=2, context_length=4, dropout=0.0, num_heads=2)
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        with pytest.raises(SubmissionError, match="memory limit|out of memory|can't allocate"):
            backend.run("call", s09, func="huge_reference")
        with pytest.raises(SubmissionError, match="time limit of 1 s of CPU time"):
            backend.run("call", s09, func="busy_reference")
        assert backend.run("forward", s09, cls="MultiHeadAttentionWrapper", init=init, x=x).shape == (1, 4, 4)


def test_what_a_stage_builds_on_includes_what_that_builds_on(tmp_path):
    """Given in order, those it imports first: a reference module's own imports must find the
    reference too, never the learner's module."""
    modules = {"s01_a": "x = 1\n", "s02_b": "from s01_a import x\n", "s03_c": "import s02_b\nimport torch\n",
               "s04_d": "import s05_e\n", "s05_e": "import s04_d\n"}  # (the last two: a cycle)
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    imports = {stage: list(given) for stage, given in reference_imports(tmp_path).items()}
    assert imports == {"s01_a": [], "s02_b": ["s01_a"], "s03_c": ["s01_a", "s02_b"], "s04_d": ["s05_e"],
                       "s05_e": ["s04_d"]}
    assert reference_imports(tmp_path)["s03_c"]["s02_b"] == modules["s02_b"]


def test_what_a_stage_is_given_follows_the_reference_not_the_learner(tmp_path, sandbox):
    """The learner's modules import other stages than the references do: stage 8 imports itself and
    stage 9 (which imports stage 8), stage 10 imports stage 9, stage 11 imports stages 10 and 8. What
    the grader sends is read from the references alone: stage 9 still gets stage 8's, and no other
    stage gets any, whatever order the stages are graded in; all else is the learner's."""
    s08, s09, s10, s11 = "s08_causal_attention", "s09_multihead_wrapper", "s10_multihead_attention", "s11_other_forms"
    imports = {s08: "import s08_causal_attention\nimport s09_multihead_wrapper\n", s09: "",
               s10: "import s09_multihead_wrapper\n",
               s11: "import s10_multihead_attention\nimport s08_causal_attention\n"}
    loaded = {s08: {s08, s09}, s09: {s09, s08}, s10: {s10, s09, s08}, s11: {s11, s10, s09, s08}}
    root = write_modules(tmp_path / "tangled", replaced={
        stage: f"{solution(stage)}\n\n{extra}" + LOADED_AT_IMPORT for stage, extra in imports.items()})
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        assert backend.provided == reference_imports(SOLUTIONS)
        for stage in (s09, s10, s11, s08, s09, s08):
            seen = backend.run("call", stage, func="loaded")
            assert set(seen) == loaded[stage], stage
            given = {name for name, file in seen.items() if file == PROXY.format(name)}
            assert given == ({s08} if stage == s09 else set()), f"{stage}: {seen}"
            assert all(file.endswith(f"/{name}.py") for name, file in seen.items() if name not in given), seen


# Appended to a stage module that has a CausalAttention: the file its __init__ comes from.
CAUSAL_FROM = '''

CAUSAL_FROM = CausalAttention.__init__.__code__.co_filename


def causal_from():
    return CAUSAL_FROM
'''


def test_stage_8_cannot_pull_the_reference_in_through_stage_9(tmp_path, sandbox):
    """Stage 8's stub with tamper_payloads/pull_reference.py imports and reloads stage 9 (which imports
    a proxy of the reference of stage 8 when stage 9 is graded) and looks through sys.modules for a reference: it
    keeps its own class, graded before stage 9 or after. The same code in stage 10, after a class of its
    own, does replace it through stage 9 (with the learner's stage 8: stage 10 is given no reference)."""
    s08, s09, s10 = "s08_causal_attention", "s09_multihead_wrapper", "s10_multihead_attention"
    own_class = "\n\nclass CausalAttention:\n    def __init__(self):\n        pass\n"
    root = write_modules(tmp_path / "puller", replaced={
        s08: attacked(stub(s08), "pull_reference") + CAUSAL_FROM, s09: solution(s09) + CAUSAL_FROM,
        s10: attacked(solution(s10) + own_class, "pull_reference") + CAUSAL_FROM})
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        assert backend.run("call", s08, func="causal_from").endswith(f"/{s08}.py")
        assert backend.run("call", s09, func="causal_from").endswith("/reference_proxy.py")  # (a proxy's code)
        assert backend.run("call", s10, func="causal_from").endswith(f"/{s08}.py")
        assert backend.run("call", s08, func="causal_from").endswith(f"/{s08}.py")


# Appended to a stage module that carries the scavenge payload (tamper_payloads/scavenge.py): the channel
# where a source planted for the stage module ``module`` is found (None: nowhere).
FIND_PLANTED = '''

def found(module):
    return _atk_scavenge(module, {})
'''

DIE = "\n\ndef die():\n    import os\n    os._exit(3)\n"


def test_the_reference_stage_9_plants_reaches_no_stage_8(tmp_path, sandbox):
    """Stage 9 looks for the reference of stage 8 (its box holds none) and would plant it, as the source of
    stage 8, in every channel of the tamper corpus's plant entry (tamper_payloads/steal_reference.py); then its
    worker dies. It finds nothing to plant, no channel would take it (the learner's filter: no files, IPC
    objects, sockets, keys or processes), so stage 10 in the same box, stage 8 graded after it and the next
    submission find it nowhere."""
    s08, s09, s10 = "s08_causal_attention", "s09_multihead_wrapper", "s10_multihead_attention"
    scavenger = attacked(stub(s08), "scavenge") + FIND_PLANTED
    root = write_modules(tmp_path / "thief", replaced={
        s08: scavenger, s09: stealing_wrapper() + DIE, s10: attacked(solution(s10), "scavenge") + FIND_PLANTED})
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        assert list(backend.run("call", s09, func="stolen")) == []
        with pytest.raises(SubmissionError, match="exited with code 3"):
            backend.run("call", s09, func="die")
        assert backend.run("call", s10, func="found", args=(s08,)) is None
        assert backend.run("call", s08, func="found", args=(s08,)) is None
        assert "[scavenge]" not in backend.last_output["stderr"]
        assert backend.stats["boxes"] == 1  # (no box holds a reference: the box serves stage 8 after stage 9 too)
    with IsolatedBackend(write_modules(tmp_path / "next", replaced={s08: scavenger}), LIMITS,
                         sandbox=sandbox) as following:
        assert following.run("call", s08, func="found", args=(s08,)) is None


# ---------------------------------------------------------------- what the kernel counts and bounds


def test_a_thread_s_own_run_delay_counts_and_its_file_is_closed_when_it_ends():
    """The grader's threads read their run-queue delay from a file each keeps open: it grows, and a thread that ends
    leaves no open file behind (a grading run's threads come and go)."""
    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("this kernel keeps no schedstat")
    before, seen = set(os.listdir("/proc/self/fd")), []

    def measure():
        first = procfs.own_run_delay()
        sum(range(200_000))
        seen.append(procfs.own_run_delay() >= first >= 0)

    threads = [threading.Thread(target=measure) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [True] * 8
    assert set(os.listdir("/proc/self/fd")) <= before, "a thread's schedstat stayed open after it ended"


def test_a_busy_machine_s_delays_are_not_the_learner_s_waiting(hostile_root, sandbox):
    """Sixteen boxes compute at once, each for 0.3 s of CPU time, on this machine's cores: each box (a
    cgroup with one share of the processors) gets a fraction of a core, so its check takes longer in
    wall-clock time than its limit on waiting (5 x 0.4 s). The time a box spent ready to run but
    waiting for a processor is the machine's load, not waiting by the learner's code: every check passes."""
    if not Path("/proc/pressure/cpu").exists():
        pytest.skip("this kernel keeps no pressure stall information: waiting is plain wall-clock time here")
    limits, count = Limits(check_seconds=0.4), 16
    backends = [IsolatedBackend(hostile_root, limits, sandbox=sandbox) for _ in range(count)]
    try:
        for backend in backends:
            good_call_works(backend)  # every box is up before they all compute
        took, errors = [0.0] * count, []
        start = threading.Barrier(count)

        def check(i):
            start.wait()
            backends[i].start_check()
            began = time.monotonic()
            try:
                call(backends[i], "burn", 0.3)
            except SubmissionError as exc:
                errors.append(str(exc))
            took[i] = time.monotonic() - began

        threads = [threading.Thread(target=check, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for backend in backends:
            backend.close()
    assert not errors, errors[:2]
    assert max(took) > limits.check_wall, f"the slowest check took {max(took):.2f} s: no box waited (test void)"


# ---------------------------------------------------------------- a box's word is data

def test_a_jammed_channel_costs_a_new_box_not_a_record(tmp_path, sandbox):
    """The worker of stage 1 jams the request pipe when its stage ends and answers for the sandbox: the
    next stage gets a new box (the learner's doing), not a 'sandbox failed' that would leave the
    submission without a record."""
    root = tmp_path / "jam"
    shutil.copytree(SOLUTIONS, root, ignore=shutil.ignore_patterns("__pycache__"))
    s01 = root / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + "\n\n" + (HOSTILE_CALLS.parent / "jam_channel.py").read_text())
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        good_call_works(backend)
        scores = np.array([1.0, 2.0, 3.0], np.float32)
        expected = np.exp(scores) / np.exp(scores).sum()
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   expected, rtol=1e-6)
        assert backend.stats["boxes"] == 2


def test_a_huge_message_is_cut(tmp_path, sandbox):
    root = write_submission(tmp_path / "huge")
    (root / "s03_context_vectors.py").write_text((HOSTILE_CALLS.parent / "huge_message.py").read_text())
    with IsolatedBackend(root, LIMITS, sandbox=sandbox) as backend:
        with pytest.raises(SubmissionError, match=r"more characters\]") as info:
            backend.run("call", "s03_context_vectors", func="anything")
    assert len(str(info.value)) < 6000


def test_a_reply_sent_ahead_answers_nothing_else(hostile):
    """Each operation has a token of its own: a result written in advance is the learner's answer to
    its own operation at most, never to the next one."""
    assert float(call(hostile, "answer_ahead", 42)) == 42
    good_call_works(hostile)
    good_call_works(hostile)


# ---------------------------------------------------------------- nothing left behind

def test_the_sandbox_leaves_nothing_in_tmpdir(hostile_root, tmp_path, monkeypatch):
    import tempfile

    if PROMISED == "container":  # boxes are other users there: TMPDIR must let them through (pytest's does not)
        tmp_path = Path(tempfile.mkdtemp(dir="/tmp", prefix="leaves-nothing-"))
        tmp_path.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with IsolatedBackend(hostile_root, LIMITS) as backend:
        good_call_works(backend)
        assert [p.name[:16] for p in tmp_path.iterdir()] == ["attnkit-sandbox-"]
    assert list(tmp_path.iterdir()) == []
    tmp_path.rmdir()


def test_a_dead_process_s_folders_are_swept_and_a_live_one_s_are_not(tmp_path):
    import signal
    import subprocess
    import sys

    code = ("import sys, time, tempfile; tempfile.tempdir = sys.argv[1]; from grader.sandbox import scratch; "
            "f = scratch.Folder('worker'); print(f.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    left = Path(child.stdout.readline().strip())
    assert scratch.sweep(tmp_path) == [] and left.is_dir()  # its owner lives
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert scratch.sweep(tmp_path) == [left] and not left.exists()


def test_an_owner_killed_while_removing_its_folder_leaves_it_to_the_sweep(tmp_path, monkeypatch):
    """A grading worker stopped in its last moments (removing its folder when its time to close ran out) leaves the
    folder in some state of removal: whatever is left, the next sweep removes it. Before the removal renames it, the
    folder holds its lock file; after, its name says it was being removed."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_unlink = os.unlink
    for n in range(-1, 4):  # stopped before its rename (-1), or after n of its files were removed
        folder = scratch.Folder("worker")
        for name in ("submission", "runtime"):
            (folder.path / name).mkdir()
            (folder.path / name / "module.py").write_text("x = 1\n")
        (folder.path / "results.json").write_text("{}")
        gone = []

        def unlink(path, *args, n=n, gone=gone, **kwargs):
            if len(gone) == n:
                raise KeyboardInterrupt  # (the kill, as the removal stands now)
            gone.append(os.path.basename(path))
            return real_unlink(path, *args, **kwargs)

        def rename(*args):
            raise KeyboardInterrupt

        if n < 0:
            monkeypatch.setattr(os, "rename", rename)
        else:
            monkeypatch.setattr(os, "unlink", unlink)
        with contextlib.suppress(KeyboardInterrupt):
            folder.remove()
        monkeypatch.undo()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        os.close(folder._lock)  # (the owner's death drops its lock)
        left = [p.name for p in tmp_path.iterdir()]
        assert len(left) == 1 and left[0].startswith(scratch.REMOVING if n >= 0 else scratch.PREFIX), left
        assert [p.name for p in scratch.sweep(tmp_path)] == left
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_leaves_every_other_folder_named_like_the_kit_s(tmp_path):
    """Only the kit's own folders are swept (they hold a lock file, or are named as being removed): a folder
    someone else named ``attnkit-...`` (a test's database server, a benchmark's course) stays, however old."""
    others = [tmp_path / "attnkit-pg-abc123", tmp_path / "attnkit-bench-xyz", tmp_path / "attnkit-empty-1"]
    for folder in others[:2]:
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "file").write_text("kept")
    others[2].mkdir()
    for folder in others:
        os.utime(folder, (0, 0))  # (as old as can be)
    assert scratch.sweep(tmp_path) == [] and all(folder.is_dir() for folder in others)
    assert not scratch.held("attnkit-pg-", tmp_path)


def test_a_sweep_never_takes_a_folder_being_made(tmp_path, monkeypatch):
    """Two grading runs side by side (or two grading workers): one sweeps while the other makes
    its folders. Each folder must be locked before a sweep can see it."""
    import tempfile
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    done, swept = threading.Event(), []

    def sweeping():
        while not done.is_set():
            swept.extend(scratch.sweep(tmp_path))

    sweeper = threading.Thread(target=sweeping)
    sweeper.start()
    try:
        folders = [scratch.Folder("race") for _ in range(300)]
    finally:
        done.set()
        sweeper.join()
    assert swept == [] and all(f.path.is_dir() for f in folders)
    for folder in folders:
        folder.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_memory_ceiling_is_held_by_the_kernel_whatever_the_stage_hides(sandbox, tmp_path):
    """A stage with a ceiling (its test module's MEMORY_HEADROOM) runs in a worker whose address space the
    kernel holds: the full 8192 x 8192 score matrix (512 MiB in float64, NumPy) is refused, however it is computed,
    while the reference's tiles fit. The same code without a ceiling computes it (the control), and the
    stage after a ceiling gets a worker of its own, without it."""
    m07 = "m07_tiled_attention"
    root = write_modules(tmp_path / "hidden", replaced={m07: payload("hidden_matrix")}, assignment="modern-attention")
    q = np.random.default_rng(0).normal(size=(1, 1, 8192, 8)).astype(np.float32)
    ceiling = {m07: 128 << 20}
    with IsolatedBackend(root, LIMITS, sandbox=sandbox, ceilings=ceiling) as held:
        with pytest.raises(Exception, match="out of memory: when graded, this stage may allocate 128 MiB") as hit:
            held.run("call", m07, func="tiled_attention", args=[q, q, q], kwargs={"is_causal": True})
        assert hit.value.limit == "memory"
        held.run("call", "m06_sliding_window", func="sliding_window_mask", args=[4, 2])
        assert held.stats["leaving"].get("memory ceiling") == 1 and held.stats["workers"] == 2, held.stats
    with IsolatedBackend(root, replace(LIMITS, check_seconds=30.0, memory_bytes=8 << 30), sandbox=sandbox) as free:
        assert free.run("call", m07, func="tiled_attention", args=[q, q, q], kwargs={"is_causal": True}).shape == \
            q.shape
    with IsolatedBackend(SOLUTIONS, LIMITS, sandbox=sandbox, ceilings=ceiling) as reference:
        assert reference.run("call", m07, func="tiled_attention", args=[q, q, q],
                             kwargs={"is_causal": True, "block_size": 256}).shape == q.shape


# ---------------------------------------------------------------- making files private (the container confinement)

def test_make_private_takes_group_and_other_away_and_keeps_the_way_to_what_boxes_need(tmp_path):
    """A course with the Python installation inside it: the course keeps only the right to pass through (no
    listing), every other entry is private to its owner, the installation is untouched; the system's folders
    and what lies inside a kept folder are never changed."""
    course = tmp_path / "course"
    (course / "submitted" / "alice").mkdir(parents=True)
    (course / "gradebook.db").write_text("x")
    (course / "venv" / "lib").mkdir(parents=True)
    for path in (course, course / "submitted", course / "gradebook.db", course / "venv", course / "venv" / "lib"):
        path.chmod(0o755)
    done = lockdown.make_private([course, "/usr", course / "venv" / "lib"], keep=[course / "venv"])
    assert done == [course]
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    assert mode(course) == 0o711
    assert mode(course / "submitted") == 0o700 and mode(course / "gradebook.db") == 0o700
    assert mode(course / "venv") == 0o755 and mode(course / "venv" / "lib") == 0o755
    assert lockdown.witnesses([course / "submitted"]) == [str(course / "submitted")]
    assert lockdown.witnesses([course]) == [str(course), str(course / "gradebook.db")]
