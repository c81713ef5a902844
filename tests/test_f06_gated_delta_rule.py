"""Stage f06: linear attention with a gated delta rule (Gated DeltaNet; Qwen3-Next's linear layers).

Spec: gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=None) -> (out, state): q, k (b, h, T, d_k), v (b, h,
T, d_v), g <= 0 and beta in (0, 1) (b, h, T), state (b, h, d_k, d_v); per token, with q scaled by 1/sqrt(d_k):
S <- exp(g_t) S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t. gated_delta_rule_chunked(...,
chunk_size=64, initial_state=None) gives the same out and state chunk by chunk (the last chunk may be shorter).
GatedDeltaNet(d_in, d_out, num_heads): W_query, W_key, W_value (no bias), W_beta and W_gate (num_heads outputs, with
bias), out_proj; q and k L2-normalised per head, beta = sigmoid(W_beta x), g = logsigmoid(W_gate x);
forward(x, use_cache=False, chunk_size=None) (recurrent when chunk_size is None), its cache the state (b, h, d_k,
d_v) in `state`.

Tolerances: float32 against a float64 NumPy recurrence. The chunked form solves a unit lower-triangular system per
chunk; with unit keys and beta in (0, 1) it is well conditioned (its entries are at most 1 in size), so the forms
agree to float32 rounding over a chunk: rtol 1e-4, atol 1e-5 hold with room.
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, linear, split_heads
from suite_runtime.cases import linear_shapes, normal, random_weights

pytestmark = pytest.mark.gated_delta_rule
STAGE = "f06_gated_delta_rule"
CLS = "GatedDeltaNet"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
DECAY_AFTER = ("the state was decayed after the update instead of before it: forget first (S <- exp(g_t) S), then "
               "predict, correct and write")
NO_DELTA = ("the delta rule's correction is missing: write u_t = beta_t (v_t - S^T k_t), the part of v_t the state "
            "does not already predict (writing beta_t v_t is plain linear attention)")
UNDECAYED_PREDICTION = ("the prediction S^T k_t was read from the state before its decay: decay first, then predict "
                        "from the decayed state")
READ_BEFORE_WRITE = "the output read the state before the token's write: o_t = S^T q_t after S includes k_t u_t^T"
NO_QUERY_SCALE = "the queries were not scaled by 1/sqrt(d_k)"
BETA_ON_V_ONLY = ("beta multiplied v_t alone: u_t = beta_t (v_t - S^T k_t), the learning rate scales the whole "
                  "correction")
STATE_NOT_DECAYED = ("the state carried to the next chunk was not decayed: S_end = exp(gamma_C) S0 + (K * exp(gamma_C "
                     "- gamma))^T V_new")
NO_STATE_READ = ("the chunk's outputs left out what they read of the state it started from: O = (Q * exp(gamma)) S0 "
                 "+ ((Q K^T) * Gamma) V_new")
DIAGONAL_IN_A = ("the diagonal of beta_i (k_i . k_i) entered the triangular system: A is strictly lower "
                 "(solve_triangular(..., unitriangular=True) takes the diagonal as 1)")
NO_INTRA_DECAY = ("the decays inside the chunk were left out of Q K^T: multiply it by Gamma[i, j] = exp(gamma_i - "
                  "gamma_j), as A is")


# ---------------------------------------------------------------- NumPy references (float64)

def np_recurrent(q, k, v, g, beta, state=None, mistake=None):
    """The recurrence, token by token; ``mistake`` reproduces one of the typical ones (by its description)."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    b, h, t, d_k = k.shape
    if mistake != NO_QUERY_SCALE:
        q = q / np.sqrt(d_k)
    s = np.zeros((b, h, d_k, v.shape[-1])) if state is None else np.array(state, np.float64)
    out = np.zeros(v.shape)
    for i in range(t):
        decay = np.exp(g[..., i])[..., None, None]
        before = s
        if mistake != DECAY_AFTER:
            s = s * decay
        predicted = np.einsum("bhk,bhkv->bhv", k[..., i, :], before if mistake == UNDECAYED_PREDICTION else s)
        if mistake == NO_DELTA:
            u = beta[..., i, None] * v[..., i, :]
        elif mistake == BETA_ON_V_ONLY:
            u = beta[..., i, None] * v[..., i, :] - predicted
        else:
            u = beta[..., i, None] * (v[..., i, :] - predicted)
        written = s + k[..., i, :, None] * u[..., None, :]
        if mistake == DECAY_AFTER:
            written = written * decay
        out[..., i, :] = np.einsum("bhk,bhkv->bhv", q[..., i, :], s if mistake == READ_BEFORE_WRITE else written)
        s = written
    return out, s


