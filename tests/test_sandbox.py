"""grader.sandbox: the isolated backend gives LocalBackend's answers and survives hostile code.

Every test is marked ``kit``: it checks the grading machinery against the
reference, so it runs only when the implementation under test is solutions/.
Limits are short (3 s wall) so that the whole file stays fast; the backends
are shared per module because each start imports torch (~2 s).
"""
from __future__ import annotations

import json
import os
import shutil
import textwrap
import warnings

import numpy as np
import pytest

grader = pytest.importorskip("grader")  # instructor side only
from grader import EXERCISES, FIXTURES, KIT, SOLUTIONS  # noqa: E402
from grader.kit import adapters, reference, stages  # noqa: E402
from grader.sandbox import IsolatedBackend  # noqa: E402

pytestmark = pytest.mark.kit

SubmissionError = adapters().SubmissionError
WALL = 3.0
LIMITS = dict(wall_seconds=WALL, memory_bytes=2 << 30, output_bytes=64 << 10, processes=48)
STRONG = ("namespaces", "userns")  # confinements that hide the file system

# Stage 1 of the hostile submission: the reference plus functions that misbehave when
# called (the adapter's "call" operation reaches any function of a stage module).
HOSTILE_CALLS = '''
import ctypes, os, socket, sys, time, json
import numpy as np


def spin():
    while True:
        pass


def eat_memory():
    hoard = []
    while True:
        # 256 MiB at a time; RLIMIT_AS counts reserved memory, so pages need not be
        # written (writing 2 GiB takes seconds on a small VM).
        hoard.append(torch.empty(1 << 26))


def leave_quietly():
    sys.exit(0)


def leave_abruptly():
    os._exit(3)


def crash():
    ctypes.string_at(0)  # read address 0: SIGSEGV


def shout():
    line = "x" * (1 << 20)
    for _ in range(1024):  # 1 GiB
        sys.stdout.write(line)
    return torch.zeros(1)


def fork_loop():
    made = 0
    for _ in range(500):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    return torch.tensor(made)


def tamper():
    """Patch the libraries and the adapter; the parent must not notice beyond the returned values."""
    import adapters
    np.allclose = np.array_equal = lambda *a, **k: True
    np.testing.assert_allclose = lambda *a, **k: None
    torch.allclose = lambda *a, **k: True
    adapters.to_plain = lambda value, what: "tampered"
    return torch.full((3,), 7.0)


def forge():
    """Break the child's wire format: the parent must reject the answer, not believe it."""
    json.dumps = lambda *a, **k: '{"kind": "result", "value": "forged"}'
    return torch.zeros(1)


def read_bytes(path):
    with open(path, "rb") as handle:
        return torch.tensor(list(handle.read(64)), dtype=torch.uint8)


def write_file(path):
    with open(path, "w") as handle:
        handle.write("pwned")
    return torch.tensor(os.path.exists(path))


def list_dir(path):
    # Entries a learner could have made: root's are the sandbox's own (a venv bound under /tmp).
    return torch.tensor(sum(e.stat(follow_symlinks=False).st_uid != 0 for e in os.scandir(path)))


def connect():
    socket.create_connection(("1.1.1.1", 80), timeout=1)
    return torch.tensor(True)


def whoami():
    return torch.tensor([os.getuid(), os.getgid()])
'''

# Stages 2 to 4 misbehave at import; stage 6 is the stub of exercises/.
HOSTILE_IMPORTS = {
    "s02_normalization": "while True:\n    pass\n",
    "s03_context_vectors": "import os\nos._exit(0)\n",
    "s04_trainable_projections": "import sys\nsys.exit(0)\n",
}


