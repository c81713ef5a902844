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
import numpy as np
import pytest

from diagnosis import BFLOAT16, Probed, Said, Searched, assert_close
from diagnosis import caches as C
from diagnosis import recurrence as R
from diagnosis.modules import module_probes
from diagnosis.subjects import Deferred
from suite_runtime.cases import linear_shapes, normal, pairwise_distinct, random_weights

pytestmark = pytest.mark.gated_delta_rule
STAGE = "f06_gated_delta_rule"
CLS = "GatedDeltaNet"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
FORMS = ("recurrent", "chunked")
# What lets a token's output depend on later tokens in a recurrence (no mask: an order of operations).
FUTURE = ("the recurrence reads tokens it has not reached yet: token t's output comes from the state after tokens "
          "0..t only (a sum or a matrix product over the whole sequence, or a chunk's outputs without the causal "
          "Gamma, lets later tokens in)")


# ---------------------------------------------------------------- what a failed check is diagnosed with

def function_diagnosis(stage, inputs, form, chunk_size=None, part=0):
    """What a failed check of a form's output (part 0) or final state (part 1) is diagnosed with: the form's switches
    (diagnosis.recurrence) searched, the recurrence's properties read from one run of the learner's form on inputs of
    the probe's own, and the state's size."""
    def make():
        q, k, v, g, beta, state = inputs
        switches = R.RECURRENT if form == "recurrent" else R.CHUNKED
        if state is not None:
            switches = [*switches, R.INITIAL]

        def compute(choices):
            if form == "recurrent":
                return R.recurrent(q, k, v, g, beta, state, choices)[part]
            return R.chunked(q, k, v, g, beta, chunk_size, state, choices)[part]

        def probe():
            case = R.probe_case()
            *args, initial = case
            if form == "recurrent":
                out, _ = stage.gated_delta_rule_recurrent(*args, initial_state=initial)
            else:
                out, _ = stage.gated_delta_rule_chunked(*args, chunk_size=1, initial_state=initial)
            return R.recurrence_findings(out, *case)

        def size(actual):
            b, h, _, d_k = np.shape(k)
            return R.state_findings(actual, b, h, d_k, np.shape(v)[-1]) if part == 1 else []

        return [Searched(compute, switches, "your " + ("outputs" if part == 0 else "final state")),
                Probed([probe]), Said(size)]

    return [Deferred(make)]


def check_functions(stage, inputs, form, chunk_sizes=(), what="", expected=None):
    """One form against the NumPy recurrence (or the ``expected`` (out, state)), outputs and final state."""
    q, k, v, g, beta, state = inputs
    expected = expected or R.recurrent(*inputs)
    kwargs = {} if state is None else {"initial_state": state}
    if form == "recurrent":
        runs = [(None, stage.gated_delta_rule_recurrent(q, k, v, g, beta, **kwargs))]
    else:
        runs = [(size, stage.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=size, **kwargs))
                for size in chunk_sizes]
    for size, (out, final) in runs:
        call = "gated_delta_rule_recurrent" if size is None else f"gated_delta_rule_chunked(chunk_size={size})"
        for part, (name, value) in enumerate((("out", out), ("final state", final))):
            assert_close(f"{what}{call}: {name}", value, expected[part], **FLOAT32,
                         diagnosis=function_diagnosis(stage, inputs, form, size, part))


def random_inputs(rng, b, h, t, d_k, d_v, with_state=True):
    """q, k (unit length), v, g = logsigmoid (forgetting a few % per token), beta = sigmoid, an initial state."""
    q, v = normal(rng, b, h, t, d_k), normal(rng, b, h, t, d_v)
    k = normal(rng, b, h, t, d_k)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = (-np.log1p(np.exp(-rng.normal(3.0, 1.0, size=(b, h, t))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, h, t))))).astype(np.float32)
    state = normal(rng, b, h, d_k, d_v, scale=0.5) if with_state else None
    return q, k, v, g, beta, state


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


