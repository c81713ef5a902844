"""Stage m02: padding masks and cross-attention.

Spec: CrossAttention(d_in, d_out, num_heads, d_context=None, dropout=0.0, qkv_bias=False) has W_query =
nn.Linear(d_in, d_out), W_key and W_value = nn.Linear(d_context, d_out) (d_context None: d_in), out_proj =
nn.Linear(d_out, d_out). forward(x, context=None, key_padding_mask=None, causal=False): queries from x
(b, n_q, d_in), keys and values from context (b, n_kv, d_context; None: x), scores scaled by 1/sqrt(head_dim);
key_padding_mask (b, n_kv) True = a real key that takes part; causal: query i sees keys 0..i. A query with no
key to attend to gets attention weights 0 (its output is out_proj.bias), never NaN. Dropout acts on the attention
weights in training mode only.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, BROADCAST, About, Attention, Said, assert_close, check_dropout, readings_with
from diagnosis.dropout import eval_dropout_findings
from diagnosis.padding import PaddedAttention, padding_axis_sizes
from suite_runtime.cases import (
    distinct_sizes,
    draw_weights,
    exposing_case,
    linear_shapes,
    normal,
    qkv_shapes,
    random_weights,
)

pytestmark = pytest.mark.padding_and_cross
STAGE = "m02_padding_and_cross"
CLS = "CrossAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 computed in another order than the reference's
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
ERROR_READINGS = readings_with(BROADCAST, padding_axis_sizes)  # (conftest reads a stage's readings here)


def attend(stage, init, weights, x, *, device="cpu", dtype="float32", train=False, seed=None, **inputs):
    """CrossAttention(**init) holding ``weights``, run as forward(x, **inputs)."""
    step = {"method": "forward", "args": [x], "kwargs": inputs}
    [out] = stage.session(CLS, init, weights, steps=[step], device=device, dtype=dtype, train=train, seed=seed)
    return out


def inputs_of(fx, prefix):
    """The forward's stored inputs besides x: context, key_padding_mask, causal."""
    stored = fx.sub(prefix)
    inputs = {name: stored[name] for name in ("context", "key_padding_mask") if name in stored}
    return {**inputs, "causal": bool(stored["causal"])}


def call(init, inputs):
    shown = ", ".join(f"{k}={v}" for k, v in init.items())
    given = ", ".join(f"{k}={np.shape(v) if isinstance(v, np.ndarray) else v}" for k, v in inputs.items())
    return f"CrossAttention({shown}).forward(x, {given})"


def subject(stage, init, inputs, **options):
    """CrossAttention as the diagnoser runs it again (diagnosis.padding): multi-head attention with out_proj, keys
    and values from the context, padding keys hidden, causal as the check's flag, a query with no key getting
    weights 0."""
    spec = Attention(num_heads=init["num_heads"], causal=bool(inputs.get("causal")), empty_rows="zero")
    return PaddedAttention(stage, CLS, init, spec, inputs=inputs, options=options)


def diagnosis(stage, init, weights, x, inputs, rows=slice(None), **options):
    """What a failed check of CrossAttention's output on this case (its tokens ``rows``) is diagnosed with."""
    return subject(stage, init, inputs, **options).evidence(x, weights, rows=rows)


def check_case(stage, init, weights, x, expected, inputs, **options):
    out = attend(stage, init, weights, x, **inputs, **options)
    assert_close(call(init, inputs), out, expected, **FLOAT32,
                 diagnosis=diagnosis(stage, init, weights, x, inputs, **options))
    return out


# ---------------------------------------------------------------- the book's example (public)

@pytest.mark.public
def test_padding_on_the_example(stage, public_fx):
    """Self-attention on the journey sentence and on its first four tokens followed by two padding tokens."""
    check_case(stage, public_fx.init("padded/"), public_fx.sub("padded/weights/"), public_fx["padded/x"],
               public_fx["padded/output"], inputs_of(public_fx, "padded/"))