def same(actual, expected, where="result"):
    """Identical plain values: same types, same structure, arrays equal in dtype, shape and bits."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert np.array_equal(actual, expected, equal_nan=True), where
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
def isolated_reference():
    with IsolatedBackend(SOLUTIONS, **LIMITS) as backend:
        yield backend


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("submission")
    for name in stages():
        shutil.copyfile(SOLUTIONS / f"{name}.py", root / f"{name}.py")
    s01 = root / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + textwrap.dedent(HOSTILE_CALLS))
    for name, code in HOSTILE_IMPORTS.items():
        (root / f"{name}.py").write_text(code)
    shutil.copyfile(EXERCISES / "s06_causal_mask.py", root / "s06_causal_mask.py")
    return root


@pytest.fixture(scope="module")
def hostile(hostile_root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degraded confinement is reported by test_confinement
        with IsolatedBackend(hostile_root, **LIMITS) as backend:
            yield backend


def call(backend, func, *args, module="s01_attention_scores"):
    return backend.run("call", module, func=func, args=args)


def good_call_works(backend, module="s01_attention_scores"):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    same(backend.run("call", module, func="attention_scores_matmul", args=(x, x[0])), x @ x[0])


def random_weights(local, module, cls, init):
    rng = np.random.default_rng(0)
    shapes = local.run("inspect", module, cls=cls, init=init)["parameters"]
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


# ---------------------------------------------------------------- same answers as LocalBackend

def test_answers_are_identical_to_the_local_backend(isolated_reference):
    local = reference().backend
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    mha = dict(d_in=4, d_out=6, context_length=5, dropout=0.0, num_heads=2)
    cases = [
        ("call", "s01_attention_scores", dict(func="attention_scores_loop", args=(x[0], x[0, 1]))),
        ("call", "s02_normalization", dict(func="softmax_by_hand", args=(x[0],), kwargs={"dim": 0})),
        ("call", "s07_dropout", dict(func="dropout_by_hand", args=(np.ones((4, 4), np.float32), 0.5), seed=123)),
        ("forward", "s08_causal_attention", dict(
            cls="CausalAttention", init=dict(d_in=4, d_out=3, context_length=5, dropout=0.0), x=x,
            weights=random_weights(local, "s08_causal_attention", "CausalAttention",
                                   dict(d_in=4, d_out=3, context_length=5, dropout=0.0)))),
        ("forward", "s10_multihead_attention", dict(
            cls="MultiHeadAttention", init=mha, x=x,
            weights=random_weights(local, "s10_multihead_attention", "MultiHeadAttention", mha))),
        ("heads_forward", "s09_multihead_wrapper", dict(
            cls="MultiHeadAttentionWrapper", init=mha, x=x,
            weights=random_weights(local, "s09_multihead_wrapper", "MultiHeadAttentionWrapper", mha))),
        ("inspect", "s11_other_forms", dict(cls="MultiHeadAttentionCombinedQKV", init=mha)),
        ("transfer_v2_to_v1", "s05_self_attention", dict(
            d_in=4, d_out=3, x=x[0],
            v2_weights=random_weights(local, "s05_self_attention", "SelfAttention_v2", dict(d_in=4, d_out=3)))),
    ]
    for op, module, kwargs in cases:
        same(isolated_reference.run(op, module, **kwargs), local.run(op, module, **kwargs), f"{op} {module}")


def test_adapter_errors_are_the_local_backend_errors(isolated_reference):
    local = reference().backend
    with pytest.raises(SubmissionError) as expected:
        local.run("call", "s01_attention_scores", func="no_such_function")
    with pytest.raises(SubmissionError) as actual:
        isolated_reference.run("call", "s01_attention_scores", func="no_such_function")
    assert str(actual.value) == str(expected.value)
    with pytest.raises(ValueError):
        isolated_reference.run("call", "../solutions/s01", func="x")


def test_confinement(isolated_reference):
    """On a machine like the CI's (root, util-linux unshare) the strongest confinement holds."""
    good_call_works(isolated_reference)
    if os.geteuid() == 0 and shutil.which("unshare"):
        assert isolated_reference.mode == "namespaces", isolated_reference.degraded


# ---------------------------------------------------------------- the wire format

def test_the_wire_format_round_trips_plain_values():
    from grader.sandbox_child import decode, encode

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
def test_the_parent_rejects_anything_but_plain_data(data, blobs):
    from grader.sandbox_child import ProtocolError, decode

    with pytest.raises(ProtocolError):
        decode(data, blobs)


# ---------------------------------------------------------------- learner errors

def test_the_stub_message_comes_through(hostile):
    with pytest.raises(SubmissionError) as info:
        hostile.run("call", "s06_causal_mask", func="causal_weights_simple", args=(np.ones((3, 3), np.float32),))
    message = str(info.value)
    assert message.startswith("NotImplementedError: s06_causal_mask: causal_weights_simple: ")
    assert 'File "s06_causal_mask.py", line' in message  # the learner's frame, from the short traceback


def test_infinite_loop_at_call_time_hits_the_wall_clock(hostile):
    with pytest.raises(SubmissionError, match=r"s01_attention_scores: time limit of 3 s exceeded — an infinite loop"):
        call(hostile, "spin")
    good_call_works(hostile)  # restarted


