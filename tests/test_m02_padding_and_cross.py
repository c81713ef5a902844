"""Stage m02: padding masks and cross-attention.

Spec: CrossAttention(d_in, d_out, num_heads, d_context=None, dropout=0.0, qkv_bias=False) has W_query =
nn.Linear(d_in, d_out), W_key and W_value = nn.Linear(d_context, d_out) (d_context None: d_in), out_proj =
nn.Linear(d_out, d_out). forward(x, context=None, key_padding_mask=None, causal=False): queries from x
(b, n_q, d_in), keys and values from context (b, n_kv, d_context; None: x), scores scaled by 1/sqrt(head_dim);
key_padding_mask (b, n_kv) True = a real key that takes part; causal: query i sees keys 0..i. A query with no
key to attend to gets attention weights 0 (its output is out_proj.bias), never NaN.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, check_dropout, linear, safe_softmax, softmax
from suite_runtime.cases import draw_weights, exposing_case, linear_shapes, normal, qkv_shapes, random_weights

pytestmark = pytest.mark.padding_and_cross
STAGE = "m02_padding_and_cross"
CLS = "CrossAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 computed in another order than the reference's
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


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


# ---------------------------------------------------------------- NumPy reference of typical mistakes

def cross_attention(x, weights, num_heads, context=None, key_padding_mask=None, causal=False, *,
                    padding="keys", empty="zero", fill=-np.inf, scale="head_dim"):
    """NumPy CrossAttention, with switches that reproduce typical mistakes.

    padding: "keys" (right: the mask hides key columns), "inverted" (~key_padding_mask), "queries" (the mask
    hides query rows instead, when n_q == n_kv) or "none" (ignored); empty: "zero" (right: a row with nothing
    to attend to gets weights 0) or "nan" (plain softmax: 0/0); fill: what masked scores become (-inf right;
    a large negative number spreads a row with nothing allowed evenly over every key); scale: "head_dim"
    (right), "d_out" or "none".
    """
    context = x if context is None else context
    q, k, v = linear(x, weights, "W_query"), linear(context, weights, "W_key"), linear(context, weights, "W_value")
    d_out = q.shape[-1]
    head_dim = q.shape[-1] // num_heads

    def heads(a):
        return a.reshape(a.shape[0], a.shape[1], num_heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    b, n_q, n_kv = x.shape[0], q.shape[2], k.shape[2]
    allowed = np.ones((b, 1, n_q, n_kv), bool)
    if causal:
        allowed &= np.tril(np.ones((n_q, n_kv), bool))
    if key_padding_mask is not None and padding != "none":
        real = np.asarray(key_padding_mask, bool)
        allowed &= {"keys": real[:, None, None, :], "inverted": ~real[:, None, None, :],
                    "queries": real[:, None, :, None]}[padding]
    s = q @ k.transpose(0, 1, 3, 2) / {"head_dim": np.sqrt(head_dim), "d_out": np.sqrt(d_out), "none": 1.0}[scale]
    s = np.where(allowed, s, fill)
    with np.errstate(invalid="ignore"):  # "nan": a row of -inf gives NaN, on purpose
        w = safe_softmax(s) if empty == "zero" else softmax(s)
    out = (w @ v).transpose(0, 2, 1, 3).reshape(b, n_q, d_out)
    return linear(out, weights, "out_proj")


NAN = ("a query with nothing to attend to (every key masked: all padding, or left padding before a causal "
       "query) got NaN: its softmax row is all -inf, 0/0. Give such rows attention weights 0, so that its "
       "context vector is 0 and its output out_proj.bias")
INVERTED = ("the key_padding_mask is inverted: True marks a REAL token that takes part, False a padding token "
            "(SDPA's convention; nn.MultiheadAttention's key_padding_mask is the opposite)")
QUERY_AXIS = ("the key_padding_mask was applied on the query axis (rows of the scores): it says which KEYS are "
              "padding, so it masks columns, key_padding_mask[:, None, None, :] against (b, num_heads, n_q, n_kv)")
UNIFORM = ("masked scores were filled with a large negative number (not -inf) and empty rows kept: a query with "
           "nothing to attend to then spreads its weight evenly over every key, padding included; give such "
           "rows weights 0")


def cross_mistakes(x, weights, num_heads, context=None, key_padding_mask=None, causal=False):
    """What typical mistakes of this stage give on these inputs, keyed by a plain description."""
    def run(**change):
        given = dict(context=context, key_padding_mask=key_padding_mask, causal=causal) | change
        return cross_attention(x, weights, num_heads, **given)

    candidates = {NAN: run(empty="nan"), UNIFORM: run(fill=-1e9)}
    padded = key_padding_mask is not None
    if padded:
        candidates |= {
            INVERTED: run(padding="inverted"), INVERTED + "; " + NAN: run(padding="inverted", empty="nan"),
            "the key_padding_mask was ignored: padding keys took part": run(padding="none"),
        }
        if x.shape[1] == key_padding_mask.shape[1]:
            candidates |= {QUERY_AXIS: run(padding="queries"),
                           QUERY_AXIS + "; " + NAN: run(padding="queries", empty="nan")}
    candidates |= {
        "causal=True was ignored: query i may only attend to keys 0..i" if causal else
        "a causal mask was applied although causal=False": run(causal=not causal),
        "the scores were scaled by sqrt(d_out); each head's dot products have head_dim terms": run(scale="d_out"),
        "the scores were not scaled by 1 / sqrt(head_dim)": run(scale="none"),
    }
    if context is not None and context.shape == x.shape:  # (where x fits W_key and the padding mask)
        candidates["keys and values came from x: with a context, W_key and W_value project the context"] = run(
            context=None)
    # Keep the mistakes whose result differs from the right one, and of several with the same result the
    # first (the simplest explanation: one mistake before two).
    kept = {"right": run()}
    for why, c in candidates.items():
        if not any(np.allclose(c, other, rtol=1e-4, atol=1e-6, equal_nan=True) for other in kept.values()):
            kept[why] = c
    del kept["right"]
    return kept


def check_case(stage, init, weights, x, expected, inputs, **options):
    out = attend(stage, init, weights, x, **inputs, **options)
    assert_close(call(init, inputs), out, expected, **FLOAT32,
                 mistakes=lambda: cross_mistakes(x, weights, init["num_heads"], **inputs))
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
    weights = public_fx.sub("left/weights/")
    out = check_case(stage, public_fx.init("left/"), weights, public_fx["left/x"], public_fx["left/output"],
                     inputs_of(public_fx, "left/"))
    assert_close("outputs of the two queries with nothing to attend to", out[1, :2],
                 np.broadcast_to(weights["out_proj.bias"], (2, 4)), **FLOAT32)


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_other_sizes(stage, hidden_fx, case, device):
    check_case(stage, hidden_fx.init(f"{case}/"), hidden_fx.sub(f"{case}/weights/"), hidden_fx[f"{case}/x"],
               hidden_fx[f"{case}/output"], inputs_of(hidden_fx, f"{case}/"), device=device)


def random_case(rng, reference_stage, *, cross):
    """Random sizes: with cross, n_q != n_kv and d_context != d_in; otherwise self-attention."""
    num_heads = int(rng.integers(1, 4))
    d_in = int(rng.integers(2, 7))
    init = dict(d_in=d_in, d_out=num_heads * int(rng.integers(1, 4)), num_heads=num_heads,
                qkv_bias=bool(rng.integers(2)))
    b, n_q = int(rng.integers(1, 4)), int(rng.integers(1, 8))
    x = normal(rng, b, n_q, d_in)
    inputs = {}
    if cross:
        init["d_context"] = d_in + int(rng.integers(1, 4))
        inputs["context"] = normal(rng, b, n_q + int(rng.integers(1, 5)), init["d_context"])
    return init, x, draw_weights(rng, reference_stage, CLS, init), inputs


def padding_mask(rng, b, n, *, left=False):
    """(b, n) key_padding_mask of random lengths 1..n (True = real), padding on the right (left: on the left)."""
    lengths = rng.integers(1, n + 1, size=(b, 1))
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
    """Appending padding tokens (any values) marked False changes no real token's output: the outputs equal
    those of the unpadded sequence without any mask."""
    init, x, weights, _ = random_case(rng, reference.stage(STAGE), cross=False)
    b, n, d_in = x.shape
    plain = attend(stage, init, weights, x, causal=causal)
    padded = np.concatenate([x, normal(rng, b, 3, d_in, scale=5.0)], axis=1)
    real = np.arange(n + 3) < n
    inputs = dict(key_padding_mask=np.broadcast_to(real, (b, n + 3)).copy(), causal=causal)
    out = attend(stage, init, weights, padded, **inputs)
    assert_close(f"real tokens' outputs of {call(init, inputs)} with 3 padding tokens appended (expected: those "
                 "of the sequence without padding)", out[:, :n], plain, **FLOAT32,
                 mistakes=lambda: {why: c[:, :n] for why, c in cross_mistakes(padded, weights, init["num_heads"],
                                                                               **inputs).items()})


def test_padded_context_changes_nothing(stage, reference, rng):
    """Cross-attention: padding appended to the context and masked leaves every query's output as it was."""
    init, x, weights, inputs = random_case(rng, reference.stage(STAGE), cross=True)
    context = inputs["context"]
    b, n_kv, d_context = context.shape
    plain = attend(stage, init, weights, x, context=context)
    padded = np.concatenate([context, normal(rng, b, 2, d_context, scale=5.0)], axis=1)
    inputs = dict(context=padded, key_padding_mask=np.broadcast_to(np.arange(n_kv + 2) < n_kv, (b, n_kv + 2)).copy())
    assert_close(f"{call(init, inputs)} with 2 padding tokens appended to the context (expected: the output "
                 "without them)", attend(stage, init, weights, x, **inputs), plain, **FLOAT32,
                 mistakes=lambda: cross_mistakes(x, weights, init["num_heads"], **inputs))


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
                 mistakes=lambda: cross_mistakes(x, weights, init["num_heads"], **inputs))