@pytest.mark.public
def test_cross_attention_on_the_example(stage, public_fx):
    """The journey tokens (width 3) read a context of 4 tokens of width 5, the second one's last padded."""
    check_case(stage, public_fx.init("cross/"), public_fx.sub("cross/weights/"), public_fx["cross/x"],
               public_fx["cross/output"], inputs_of(public_fx, "cross/"))


@pytest.mark.public
def test_left_padding_with_a_causal_mask(stage, public_fx):
    """Two padding tokens, then the journey's first four; causal: the first two queries have nothing to attend
    to, so their outputs are out_proj.bias, and the real tokens' outputs are the unpadded sentence's."""
    init, weights, x, inputs = public_fx.init("left/"), public_fx.sub("left/weights/"), public_fx["left/x"], \
        inputs_of(public_fx, "left/")
    out = check_case(stage, init, weights, x, public_fx["left/output"], inputs)
    bias = weights["out_proj.bias"]
    assert_close("outputs of the two queries with nothing to attend to (expected: out_proj.bias)", out[1, :2],
                 np.broadcast_to(bias, (2, bias.size)), **FLOAT32,
                 diagnosis=[About(out, diagnosis(stage, init, weights, x, inputs))])


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_other_sizes(stage, hidden_fx, case, device):
    check_case(stage, hidden_fx.init(f"{case}/"), hidden_fx.sub(f"{case}/weights/"), hidden_fx[f"{case}/x"],
               hidden_fx[f"{case}/output"], inputs_of(hidden_fx, f"{case}/"), device=device)


def random_case(rng, reference_stage, *, cross):
    """Random sizes, pairwise distinct (batch, heads, head_dim, d_out, d_in, queries, and with cross the context's
    width and length): self-attention, or cross-attention (n_q != n_kv, d_context != d_in)."""
    ranges = dict(b=(1, 3), num_heads=(1, 3), head_dim=(2, 5), d_in=(2, 9), n_q=(2, 9))
    if cross:
        ranges |= dict(d_context=(2, 11), n_kv=(2, 12))
    sizes = distinct_sizes(rng, ranges, lambda s: {"d_out": s["num_heads"] * s["head_dim"]})
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], num_heads=sizes["num_heads"], qkv_bias=bool(rng.integers(2)))
    x = normal(rng, sizes["b"], sizes["n_q"], sizes["d_in"])
    inputs = {}
    if cross:
        init["d_context"] = sizes["d_context"]
        inputs["context"] = normal(rng, sizes["b"], sizes["n_kv"], sizes["d_context"])
    return init, x, draw_weights(rng, reference_stage, CLS, init), inputs


def padding_mask(rng, b, n, *, left=False):
    """(b, n) key_padding_mask of random lengths 1..n (True = real), padding on the right (left: on the left); the
    first sequence has padding when n > 1."""
    lengths = rng.integers(1, n + 1, size=(b, 1))
    lengths[0] = min(lengths[0, 0], max(n - 1, 1))
    positions = np.arange(n)
    return positions >= n - lengths if left else positions < lengths


@pytest.mark.parametrize("cross", [False, True])
def test_random_cases(stage, reference, rng, device, cross):
    """Random sizes (cross: n_q != n_kv and d_context != d_in), random padding, causal or not."""
    ref = reference.stage(STAGE)
    for causal in (False, True):
        init, x, weights, inputs = random_case(rng, ref, cross=cross)
        keys = inputs.get("context", x)
        inputs |= dict(key_padding_mask=padding_mask(rng, keys.shape[0], keys.shape[1], left=causal), causal=causal)
        expected = attend(ref, init, weights, x, **inputs)
        out = check_case(stage, init, weights, x, expected, inputs, device=device)
        assert out.shape == (x.shape[0], x.shape[1], init["d_out"]), (
            f"{call(init, inputs)} has shape {out.shape}, expected (b, n_q, d_out) = "
            f"{(x.shape[0], x.shape[1], init['d_out'])}"
        )