def test_memory_bomb_hits_the_memory_limit(hostile):
    with pytest.raises(SubmissionError, match=r"memory limit of 2 GiB exceeded \((MemoryError|RuntimeError)"):
        call(hostile, "eat_memory")
    good_call_works(hostile)


@pytest.mark.parametrize("func, code", [("leave_quietly", 0), ("leave_abruptly", 3)])
def test_exiting_is_reported(hostile, func, code):
    with pytest.raises(SubmissionError, match=f"exited with code {code} before answering"):
        call(hostile, func)
    good_call_works(hostile)


def test_segfault_is_reported(hostile):
    with pytest.raises(SubmissionError, match="died with signal SIGSEGV"):
        call(hostile, "crash")
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


def test_a_fork_loop_is_bounded(hostile):
    made = int(call(hostile, "fork_loop"))
    assert 0 < made < LIMITS["processes"]
    good_call_works(hostile)  # the sleeping children do not block the worker
    uid = hostile._child.uid
    hostile.close()  # kills the whole pid namespace; the next test starts a new child
    if uid is not None:
        assert uid not in process_owners()


def process_owners():
    owners = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                owners += [int(line.split()[1]) for line in status if line.startswith("Uid:")]
        except OSError:
            pass
    return owners


def test_tampering_in_the_child_reaches_only_the_returned_values(hostile):
    # The learner's patched adapter decides what its own stage answers (already this call)...
    assert call(hostile, "tamper") == "tampered"
    assert call(hostile, "attention_scores_matmul", np.eye(2, dtype=np.float32), np.ones(2, np.float32)) == "tampered"
    # ...while this process's NumPy and json are untouched.
    assert not np.allclose(np.zeros(2), np.ones(2)) and json.dumps(1) == "1"
    # A forged reply is rejected (and costs a restart).
    with pytest.raises(SubmissionError, match="the answer could not be read"):
        call(hostile, "forge")
    # ...but another stage gets a fresh worker from the clean zygote.
    mha = dict(d_in=2, d_out=2, context_length=3, dropout=0.0, num_heads=1)
    assert "parameters" in hostile.run("inspect", "s10_multihead_attention", cls="MultiHeadAttention", init=mha)
    good_call_works(hostile)


LEAVES_TRACES = '''

def draw():
    torch.ones(512, 512) @ torch.ones(512, 512)  # with several threads, torch starts its pool (allowed)
    return torch.rand(3)  # unseeded: from whatever random state the stage starts with


def patch():
    import threading, time
    torch.softmax = lambda scores, dim=-1: torch.zeros_like(scores)
    torch.set_default_dtype(torch.float64)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return torch.zeros(1)
'''


def test_a_worker_serves_the_next_stage_only_if_the_last_left_no_trace(tmp_path):
    for name in ("s01_attention_scores", "s02_normalization"):
        shutil.copyfile(SOLUTIONS / f"{name}.py", tmp_path / f"{name}.py")
    s01 = tmp_path / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + LEAVES_TRACES)
    scores = np.array([1.0, 2.0, 3.0], np.float32)
    softmax = np.exp(scores) / np.exp(scores).sum()
    with IsolatedBackend(tmp_path, **LIMITS) as backend:
        first = call(backend, "draw")
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   softmax, rtol=1e-6)
        # Back to stage 1 in the same worker, from the same random state as a fresh fork.
        same(call(backend, "draw"), first)
        assert backend.stats["workers"] == 1 and backend.stats["stages"] == 3
        if backend.mode not in STRONG:
            pytest.skip(f"without a private /proc (mode {backend.mode!r}) every stage gets a fresh worker")
        call(backend, "patch")  # torch.softmax replaced, float64 by default: the next stage must not see it
        np.testing.assert_allclose(backend.run("call", "s02_normalization", func="softmax_torch", args=(scores,)),
                                   softmax, rtol=1e-6)
        assert backend.stats["workers"] == 2
        assert {"names of torch", "torch modes", "python threads", "threads"} <= set(backend.stats["leaving"])


def test_import_time_failures_cost_only_their_stage(hostile):
    with pytest.raises(SubmissionError, match="s02_normalization: time limit of 3 s exceeded"):
        hostile.run("call", "s02_normalization", func="softmax_torch", args=(np.ones(3, np.float32),))
    for module in ("s03_context_vectors", "s04_trainable_projections"):
        with pytest.raises(SubmissionError, match=r"exited with code 0 before answering \(sys.exit/os._exit at import"):
            hostile.run("call", module, func="anything")
    good_call_works(hostile)
    good_call_works(hostile, module="s01_attention_scores")


