"""Stage 10: MultiHeadAttention with weight splits.

Spec: MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)
maps (b, num_tokens, d_in) to (b, num_tokens, d_out). Head h uses features
h*head_dim .. (h+1)*head_dim-1 of W_query/W_key/W_value (head_dim = d_out // num_heads),
scores are scaled by 1/sqrt(head_dim), causally masked, and the concatenated
heads go through out_proj (nn.Linear(d_out, d_out) with bias).
batched_head_scores(a) = a @ a.transpose(2, 3) for a (b, num_heads, num_tokens, head_dim),
equal to per_head_scores_loop(a).
"""
import numpy as np
import pytest

from diagnosis import (
    BFLOAT16,
    Attention,
    AttentionModule,
    assert_close,
    check_causal_mask,
    check_module_dropout,
    check_sizes_from_arguments,
    multihead,
    parameter_count,
)
from suite_runtime.cases import exposing_case, mha_shapes, module_case, normal, random_weights

pytestmark = pytest.mark.multihead_attention
STAGE = "s10_multihead_attention"
CLS = "MultiHeadAttention"


def diagnosis(stage, init, x, weights, **options):
    """What a failed check of MultiHeadAttention's output is diagnosed with (diagnosis.AttentionModule): causal
    attention in init["num_heads"] heads with out_proj."""
    spec = Attention(num_heads=init["num_heads"])
    return AttentionModule(stage, CLS, init, spec, options=options).evidence(x, weights)


def mha_case(seed, b, t, d_in, d_out, context_length, num_heads, qkv_bias):
    r = np.random.default_rng(seed)
    w = random_weights(r, mha_shapes(d_in, d_out, qkv_bias))
    init = dict(d_in=d_in, d_out=d_out, context_length=context_length, dropout=0.0, num_heads=num_heads,
                qkv_bias=qkv_bias)
    return init, r.normal(size=(b, t, d_in)).astype(np.float32), w


@pytest.mark.public
def test_book_weights_two_heads(stage, public_fx):
    out = stage.forward(CLS, public_fx.init(), public_fx.x, public_fx.sub("weights/"))
    assert_close("context_vecs", out, public_fx.output,
                 diagnosis=diagnosis(stage, public_fx.init(), public_fx.x, public_fx.sub("weights/")))


@pytest.mark.public
@pytest.mark.book
def test_book_reproduction(stage, public_fx):
    """torch.manual_seed(123), then W_query, W_key, W_value, out_proj in this order. No points."""
    out = stage.forward(CLS, public_fx.init(), public_fx.x, seed=123)
    assert_close("context_vecs at torch.manual_seed(123)", out, public_fx.output)


@pytest.mark.public
def test_batched_head_scores_on_the_example(stage, public_fx):
    assert_close("a @ a.transpose(2, 3)", stage.batched_head_scores(public_fx.a), public_fx.a_scores)


@pytest.mark.parametrize("form", ["batched_head_scores", "per_head_scores_loop"])
def test_batched_and_looped_head_scores(stage, hidden_fx, form):
    """Each form on its own: a mistake in one costs the other nothing."""
    assert_close(f"{form}(a)", getattr(stage, form)(hidden_fx.a), hidden_fx.a_scores)


@pytest.mark.parametrize("case", ["case0", "case1"])
def test_other_sizes(stage, hidden_fx, case, device):
    x, weights = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    init = hidden_fx.init(f"{case}/")
    out = stage.forward(CLS, init, x, weights, device=device)
    assert_close("context_vecs", out, hidden_fx[f"{case}/output"],
                 diagnosis=diagnosis(stage, init, x, weights, device=device))


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs GPT-2 small's attention size
    "cpu": dict(b=2, t=32, d_in=48, d_out=48, context_length=40, num_heads=4),
    "cuda": dict(b=8, t=1024, d_in=768, d_out=768, context_length=1024, num_heads=12),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=2, t=64, d_in=96, d_out=96, context_length=64, num_heads=12),
}
TOLERANCE = {"float32": dict(rtol=1e-4, atol=1e-5), "bfloat16": BFLOAT16}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_sized_heads(stage, reference, target, dtype):
    """Many heads, long sequences; bfloat16 is compared with the float32 reference at bf16 tolerance."""
    init, x, weights = mha_case(7, qkv_bias=True, **SIZES[target.size])
    device = target.device
    expected = reference.stage(STAGE).forward(CLS, init, x, weights, device=device)
    out = stage.forward(CLS, init, x, weights, device=device, dtype=dtype)
    assert_close(f"context_vecs ({device}, {dtype})", out, expected, **TOLERANCE[dtype])