def layer_diagnosis(stage, init, x, weights, form, chunks=None, rows=slice(None)):
    """What a failed check of the layer's output (``rows`` of a decoding in ``chunks``; None: one forward) is
    diagnosed with: the layer's and the form's switches searched, and the probes of every module."""
    def make():
        chunk_size = None if form == "recurrent" else (2 if chunks else 3)

        def compute(choices):
            return R.layer(x, weights, init["num_heads"], choices, chunks, chunk_size)[0][:, rows]

        def run(a, dtype="float32"):
            step = {"method": "forward", "args": [a], "kwargs": {"chunk_size": chunk_size}}
            return stage.session(CLS, init, weights, steps=[step], dtype=dtype)[0]

        switches = R.layer_switches(init["num_heads"], form == "chunked", bool(chunks and len(chunks) > 1))
        cache = [lambda: state_findings(stage, init, x, weights, form, chunks, run)] if chunks and len(chunks) > 1 \
            else []
        return [Searched(compute, switches, "your output"),
                Probed([*cache, *module_probes(run, x, run64=lambda: run(x, "float64"), future=FUTURE,
                                               mechanism="recurrence", must_see=False)])]
        # (must_see False: a token's trace may decay below any tolerance)

    return [Deferred(make)]


STATE = ("the state a cached step starts from: the one the last step left (self.state), given to the form as its "
         "initial_state, and the one it leaves")


def state_findings(stage, init, x, weights, form, chunks, run):
    """The cache's probes (diagnosis.caches) of a recurrence, whose cache is its state: the form's cached steps
    against its own forward without the cache, and against the other form's cached steps (each form is its own code
    path: one that carries the state while the other does not says which path drops it)."""
    right = R.layer(x, weights, init["num_heads"])[0]

    def steps_of(which):
        size = None if which == "recurrent" else 2
        return stage.session(CLS, init, weights, steps=cached(x, chunks, chunk_size=size))

    mine, own = steps_of(form), run(x)
    found = C.session_findings(mine, own, right, chunks, causes=(STATE,), what=f"your {form} form's cached steps",
                               mechanism="recurrence")
    other = "chunked" if form == "recurrent" else "recurrent"
    decided = C.other_path_findings(
        f"{form} form", f"{other} form", steps_of(other), own, right, chunks,
        f"the {form} path of forward(use_cache=True) does not start from the cached state or does not keep the one it "
        f"leaves: give self.state to the {form} form as its initial_state, and store the state it returns",
        mechanism="recurrence")
    if decided:  # (it decides what the steps' reading leaves open)
        found = [C.Finding(f.shows, (), f.mechanism, f.source, f.weight) for f in found]
    return found + decided


def check_layer(stage, init, x, weights, chunks, form, what="", **options):
    """One form of the layer: the full forward, then cached decoding in the given chunks (every step equals the full
    forward's rows), and the state, (b, num_heads, head_dim, head_dim), at the end."""
    expected, final = R.layer(x, weights, init["num_heads"])
    chunk_size = None if form == "recurrent" else 3
    steps = [{"method": "forward", "args": [x], "kwargs": {"chunk_size": chunk_size}},
             *cached(x, chunks, chunk_size=None if form == "recurrent" else 2), {"get": "state"}]
    full, *outputs, state = stage.session(CLS, init, weights, steps=steps, **options)
    assert_close(f"{what}forward(x, chunk_size={chunk_size})", full, expected, **FLOAT32,
                 diagnosis=layer_diagnosis(stage, init, x, weights, form))
    start = 0
    for k, size in enumerate(chunks):
        rows = slice(start, start + size)
        assert_close(f"{what}cached step {k}: forward(x[:, {start}:{start + size}], use_cache=True, "
                     f"chunk_size={None if form == 'recurrent' else 2}) (the state after the earlier steps is the "
                     "cache)", outputs[k], expected[:, rows], **FLOAT32,
                     diagnosis=layer_diagnosis(stage, init, x, weights, form, chunks, rows))
        start += size
    head_dim = init["d_out"] // init["num_heads"]
    assert state is not None and np.shape(state) == (x.shape[0], init["num_heads"], head_dim, head_dim), (
        f"{what}state is {np.shape(state) if state is not None else None} after the cached steps; expected "
        f"(b, num_heads, head_dim, head_dim) = {(x.shape[0], init['num_heads'], head_dim, head_dim)}: a linear "
        "attention's cache is its state, whatever the length")
    chunk_size = None if form == "recurrent" else 2
    assert_close(f"{what}state after the cached steps", state, final, **FLOAT32, diagnosis=[Deferred(lambda: [Searched(
        lambda choices: R.layer(x, weights, init["num_heads"], choices, chunks, chunk_size)[1],
        R.layer_switches(init["num_heads"], form == "chunked", len(chunks) > 1), "your state")])])


def fx_inputs(fx, prefix=""):
    state = fx.sub(prefix).get("state")
    return tuple(fx[f"{prefix}{n}"] for n in ("q", "k", "v", "g", "beta")) + (state,)


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_recurrent_form_on_the_example(stage, public_fx):
    """2 heads, 6 tokens, keys of 3 and values of 4 features, from an empty state."""
    check_functions(stage, fx_inputs(public_fx), "recurrent", expected=(public_fx.out, public_fx.state_after))