def np_chunked(q, k, v, g, beta, chunk_size, state=None, mistake=None):
    """The chunked form in NumPy, with the chunk mistakes (by description)."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    b, h, t, d_k = k.shape
    q = q / np.sqrt(d_k)
    s = np.zeros((b, h, d_k, v.shape[-1])) if state is None else np.array(state, np.float64)
    out = np.zeros(v.shape)
    for start in range(0, t, chunk_size):
        c = slice(start, min(start + chunk_size, t))
        qc, kc, vc, bc = q[..., c, :], k[..., c, :], v[..., c, :], beta[..., c]
        gamma = np.cumsum(g[..., c], axis=-1)
        size = c.stop - c.start  # (the last chunk may be shorter)
        below = np.tril(np.ones((size, size), bool))
        decay = np.where(below, np.exp(np.where(below, gamma[..., :, None] - gamma[..., None, :], 0)), 0)
        a = bc[..., :, None] * (kc @ kc.swapaxes(-1, -2)) * decay
        a = a if mistake == DIAGONAL_IN_A else np.tril(a, -1)
        system = a + (0 if mistake == DIAGONAL_IN_A else np.eye(size))
        u = np.linalg.solve(system, bc[..., None] * vc)
        w = np.linalg.solve(system, (bc * np.exp(gamma))[..., None] * kc)
        v_new = u - w @ s
        inner = qc @ kc.swapaxes(-1, -2) * (below if mistake == NO_INTRA_DECAY else decay)
        out[..., c, :] = (0 if mistake == NO_STATE_READ else (qc * np.exp(gamma)[..., None]) @ s) + inner @ v_new
        last = gamma[..., -1:]
        written = (kc * np.exp(last - gamma)[..., None]).swapaxes(-1, -2) @ v_new
        s = (s if mistake == STATE_NOT_DECAYED else np.exp(last)[..., None] * s) + written
    return out, s


RECURRENT_MISTAKES = (DECAY_AFTER, NO_DELTA, UNDECAYED_PREDICTION, READ_BEFORE_WRITE, NO_QUERY_SCALE, BETA_ON_V_ONLY)
CHUNK_MISTAKES = (STATE_NOT_DECAYED, NO_STATE_READ, DIAGONAL_IN_A, NO_INTRA_DECAY)


def function_mistakes(inputs, chunk_size=None, part=0):
    """{description: out (part 0) or state (part 1)} of the typical mistakes of the recurrence, and with a
    chunk_size those of the chunked form too."""
    found = {why: np_recurrent(*inputs, mistake=why)[part] for why in RECURRENT_MISTAKES}
    if chunk_size is not None:
        q, k, v, g, beta, state = inputs
        found |= {why: np_chunked(q, k, v, g, beta, chunk_size, state, mistake=why)[part] for why in CHUNK_MISTAKES}
    return found


def random_inputs(rng, b, h, t, d_k, d_v, with_state=True):
    """q, k (unit length), v, g = logsigmoid (forgetting a few % per token), beta = sigmoid, an initial state."""
    q, v = normal(rng, b, h, t, d_k), normal(rng, b, h, t, d_v)
    k = normal(rng, b, h, t, d_k)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = (-np.log1p(np.exp(-rng.normal(3.0, 1.0, size=(b, h, t))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, h, t))))).astype(np.float32)
    state = normal(rng, b, h, d_k, d_v, scale=0.5) if with_state else None
    return q, k, v, g, beta, state


def check_functions(stage, inputs, chunk_sizes, what="", expected=None):
    """Both forms against the NumPy recurrence (or the ``expected`` (out, state)), outputs and final state."""
    q, k, v, g, beta, state = inputs
    expected = expected or np_recurrent(*inputs)
    kwargs = {} if state is None else {"initial_state": state}
    out, final = stage.gated_delta_rule_recurrent(q, k, v, g, beta, **kwargs)
    for part, (name, value) in enumerate((("out", out), ("final state", final))):
        assert_close(f"{what}gated_delta_rule_recurrent: {name}", value, expected[part], **FLOAT32,
                     mistakes=partial(function_mistakes, inputs, None, part))
    for chunk_size in chunk_sizes:
        out, final = stage.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
        for part, (name, value) in enumerate((("out", out), ("final state", final))):
            assert_close(f"{what}gated_delta_rule_chunked(chunk_size={chunk_size}): {name} (expected: the recurrent "
                         "form's)", value, expected[part], **FLOAT32,
                         mistakes=partial(function_mistakes, inputs, chunk_size, part))


def np_layer(x, weights, num_heads, mistake=None, state=None):
    """GatedDeltaNet's forward in NumPy, through np_recurrent: (output, final state)."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape

    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    q, k, v = (split_heads(linear(x, weights, n), num_heads) for n in ("W_query", "W_key", "W_value"))
    beta = 1 / (1 + np.exp(-linear(x, weights, "W_beta").transpose(0, 2, 1)))
    g = -np.log1p(np.exp(-linear(x, weights, "W_gate").transpose(0, 2, 1)))
    out, final = np_recurrent(unit(q), unit(k), v, g, beta, state, mistake)
    return linear(out.transpose(0, 2, 1, 3).reshape(b, t, -1), weights, "out_proj"), final


