"""Stage m01: chapter 3's attention computed by PyTorch.

Spec: MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False) is chapter 3's
(given). sdpa_attention(mha, x, use_mask=False) equals mha(x) with F.scaled_dot_product_attention doing the
attention (causal through is_causal=True, or with use_mask through a boolean attn_mask, True = takes part;
dropout mha.dropout.p in training mode only). torch_mha_forward(mha, x) equals mha(x) computed by
to_torch_mha(mha), an nn.MultiheadAttention(d_out, num_heads, batch_first=True) holding mha's weights
(d_in == d_out), run with its boolean attn_mask (True = NOT allowed).
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, check_dropout, linear, multihead, multihead_mistakes, softmax, split_heads
from suite_runtime.cases import draw_weights, exposing_case, module_case, normal

pytestmark = pytest.mark.pytorch_attention
STAGE = "m01_pytorch_attention"
CLS = "MultiHeadAttention"
SDPA, TORCH_MHA = "sdpa_attention", "torch_mha_forward"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32, summation order differs between the fused kernel and the by-hand path
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


def run(stage, function, init, weights, x, *, use_mask=None, measure=False, **options):
    """function(model, x[, use_mask]) on a MultiHeadAttention(**init) holding ``weights``."""
    step = {"function": function, "args": [x], "model": True,
            "kwargs": {} if use_mask is None else {"use_mask": use_mask}, "measure": measure}
    [result] = stage.session(CLS, init, weights, steps=[step], **options)
    return result


def describe(function, use_mask=None):
    return f"{function}(mha, x{'' if use_mask is None else f', use_mask={use_mask}'})"


def sdpa_mistakes(x, weights, num_heads):
    """Chapter 3's mistakes (checks.multihead_mistakes: the inverted SDPA mask among them), and SDPA's own."""
    head_dim = weights["W_query.weight"].shape[0] // num_heads
    prescaled = {k: v / np.sqrt(head_dim) if k.startswith("W_query") else v for k, v in weights.items()}
    return {**multihead_mistakes(x, weights, num_heads),
            "the scores were scaled twice: F.scaled_dot_product_attention divides by sqrt(head_dim) itself, "
            "so give it the queries as they are": multihead(x, prescaled, num_heads)}


TORCH_MASK = ("nn.MultiheadAttention's boolean attn_mask is True where a key is NOT allowed, the opposite of "
              "F.scaled_dot_product_attention's: give it the future, mha.mask.bool()[:num_tokens, :num_tokens], "
              "not ~mask")


def torch_mha_mistakes(x, weights, num_heads):
    """What typical to_torch_mha / torch_mha_forward mistakes give. (nn.MultiheadAttention does the scaling,
    the softmax and the heads itself: chapter 3's mistakes of those cannot happen here.)"""
    def run(changed=weights, **change):
        return multihead(x, changed, num_heads, **change)

    def swapped(a, b):
        return run({k.replace(a, "@").replace(b, a).replace("@", b): v for k, v in weights.items()})

    order = ("in_proj_weight (and in_proj_bias) stack W_query, W_key and W_value in this order: "
             "torch.cat([W_query.weight, W_key.weight, W_value.weight])")
    candidates = {
        TORCH_MASK: run(mask="inverted"),
        TORCH_MASK + " (here a row left with nothing to attend to gives NaN)": run(mask="inverted_nan"),
        "no attn_mask was given: tokens see the future (nn.MultiheadAttention is not causal by itself)":
            run(mask="none"),
        order + " (queries and keys were swapped)": swapped("W_query", "W_key"),
        order + " (keys and values were swapped)": swapped("W_key", "W_value"),
        order + " (queries and values were swapped)": swapped("W_query", "W_value"),
        "in_proj_bias was left at its initial zeros: copy the biases of W_query, W_key and W_value into it":
            run(qkv_bias=False),
        "out_proj.bias was not copied (nn.MultiheadAttention starts it at zeros)":
            run({**weights, "out_proj.bias": np.zeros_like(weights["out_proj.bias"])}),
    }
    right = run()
    return {why: c for why, c in candidates.items() if not np.allclose(c, right, rtol=1e-4, atol=1e-6)}


def square_case(rng, reference_stage, *, max_heads=4):
    """A random MultiHeadAttention with d_in == d_out (as nn.MultiheadAttention needs), input and weights."""
    num_heads = int(rng.integers(1, max_heads + 1))
    d = num_heads * int(rng.integers(1, 5))
    num_tokens = int(rng.integers(1, 10))
    init = dict(d_in=d, d_out=d, context_length=num_tokens + int(rng.integers(0, 4)), dropout=0.0,
                num_heads=num_heads, qkv_bias=bool(rng.integers(2)))
    x = normal(rng, int(rng.integers(1, 4)), num_tokens, d)
    return init, x, draw_weights(rng, reference_stage, CLS, init)


# ---------------------------------------------------------------- the book's example (public)

@pytest.mark.public
@pytest.mark.parametrize("use_mask", [False, True])
def test_sdpa_on_the_book_example(stage, public_fx, use_mask):
    """The book's MultiHeadAttention(3, 2, 6, 0.0, num_heads=2) at torch.manual_seed(123): SDPA gives chapter 3's
    output, the context vectors printed in section 3.6.2."""
    x, weights = public_fx.x, public_fx.sub("book/weights/")
    out = run(stage, SDPA, public_fx.init("book/"), weights, x, use_mask=use_mask)
    assert_close(describe(SDPA, use_mask), out, public_fx["book/output"], **FLOAT32,
                 mistakes=lambda: sdpa_mistakes(x, weights, 2))


@pytest.mark.public
def test_torch_mha_on_the_example(stage, public_fx):
    """MultiHeadAttention(3, 3, 6, 0.0, num_heads=3, qkv_bias=True) as an nn.MultiheadAttention."""
    x, weights = public_fx.x, public_fx.sub("square/weights/")
    out = run(stage, TORCH_MHA, public_fx.init("square/"), weights, x)
    assert_close(describe(TORCH_MHA), out, public_fx["square/output"], **FLOAT32,
                 mistakes=lambda: torch_mha_mistakes(x, weights, 3))


# ---------------------------------------------------------------- hidden

# Hidden cases (assignments/modern-attention/fixtures.py M01_HIDDEN); nn.MultiheadAttention only where d_in == d_out.
OTHER_SIZES = [
    *[(case, SDPA, use_mask) for case in ("case0", "case1", "case2") for use_mask in (False, True)],
    ("case1", TORCH_MHA, None), ("case2", TORCH_MHA, None),
]


@pytest.mark.parametrize("case, function, use_mask", OTHER_SIZES)
def test_other_sizes(stage, hidden_fx, case, function, use_mask, device):
    x, weights, init = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/"), hidden_fx.init(f"{case}/")
    mistakes = sdpa_mistakes if function == SDPA else torch_mha_mistakes
    out = run(stage, function, init, weights, x, use_mask=use_mask, device=device)
    assert_close(f"{describe(function, use_mask)} with MultiHeadAttention({init})", out, hidden_fx[f"{case}/output"],
                 **FLOAT32, mistakes=lambda: mistakes(x, weights, init["num_heads"]))


def test_is_causal_and_attn_mask_agree(stage, reference, rng, device):
    """Random sizes (d_in != d_out): both ways to make SDPA causal give chapter 3's output."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        init, x, weights = module_case(rng, ref, CLS, heads=True, head_dim=True)
        expected = ref.forward(CLS, init, x, weights)
        outputs = {use_mask: run(stage, SDPA, init, weights, x, use_mask=use_mask, device=device)
                   for use_mask in (False, True)}
        for use_mask, out in outputs.items():
            assert_close(f"{describe(SDPA, use_mask)} with MultiHeadAttention({init}) on x {x.shape}", out, expected,
                         **FLOAT32, mistakes=partial(sdpa_mistakes, x, weights, init["num_heads"]))
        assert_close("sdpa_attention with use_mask=True (expected: the same with is_causal, use_mask=False)",
                     outputs[True], outputs[False], **FLOAT32)


def test_use_mask_follows_the_module_s_mask(stage, reference):
    """use_mask=True builds attn_mask from mha.mask, whatever it holds: given a mask that also hides every key
    more than one position back (1 = masked out, as chapter 3's), each token sees itself and the one before,
    which is_causal alone would not give."""
    r = np.random.default_rng(12)
    init = dict(d_in=6, d_out=6, context_length=7, dropout=0.0, num_heads=2, qkv_bias=False)
    x, weights = normal(r, 2, 7, 6), draw_weights(r, reference.stage(STAGE), CLS, init)
    positions = np.arange(7)
    hidden = (positions[None, :] > positions[:, None]) | (positions[None, :] < positions[:, None] - 1)
    out = run(stage, SDPA, init, {**weights, "mask": hidden.astype(np.float32)}, x, use_mask=True)
    assert_close(describe(SDPA, True) + " with mha.mask hiding the future and keys more than one position back",
                 out, masked_attention(x, weights, 2, hidden), **FLOAT32,
                 mistakes=lambda: {"use_mask=True did not use mha.mask (it gave plain causal attention): build "
                                   "attn_mask from mha.mask, True where mha.mask is 0": multihead(x, weights, 2)})


def masked_attention(x, weights, num_heads, hidden):
    """NumPy multi-head attention where ``hidden`` (num_tokens, num_tokens), True = masked out, says which keys
    each query may not see."""
    q, k, v = (split_heads(linear(x, weights, n), num_heads) for n in ("W_query", "W_key", "W_value"))
    scores = np.where(hidden, -np.inf, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]))
    context = softmax(scores) @ v  # (b, num_heads, num_tokens, head_dim)
    b, _, t, _ = context.shape
    return linear(context.transpose(0, 2, 1, 3).reshape(b, t, -1), weights, "out_proj")


def test_torch_mha_equals_chapter_3(stage, reference, rng, device):
    """Random sizes with d_in == d_out: nn.MultiheadAttention holding mha's weights gives mha(x)."""
    ref = reference.stage(STAGE)
    for _ in range(3):
        init, x, weights = square_case(rng, ref)
        assert_close(f"{describe(TORCH_MHA)} with MultiHeadAttention({init}) on x {x.shape}",
                     run(stage, TORCH_MHA, init, weights, x, device=device), ref.forward(CLS, init, x, weights),
                     **FLOAT32, mistakes=partial(torch_mha_mistakes, x, weights, init["num_heads"]))


@pytest.mark.parametrize("function, use_mask", [(SDPA, False), (SDPA, True), (TORCH_MHA, None)])
def test_output_of_a_token_ignores_later_tokens(stage, reference, function, use_mask):
    r = np.random.default_rng(11)
    init = dict(d_in=6, d_out=6, context_length=7, dropout=0.0, num_heads=3, qkv_bias=True)
    x, weights = normal(r, 2, 7, 6), draw_weights(r, reference.stage(STAGE), CLS, init)
    changed = x.copy()
    changed[:, 5:] -= 2.0
    before = run(stage, function, init, weights, x, use_mask=use_mask)
    after = run(stage, function, init, weights, changed, use_mask=use_mask)
    assert before.shape == x.shape, f"{describe(function, use_mask)} has shape {before.shape}, expected {x.shape}"
    assert_close(f"{describe(function, use_mask)}: outputs of tokens 0-4 after changing tokens 5-6",
                 after[:, :5], before[:, :5], **FLOAT32,
                 hint="An earlier token's output changed with a later token: the attention is not causal, "
                 "or its mask is inverted (SDPA: True = takes part; nn.MultiheadAttention: True = masked out).")
    assert not np.allclose(after[:, 5:], before[:, 5:]), "changing tokens 5-6 must change their own outputs"


@pytest.mark.parametrize("function, use_mask", [(SDPA, False), (SDPA, True)])
def test_the_fused_function_does_the_attention(stage, public_fx, function, use_mask):
    """sdpa_attention must call F.scaled_dot_product_attention and no softmax of its own."""
    measured = run(stage, function, public_fx.init("book/"), public_fx.sub("book/weights/"), public_fx.x,
                   use_mask=use_mask, measure=True)
    called = measured["functions"]
    assert "scaled_dot_product_attention" in called and "softmax" not in called, (
        f"{describe(function, use_mask)} should let torch.nn.functional.scaled_dot_product_attention compute the "
        f"attention (scores, scale, mask, softmax, values) in one call; the torch functions it called: {called}"
    )


def test_torch_mha_uses_nn_multihead_attention(stage, public_fx):
    measured = run(stage, TORCH_MHA, public_fx.init("square/"), public_fx.sub("square/weights/"), public_fx.x,
                   measure=True)
    called = measured["functions"]
    assert {"multi_head_attention_forward", "_native_multi_head_attention"} & set(called), (
        "torch_mha_forward should run the nn.MultiheadAttention that to_torch_mha builds (its forward calls "
        f"F.multi_head_attention_forward); the torch functions it called: {called}"
    )


@pytest.mark.parametrize("function, num_heads", [(SDPA, 2), (TORCH_MHA, 1)])
def test_dropout_acts_in_training_mode_only(stage, function, num_heads):
    """One-hot values and an identity out_proj make the output the attention weights (cases.exposing_case):
    with dropout=0.5 about half are dropped and the rest doubled in training mode, none in eval mode.
    (num_heads=1 for nn.MultiheadAttention: that case has d_in == d_out only with one head.)"""
    init, x, weights = exposing_case(np.random.default_rng(13), num_heads=num_heads, num_tokens=8, batch=32)
    plain = multihead(x, weights, num_heads)
    # Dropout can only be judged on a function that is right without it: otherwise this check would blame
    # dropout for another mistake of the stage (which its own checks name).
    if not np.allclose(run(stage, function, init, weights, x), plain, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{describe(function)} with dropout=0 does not compute the expected output on this "
                             "test's case, so its dropout cannot be checked yet: fix this stage's other failures "
                             "first.")
    init = dict(init, dropout=0.5)
    for seed in (1, 2):
        assert_close(f"{describe(function)} in eval mode with dropout=0.5 (seed {seed})",
                     run(stage, function, init, weights, x, seed=seed), plain, **FLOAT32,
                     hint="In eval mode dropout must do nothing: pass dropout_p=mha.dropout.p only when "
                     "mha.training (F.scaled_dot_product_attention cannot tell the mode); nn.MultiheadAttention "
                     "follows train()/eval().")
    trained = run(stage, function, init, weights, x, train=True, seed=0)
    check_dropout(trained, plain, 0.5, f"{describe(function)} in training mode with dropout=0.5")


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs a Llama-sized attention (d_model 4096, 32 heads)
    "cpu": dict(b=2, t=32, d=64, num_heads=4),
    "cuda": dict(b=1, t=4096, d=4096, num_heads=32),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d=256, num_heads=32),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("function", [SDPA, TORCH_MHA])
def test_llama_sized(stage, reference, target, dtype, function):
    """bfloat16 is compared with the float32 reference (its SDPA path) at bf16 tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(14)
    init = dict(d_in=size["d"], d_out=size["d"], context_length=size["t"], dropout=0.0,
                num_heads=size["num_heads"], qkv_bias=True)
    x = normal(r, size["b"], size["t"], size["d"])
    weights = draw_weights(r, reference.stage(STAGE), CLS, init)
    expected = run(reference.stage(STAGE), SDPA, init, weights, x, device=device)
    assert_close(f"{describe(function)} ({device}, {dtype}, MultiHeadAttention({init}))",
                 run(stage, function, init, weights, x, device=device, dtype=dtype), expected, **TOLERANCE[dtype])