def test_context_none_is_self_attention(stage, reference, rng):
    init, x, weights, _ = random_case(rng, reference.stage(STAGE), cross=False)
    mask = padding_mask(rng, *x.shape[:2])
    alone = attend(stage, init, weights, x, key_padding_mask=mask)
    assert_close(f"{call(init, {'key_padding_mask': mask})} (context=None)", alone,
                 cross_attention(x, weights, init["num_heads"], key_padding_mask=mask), **FLOAT32,
                 mistakes=lambda: cross_mistakes(x, weights, init["num_heads"], key_padding_mask=mask))
    assert_close("forward(x, context=x) (expected: forward(x), self-attention)",
                 attend(stage, init, weights, x, context=x, key_padding_mask=mask), alone, **FLOAT32)


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
    init = dict(d_in=d, d_out=d, num_heads=num_heads, qkv_bias=True)
    inputs = dict(key_padding_mask=real)
    assert_close(f"{call(init, inputs)} (expected: nn.MultiheadAttention with key_padding_mask=~mask)",
                 attend(stage, init, weights, x, **inputs), expected, **FLOAT32,
                 mistakes=lambda: cross_mistakes(x, weights, num_heads, **inputs))


def test_dropout_acts_on_the_weights_in_training_mode_only(stage):
    """One-hot values and an identity out_proj make the output the attention weights (cases.exposing_case):
    dropout=0.5 drops about half of them and doubles the rest in training mode, nothing in eval mode."""
    mha_init, x, weights = exposing_case(np.random.default_rng(20), num_heads=2, num_tokens=8, batch=32)
    init = dict(d_in=mha_init["d_in"], d_out=mha_init["d_out"], num_heads=2, dropout=0.5)
    plain = cross_attention(x, weights, 2)
    for seed in (1, 2):
        assert_close(f"{call(init, {})} in eval mode (seed {seed})", attend(stage, init, weights, x, seed=seed), plain,
                     **FLOAT32, hint="In eval mode dropout must do nothing: apply the module's nn.Dropout.")
    trained = attend(stage, init, weights, x, train=True, seed=0)
    check_dropout(trained, plain, 0.5, f"{call(init, {})} in training mode")


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
                 # (the mistakes are computed in NumPy: at the CPU twin's size only)
                 mistakes=lambda: {} if target.cuda else cross_mistakes(x, weights, init["num_heads"], **inputs))