def layer_mistakes(x, weights, num_heads, rows=slice(None)):
    return {why: np_layer(x, weights, num_heads, why)[0][:, rows] for why in RECURRENT_MISTAKES}


def layer_shapes(d_in, d_out, num_heads, **_):
    return {**{f"{n}.weight": (d_out, d_in) for n in ("W_query", "W_key", "W_value")},
            **linear_shapes("W_beta", d_in, num_heads), **linear_shapes("W_gate", d_in, num_heads),
            **linear_shapes("out_proj", d_out, d_out)}


def layer_weights(rng, init):
    weights = random_weights(rng, layer_shapes(**init))
    weights["W_gate.bias"] = weights["W_gate.bias"] + np.float32(3.0)  # gates near 0.95: a memory of ~20 tokens
    return weights


def cached(x, chunks, chunk_size=None):
    steps, start = [], 0
    for size in chunks:
        steps.append({"method": "forward", "args": [x[:, start:start + size]],
                      "kwargs": {"use_cache": True, "chunk_size": chunk_size}})
        start += size
    return steps


def check_layer(stage, init, x, weights, chunks, what="", **options):
    """The full forward in both forms, then cached decoding in the given chunks: every step equals the full
    forward's rows, and the state is (b, num_heads, head_dim, head_dim) at the end."""
    expected, final = np_layer(x, weights, init["num_heads"])
    steps = [{"method": "forward", "args": [x]}, {"method": "forward", "args": [x], "kwargs": {"chunk_size": 3}},
             *cached(x, chunks, chunk_size=2), {"get": "state"}]
    full, chunked, *outputs, state = stage.session(CLS, init, weights, steps=steps, **options)
    assert_close(f"{what}forward(x)", full, expected, **FLOAT32, mistakes=partial(layer_mistakes, x, weights,
                                                                                  init["num_heads"]))
    assert_close(f"{what}forward(x, chunk_size=3)", chunked, expected, **FLOAT32)
    start = 0
    for k, size in enumerate(chunks):
        rows = slice(start, start + size)
        assert_close(f"{what}cached step {k}: forward(x[:, {start}:{start + size}], use_cache=True, chunk_size=2)",
                     outputs[k], expected[:, rows], **FLOAT32,
                     mistakes=partial(layer_mistakes, x, weights, init["num_heads"], rows),
                     hint="The state after the earlier steps is the cache: start each step from self.state.")
        start += size
    head_dim = init["d_out"] // init["num_heads"]
    assert state is not None and np.shape(state) == (x.shape[0], init["num_heads"], head_dim, head_dim), (
        f"{what}state is {np.shape(state) if state is not None else None} after the cached steps; expected "
        f"(b, num_heads, head_dim, head_dim) = {(x.shape[0], init['num_heads'], head_dim, head_dim)}")
    assert_close(f"{what}state after the cached steps", state, final, **FLOAT32)