@pytest.mark.public
def test_chunked_form_on_the_example(stage, public_fx):
    """Chunks of 4 tokens (the second chunk has 2) and of 6: the recurrence's outputs and final state."""
    check_functions(stage, fx_inputs(public_fx), "chunked", [4, 6], expected=(public_fx.out, public_fx.state_after))


@pytest.mark.public
@pytest.mark.parametrize("form", FORMS)
def test_layer_on_the_example(stage, public_fx, form):
    """GatedDeltaNet(3, 20, 4) on the journey batch, each form on its own: the full forward, then decoded 3 + 1 + 1 + 1
    tokens at a time."""
    init, x, weights = public_fx.init("layer/"), public_fx["layer/x"], public_fx.sub("layer/weights/")
    check_layer(stage, init, x, weights, [3, 1, 1, 1], form)


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("form", FORMS)
def test_stored_case(stage, hidden_fx, form):
    """20 tokens, keys of 4 and values of 5 features, an initial state; chunks of 1, 7, 20 and 64 tokens."""
    check_functions(stage, fx_inputs(hidden_fx), form, [1, 7, 20, 64], expected=(hidden_fx.out,
                                                                                 hidden_fx.state_after))


@pytest.mark.parametrize("form", FORMS)
def test_random_inputs(stage, rng, form):
    for _ in range(2):
        sizes = pairwise_distinct(rng, lambda r: dict(b=int(r.integers(1, 4)), h=int(r.integers(1, 4)),
                                                      t=int(r.integers(4, 30)), d_k=int(r.integers(2, 9)),
                                                      d_v=int(r.integers(2, 9))))
        inputs = random_inputs(rng, sizes["b"], sizes["h"], sizes["t"], sizes["d_k"], sizes["d_v"],
                               with_state=bool(rng.integers(2)))
        check_functions(stage, inputs, form, [int(rng.integers(1, 12)), sizes["t"]], what=f"{sizes['t']} tokens: ")


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
    expected, _ = R.layer(x, weights, 2)
    assert_close("tokens 40 and 41, decoded from the state of 40 tokens", np.concatenate(last, axis=1),
                 expected[:, 40:], **FLOAT32,
                 diagnosis=layer_diagnosis(stage, init, x, weights, "recurrent", [3, 37, 1, 1], slice(40, 42)))


@pytest.mark.parametrize("case", ["case0", "case1"])
@pytest.mark.parametrize("form", FORMS)
def test_stored_layers(stage, hidden_fx, case, form):
    init, x, weights = hidden_fx.init(f"{case}/"), hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    check_layer(stage, init, x, weights, [4, 1, 3, 1], form, f"{init}: ")


@pytest.mark.parametrize("form", FORMS)
def test_random_layers_against_the_reference(stage, reference, rng, device, form):
    """Random sizes and chunks; reset_cache() before a second sequence."""
    ref = reference.stage(STAGE)
    sizes = pairwise_distinct(rng, lambda r: dict(num_heads=int(r.integers(2, 4)), head_dim=int(r.integers(2, 5)),
                                                  d_in=int(r.integers(2, 9)), b=int(r.integers(1, 4)),
                                                  t=int(r.integers(5, 12))))
    init = dict(d_in=sizes["d_in"], d_out=sizes["num_heads"] * sizes["head_dim"], num_heads=sizes["num_heads"])
    weights = layer_weights(rng, init)
    t = sizes["t"]
    first, second = normal(rng, sizes["b"], t, init["d_in"]), normal(rng, sizes["b"], t, init["d_in"])
    chunks = [t - 3, 1, 2]
    chunk_size = None if form == "recurrent" else 2
    steps = [*cached(first, chunks, chunk_size), {"method": "reset_cache"}, *cached(second, chunks[::-1], chunk_size)]
    outputs = stage.session(CLS, init, weights, steps=steps, device=device)
    [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [second]}])
    got = np.concatenate(outputs[len(chunks) + 1:], axis=1)
    assert_close(f"{init}: the second sequence, after reset_cache() (which empties the state: the next sequence "
                 "starts from nothing)", got, expected, **FLOAT32,
                 diagnosis=layer_diagnosis(stage, init, second, weights, form, chunks[::-1]))
    check_layer(stage, init, first, weights, chunks, form, f"{init}: ", device=device)


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