def test_parameters_mask_and_dropout(stage):
    info = stage.inspect(CLS, dict(d_in=6, d_out=8, context_length=5, dropout=0.1, num_heads=2))
    expected = 3 * 8 * 6 + 8 * 8 + 8
    assert parameter_count(info) == expected, (
        f"MultiHeadAttention(6, 8, ...) should have {expected} trainable values: W_query, W_key, W_value "
        f"(8x6 each, no bias by default) and out_proj (8x8 with bias); yours: {info['parameters']}"
    )
    assert "mask" in info["buffers"], "register the causal mask as a buffer named 'mask'"
    check_causal_mask(info["buffers"]["mask"], 5)
    assert info["dropout_p"].get("dropout") == 0.1, f"expected self.dropout = nn.Dropout(0.1): {info['dropout_p']}"


@pytest.mark.parametrize("num_heads, num_tokens", [(1, 4), (3, 1), (6, 9)])
def test_head_counts_and_lengths(stage, reference, num_heads, num_tokens):
    init, x, weights = mha_case(num_heads, b=2, t=num_tokens, d_in=5, d_out=12, context_length=9,
                                num_heads=num_heads, qkv_bias=False)
    expected = reference.stage(STAGE).forward(CLS, init, x, weights)
    assert_close(f"context_vecs ({num_heads} heads, {num_tokens} tokens)", stage.forward(CLS, init, x, weights),
                 expected, diagnosis=diagnosis(stage, init, x, weights))


def test_dropout_acts_on_the_weights_in_training_mode_only(stage, device):
    """Every head's values are the one-hot inputs and out_proj is the identity, so the output is the
    heads' attention weights: dropout=0.5 drops about half and doubles the rest in training mode only."""
    init, x, weights = exposing_case(np.random.default_rng(10), num_heads=2, num_tokens=8, batch=32)
    check_module_dropout(stage, CLS, init, x, weights, 0.5, multihead(x, weights, 2), device)


def test_sizes_come_from_the_constructor(stage):
    init = dict(d_in=7, d_out=9, context_length=11, dropout=0.0, num_heads=3)  # qkv_bias: its own check
    check_sizes_from_arguments(stage.inspect(CLS, init), init, 3 * 7 * 9 + 9 * 9 + 9, CLS)


def test_output_of_a_token_ignores_later_tokens(stage):
    init, x, weights = mha_case(8, b=1, t=7, d_in=5, d_out=6, context_length=7, num_heads=3, qkv_bias=True)
    changed = x.copy()
    changed[:, 5:] -= 2.0
    before, after = stage.forward(CLS, init, x, weights), stage.forward(CLS, init, changed, weights)
    assert before.shape == (1, 7, 6), f"output shape {before.shape}, expected (b, num_tokens, d_out) = (1, 7, 6)"
    assert_close("outputs of tokens 0-4", after[:, :5], before[:, :5], labels=("tokens 5-6 as given", "changed"),
                 diagnosis=diagnosis(stage, init, changed, weights))
    assert not np.allclose(after[:, 5:], before[:, 5:]), "changing tokens 5-6 must change their own outputs"


def test_random_cases(stage, reference, rng, device):
    for _ in range(2):
        init, x, weights = module_case(rng, reference.stage(STAGE), CLS, heads=True, head_dim=True)
        assert_close(f"MultiHeadAttention({init}) on x {x.shape}", stage.forward(CLS, init, x, weights, device=device),
                     reference.stage(STAGE).forward(CLS, init, x, weights),
                     diagnosis=diagnosis(stage, init, x, weights, device=device))
    a = normal(rng, rng.integers(1, 3), rng.integers(1, 5), rng.integers(1, 7), rng.integers(1, 6))
    assert_close(f"batched_head_scores(a {a.shape})", stage.batched_head_scores(a),
                 reference.stage(STAGE).batched_head_scores(a))