def fx_inputs(fx, prefix=""):
    state = fx.sub(prefix).get("state")
    return tuple(fx[f"{prefix}{n}"] for n in ("q", "k", "v", "g", "beta")) + (state,)


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_recurrent_form_on_the_example(stage, public_fx):
    """2 heads, 6 tokens, keys and values of 3 features, from an empty state."""
    check_functions(stage, fx_inputs(public_fx), [], expected=(public_fx.out, public_fx.state_after))


@pytest.mark.public
def test_chunked_form_on_the_example(stage, public_fx):
    """Chunks of 4 tokens (the second chunk has 2) and of 6: the recurrent form's outputs and final state."""
    check_functions(stage, fx_inputs(public_fx), [4, 6], expected=(public_fx.out, public_fx.state_after))


@pytest.mark.public
def test_layer_on_the_example(stage, public_fx):
    """GatedDeltaNet(3, 4, 2) on the journey batch: recurrent, chunked, and decoded 3 + 1 + 1 + 1 tokens at a time."""
    init, x, weights = public_fx.init("layer/"), public_fx["layer/x"], public_fx.sub("layer/weights/")
    check_layer(stage, init, x, weights, [3, 1, 1, 1])
    assert_close("forward(x) (stored)", stage.forward(CLS, init, x, weights), public_fx["layer/output"], **FLOAT32)


# ---------------------------------------------------------------- hidden

def test_stored_case(stage, hidden_fx):
    """20 tokens, keys of 4 and values of 5 features, an initial state; chunks of 1, 7, 20 and 64 tokens."""
    check_functions(stage, fx_inputs(hidden_fx), [1, 7, 20, 64], expected=(hidden_fx.out, hidden_fx.state_after))


def test_random_inputs(stage, rng):
    for _ in range(2):
        b, h, t = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 30))
        inputs = random_inputs(rng, b, h, t, int(rng.integers(1, 9)), int(rng.integers(1, 9)),
                               with_state=bool(rng.integers(2)))
        check_functions(stage, inputs, [int(rng.integers(1, 12)), t], what=f"{t} tokens: ")


def test_the_state_does_not_grow_with_the_text(stage, rng):
    """After 3 tokens and after 40, the cache is the same (b, num_heads, head_dim, head_dim) state, and decoding on
    from it equals the full forward."""
    init = dict(d_in=5, d_out=6, num_heads=2)
    weights, x = layer_weights(rng, init), normal(rng, 1, 42, 5)
    steps = [*cached(x, [3]), {"get": "state"}, *cached(x[:, 3:], [37]), {"get": "state"}, *cached(x[:, 40:], [1, 1])]
    _, short, _, long, *last = stage.session(CLS, init, weights, steps=steps)
    for when, state in (("after 3 tokens", short), ("after 40 tokens", long)):
        assert state is not None and np.shape(state) == (1, 2, 3, 3), (
            f"state {when} has shape {np.shape(state) if state is not None else None}; expected (b, num_heads, "
            "head_dim, head_dim) = (1, 2, 3, 3): a linear attention's cache is its state, whatever the length")
    expected, _ = np_layer(x, weights, 2)
    assert_close("tokens 40 and 41, decoded from the state of 40 tokens", np.concatenate(last, axis=1),
                 expected[:, 40:], **FLOAT32, mistakes=partial(layer_mistakes, x, weights, 2, slice(40, 42)))