@pytest.mark.parametrize("causal", [False, True])
def test_real_tokens_ignore_appended_padding(stage, reference, rng, causal):
    """Appending padding tokens (any values) marked False changes no real token's output: the outputs are those of
    the unpadded sequence without any mask."""
    ref = reference.stage(STAGE)
    init, x, weights, _ = random_case(rng, ref, cross=False)
    b, n, d_in = x.shape
    padded = np.concatenate([x, normal(rng, b, 3, d_in, scale=5.0)], axis=1)
    inputs = dict(key_padding_mask=np.broadcast_to(np.arange(n + 3) < n, (b, n + 3)).copy(), causal=causal)
    out = attend(stage, init, weights, padded, **inputs)
    assert_close(f"real tokens' outputs of {call(init, inputs)} with 3 padding tokens appended (expected: the outputs "
                 "of the sequence without padding)", out[:, :n], attend(ref, init, weights, x, causal=causal),
                 **FLOAT32, diagnosis=diagnosis(stage, init, weights, padded, inputs, rows=slice(0, n)))


def test_padded_context_changes_nothing(stage, reference, rng):
    """Cross-attention: padding appended to the context and masked leaves every query's output as it was without
    the padding."""
    ref = reference.stage(STAGE)
    init, x, weights, inputs = random_case(rng, ref, cross=True)
    context = inputs["context"]
    b, n_kv, d_context = context.shape
    padded = np.concatenate([context, normal(rng, b, 2, d_context, scale=5.0)], axis=1)
    inputs = dict(context=padded, key_padding_mask=np.broadcast_to(np.arange(n_kv + 2) < n_kv, (b, n_kv + 2)).copy())
    assert_close(f"{call(init, inputs)} with 2 padding tokens appended to the context (expected: the output "
                 "without them)", attend(stage, init, weights, x, **inputs), attend(ref, init, weights, x,
                                                                                     context=context),
                 **FLOAT32, diagnosis=diagnosis(stage, init, weights, x, inputs))


@pytest.mark.parametrize("cross", [False, True])
def test_fully_masked_rows_give_out_proj_bias(stage, reference, rng, cross):
    """A sequence that is all padding: every query of it attends to nothing; its outputs are out_proj.bias,
    finite, and the other sequences' outputs are unchanged."""
    init, x, weights, inputs = random_case(rng, reference.stage(STAGE), cross=cross)
    x = np.concatenate([x, x[:1]])  # one more sequence, a copy of the first
    if cross:
        inputs["context"] = np.concatenate([inputs["context"], inputs["context"][:1]])
    keys = inputs.get("context", x)
    inputs["key_padding_mask"] = np.ones(keys.shape[:2], bool)
    inputs["key_padding_mask"][-1] = False
    out = attend(stage, init, weights, x, **inputs)
    expected = np.concatenate([attend(reference.stage(STAGE), init, weights, x[:-1], **{
        k: v[:-1] for k, v in inputs.items()}), np.broadcast_to(weights["out_proj.bias"], (1, *out.shape[1:]))])
    assert_close(f"{call(init, inputs)}, its last sequence all padding", out, expected, **FLOAT32,
                 diagnosis=diagnosis(stage, init, weights, x, inputs))


@pytest.mark.parametrize("context", ["None", "x"])
def test_context_none_is_self_attention(stage, reference, rng, context):
    """forward(x) and forward(x, context=x) are self-attention (each graded on its own)."""
    ref = reference.stage(STAGE)
    init, x, weights, _ = random_case(rng, ref, cross=False)
    inputs = dict(key_padding_mask=padding_mask(rng, *x.shape[:2]))
    expected = attend(ref, init, weights, x, **inputs)
    if context == "x":
        inputs["context"] = x
    assert_close(f"{call(init, inputs)} (context={context}: self-attention)", attend(stage, init, weights, x, **inputs),
                 expected, **FLOAT32, diagnosis=diagnosis(stage, init, weights, x, inputs))