# ---------------------------------------------------------------- what the child can reach

SECRETS = [
    SOLUTIONS / "s01_attention_scores.py",
    FIXTURES / "hidden" / "s01_attention_scores.npz",
    KIT / "tests" / "test_s01_attention_scores.py",
]


def strong(backend):
    good_call_works(backend)
    if backend.mode not in STRONG:
        pytest.skip(f"the sandbox runs in degraded mode {backend.mode!r} on this machine")


@pytest.mark.parametrize("secret", SECRETS, ids=lambda p: p.name)
def test_the_kit_is_out_of_reach(hostile, secret):
    strong(hostile)
    assert secret.is_file()
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "read_bytes", str(secret))


def test_other_submissions_are_out_of_reach(hostile, hostile_root):
    strong(hostile)
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "list_dir", str(hostile_root.parent))
    with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError)"):
        call(hostile, "read_bytes", str(hostile_root / "s01_attention_scores.py"))


def test_writes_land_nowhere_outside(hostile, hostile_root):
    strong(hostile)
    for target in (KIT / "pwned.txt", SOLUTIONS / "pwned.txt", hostile_root / "pwned.txt"):
        with pytest.raises(SubmissionError, match=r"^(FileNotFoundError|PermissionError|OSError)"):
            call(hostile, "write_file", str(target))
        assert not target.exists()
    # The private /tmp works (and is the child's own).
    assert bool(call(hostile, "write_file", "/tmp/scratch.txt"))
    with pytest.raises(SubmissionError, match=r"^(OSError|PermissionError)"):
        call(hostile, "write_file", "/sandbox/submission/s01_attention_scores.py")  # read-only copy


def test_no_network_and_no_root(hostile):
    strong(hostile)
    with pytest.raises(SubmissionError, match=r"^(OSError|PermissionError|TimeoutError|ConnectionError)"):
        call(hostile, "connect")
    if hostile.mode == "namespaces":
        assert (call(hostile, "whoami") >= 1_000_000).all()


def test_the_unprivileged_fallback_also_hides_the_kit(hostile_root):
    """userns is what an instructor without root gets; root can exercise it too."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare here")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            backend = IsolatedBackend(hostile_root, confine="userns", **LIMITS)
            good_call_works(backend)
        except Exception as exc:
            pytest.skip(f"user namespaces unavailable here: {exc}")
    with backend:
        for secret in (SECRETS[0], hostile_root / "s01_attention_scores.py"):
            with pytest.raises(SubmissionError, match="^FileNotFoundError"):
                call(backend, "read_bytes", str(secret))


# ---------------------------------------------------------------- warm reuse across submissions

def test_a_warm_child_serves_the_next_submission_and_forgets_the_last(hostile_root, tmp_path):
    """keep_warm(): a closed backend's zygote serves the next submission, which sees only its own
    modules and none of what the previous one left in /tmp."""
    from grader.sandbox import discard_warm, keep_warm

    other = tmp_path / "other"
    shutil.copytree(hostile_root, other)
    (other / "s02_normalization.py").write_text("# the second submission's own s02\n")
    keep_warm()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with IsolatedBackend(hostile_root, **LIMITS) as first:
                good_call_works(first)
                if first.mode not in STRONG:
                    pytest.skip(f"warm reuse needs a pid namespace (confinement here: {first.mode})")
                assert bool(call(first, "write_file", "/tmp/left-behind.txt"))
            with IsolatedBackend(other, **LIMITS) as second:
                good_call_works(second)
                assert second.stats == {**second.stats, "starts": 0, "reused": 1}
                assert int(call(second, "list_dir", "/tmp")) == 0
                seen = call(second, "read_bytes", "/sandbox/submission/s02_normalization.py")
                assert bytes(seen.tolist()) == b"# the second submission's own s02\n"[:64]
            with IsolatedBackend(hostile_root, **dict(LIMITS, memory_bytes=3 << 30)) as third:
                good_call_works(third)
                assert third.stats["starts"] == 1, "a child with other limits must not be reused"
            with IsolatedBackend(hostile_root, **LIMITS) as fourth:
                good_call_works(fourth)
                assert fourth.stats["reused"] == 1
                with pytest.raises(SubmissionError, match="time limit"):  # the limits hold in a reused child
                    call(fourth, "spin")
    finally:
        keep_warm(False)
        discard_warm()