@pytest.mark.parametrize("case", ["case0", "case1"])
def test_stored_layers(stage, hidden_fx, case):
    init, x, weights = hidden_fx.init(f"{case}/"), hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    check_layer(stage, init, x, weights, [4, 1, 3, 1], f"{init}: ")


def test_random_layers_against_the_reference(stage, reference, rng, device):
    """Random sizes and chunks; reset_cache() before a second sequence."""
    ref = reference.stage(STAGE)
    num_heads = int(rng.integers(1, 4))
    init = dict(d_in=int(rng.integers(2, 7)), d_out=num_heads * int(rng.integers(1, 4)), num_heads=num_heads)
    weights = layer_weights(rng, init)
    t = int(rng.integers(4, 12))
    first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
    chunks = [t - 3, 1, 2]
    steps = [*cached(first, chunks), {"method": "reset_cache"}, *cached(second, chunks[::-1], chunk_size=2)]
    outputs = stage.session(CLS, init, weights, steps=steps, device=device)
    [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [second]}])
    got = np.concatenate(outputs[len(chunks) + 1:], axis=1)
    assert_close(f"{init}: the second sequence, after reset_cache()", got, expected, **FLOAT32,
                 hint="reset_cache() empties the state (None): the next sequence starts from nothing.")
    check_layer(stage, init, first, weights, chunks, f"{init}: ", device=device)


def torch_recurrent(inputs, device):
    """The test's own float32 recurrence on ``device``, for the large case."""
    import torch

    q, k, v, g, beta = (torch.from_numpy(a).to(device) for a in inputs)
    q = q / q.shape[-1] ** 0.5
    s = torch.zeros(*k.shape[:2], k.shape[-1], v.shape[-1], device=device)
    out = torch.empty_like(v)
    for i in range(k.shape[2]):
        s = s * torch.exp(g[..., i])[..., None, None]
        u = beta[..., i, None] * (v[..., i, :] - torch.einsum("bhk,bhkv->bhv", k[..., i, :], s))
        s = s + k[..., i, :, None] * u[..., None, :]
        out[..., i, :] = torch.einsum("bhk,bhkv->bhv", q[..., i, :], s)
    return out.cpu().numpy(), s.cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is a Qwen3-Next linear layer's 32 value heads of 128
    # over 4096 tokens, in chunks of 64 (as its kernels)
    "cpu": dict(b=1, h=4, t=128, d=16, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, h=32, t=4096, d=128, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, h=32, t=128, d=32, dtypes=("bfloat16",)),  # two chunks of 64
}


def test_qwen3_next_sized_chunks(stage, target):
    """The chunked form over a long sequence in chunks of 64, in bfloat16 (and float32 in the CPU twin), against the
    test's own float32 recurrence, at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    inputs = random_inputs(np.random.default_rng(601), size["b"], size["h"], size["t"], size["d"], size["d"],
                           with_state=False)[:5]
    out, state = torch_recurrent(inputs, device)
    for dtype in size["dtypes"]:
        got, final = stage.session(steps=[{"function": "gated_delta_rule_chunked", "args": list(inputs),
                                           "kwargs": {"chunk_size": 64}}], device=device, dtype=dtype)[0]
        assert_close(f"{device}, {dtype}: gated_delta_rule_chunked(chunk_size=64): out", got, out, **TOLERANCE[dtype])
        assert_close(f"{device}, {dtype}: its final state", final, state, **TOLERANCE[dtype])