def test_matches_nn_multihead_attention(stage, rng):
    """Self-attention with padding (d_in == d_out, every sequence at least one real token) equals PyTorch's
    nn.MultiheadAttention, whose key_padding_mask is True where a key is padding: the opposite convention."""
    import torch

    num_heads, d = 2, 8
    init = dict(d_in=d, d_out=d, num_heads=num_heads, qkv_bias=True)
    weights = random_weights(rng, {**qkv_shapes(d, d, True), **linear_shapes("out_proj", d, d)})
    x = normal(rng, 3, 6, d)
    real = padding_mask(rng, 3, 6)
    torch_mha = torch.nn.MultiheadAttention(d, num_heads, batch_first=True).eval()
    stacked = {f"in_proj_{kind}": np.concatenate([weights[f"W_{n}.{kind}"] for n in ("query", "key", "value")])
               for kind in ("weight", "bias")}
    torch_mha.load_state_dict({k: torch.from_numpy(v) for k, v in (stacked | weights).items() if k.startswith(
        ("in_proj", "out_proj"))})
    with torch.no_grad():
        expected = torch_mha(*[torch.from_numpy(x)] * 3, key_padding_mask=torch.from_numpy(~real),
                             need_weights=False)[0].numpy()
    inputs = dict(key_padding_mask=real)
    assert_close(f"{call(init, inputs)} (expected: nn.MultiheadAttention with key_padding_mask=~mask)",
                 attend(stage, init, weights, x, **inputs), expected, **FLOAT32,
                 diagnosis=diagnosis(stage, init, weights, x, inputs))


def test_dropout_acts_on_the_weights_in_training_mode_only(stage):
    """One-hot values and an identity out_proj make the output the attention weights (cases.exposing_case):
    dropout=0.5 drops about half of them and doubles the rest in training mode, nothing in eval mode."""
    mha_init, x, weights = exposing_case(np.random.default_rng(20), num_heads=2, num_tokens=8, batch=32)
    init = dict(d_in=mha_init["d_in"], d_out=mha_init["d_out"], num_heads=2, dropout=0.5)
    plain = subject(stage, init, {}).reference(x, weights, {})
    for seed in (1, 2):
        assert_close(f"{call(init, {})} in eval mode (seed {seed})", attend(stage, init, weights, x, seed=seed), plain,
                     **FLOAT32, diagnosis=[Said(lambda out: eval_dropout_findings(out, plain, 0.5))])
    trained = attend(stage, init, weights, x, train=True, seed=0)
    check_dropout(trained, plain, 0.5, f"{call(init, {})} in training mode",
                  second=lambda rate: (attend(stage, dict(init, dropout=rate), weights, x, train=True, seed=0), plain))


SIZES = {  # the CPU twin keeps the test quick; the CUDA case has Llama's width (4096, 32 heads) and T 4096
    "cpu": dict(b=2, n_q=24, n_kv=40, d_in=64, d_context=48, num_heads=4),
    "cuda": dict(b=1, n_q=4096, n_kv=4096, d_in=4096, d_context=2048, num_heads=32),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, n_q=64, n_kv=64, d_in=256, d_context=128, num_heads=32),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_sized(stage, reference, target, dtype):
    """Cross-attention with padding at scale; bfloat16 against the float32 reference at bf16 tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(21)
    init = dict(d_in=size["d_in"], d_out=size["d_in"], num_heads=size["num_heads"], d_context=size["d_context"],
                qkv_bias=True)
    x = normal(r, size["b"], size["n_q"], size["d_in"])
    inputs = dict(context=normal(r, size["b"], size["n_kv"], size["d_context"]),
                  key_padding_mask=padding_mask(r, size["b"], size["n_kv"]))
    weights = draw_weights(r, reference.stage(STAGE), CLS, init)
    expected = attend(reference.stage(STAGE), init, weights, x, device=device, **inputs)
    assert_close(f"{call(init, inputs)} ({device}, {dtype})",
                 attend(stage, init, weights, x, device=device, dtype=dtype, **inputs), expected, **TOLERANCE[dtype],
                 # (the evidence is computed in NumPy: at the CPU twin's size only)
                 diagnosis=[] if target.cuda else diagnosis(stage, init, weights, x, inputs, device=device))
