"""Stage 8: CausalAttention, batched.

Spec: CausalAttention(d_in, d_out, context_length, dropout, qkv_bias=False)
maps x (b, num_tokens, d_in) to (b, num_tokens, d_out) for any
num_tokens <= context_length; token t's output depends only on tokens 0..t;
the mask is a registered buffer named mask (saved in the state_dict, moved by
.to()); qkv_bias adds biases to W_query/W_key/W_value; dropout acts on the
attention weights in training mode only.
"""
import numpy as np
import pytest

from diagnosis import (
    Attention,
    AttentionModule,
    assert_close,
    check_causal_mask,
    check_module_dropout,
    check_sizes_from_arguments,
    multihead,
    parameter_count,
    without_out_proj,
)
from suite_runtime.cases import exposing_case, module_case, qkv_shapes, random_weights

pytestmark = pytest.mark.causal_attention
STAGE = "s08_causal_attention"
CLS = "CausalAttention"
# What CausalAttention computes: one head (its width d_k = d_out), causal, no output projection.
SPEC = Attention(num_heads=1, out_proj=False, head_name="d_k")


def diagnosis(stage, init, x, weights):
    """What a failed check of CausalAttention's output is diagnosed with (diagnosis.AttentionModule)."""
    return AttentionModule(stage, CLS, init, SPEC, without_out_proj).evidence(x, weights)


def random_case(seed, b, t, d_in, d_out, context_length):
    r = np.random.default_rng(seed)
    init = dict(d_in=d_in, d_out=d_out, context_length=context_length, dropout=0.0)
    weights = random_weights(r, qkv_shapes(d_in, d_out, bias=False))
    return init, r.normal(size=(b, t, d_in)).astype(np.float32), weights


@pytest.mark.public
def test_book_weights_on_the_batch_of_two(stage, public_fx):
    out = stage.forward(CLS, public_fx.init(), public_fx.x, public_fx.sub("weights/"))
    assert_close("context_vecs", out, public_fx.output,
                 diagnosis=diagnosis(stage, public_fx.init(), public_fx.x, public_fx.sub("weights/")))


@pytest.mark.public
@pytest.mark.book
def test_book_reproduction(stage, public_fx):
    """torch.manual_seed(123) then CausalAttention(3, 2, 6, 0.0), layers created W_query, W_key, W_value.

    Carries no points: creating the layers in another order is just as correct.
    """
    out = stage.forward(CLS, public_fx.init(), public_fx.x, seed=123)
    assert_close("context_vecs at torch.manual_seed(123)", out, public_fx.output,
                 hint="Create W_query, W_key, W_value in this order to get the book's numbers.")


@pytest.mark.parametrize("case", ["case0", "case1"])
def test_other_sizes(stage, hidden_fx, case):
    x, weights = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    out = stage.forward(CLS, hidden_fx.init(f"{case}/"), x, weights)
    assert_close("context_vecs", out, hidden_fx[f"{case}/output"],
                 diagnosis=diagnosis(stage, hidden_fx.init(f"{case}/"), x, weights))


@pytest.mark.parametrize("num_tokens", [1, 5, 8])
def test_any_length_up_to_context_length(stage, reference, num_tokens):
    init, x, weights = random_case(num_tokens, b=2, t=num_tokens, d_in=4, d_out=3, context_length=8)
    expected = reference.stage(STAGE).forward(CLS, init, x, weights)
    out = stage.forward(CLS, init, x, weights)
    assert_close(f"context_vecs for {num_tokens} of 8 tokens", out, expected,
                 diagnosis=diagnosis(stage, init, x, weights))


def test_mask_is_a_registered_buffer(stage):
    info = stage.inspect(CLS, dict(d_in=3, d_out=2, context_length=5, dropout=0.0))
    assert "mask" in info["buffers"], (
        "no buffer named 'mask': create it with self.register_buffer('mask', ...) so that it is saved "
        "in the state_dict and follows the module to the GPU"
    )
    check_causal_mask(info["buffers"]["mask"], 5)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_qkv_bias_is_honoured(stage, qkv_bias):
    info = stage.inspect(CLS, dict(d_in=4, d_out=3, context_length=5, dropout=0.0, qkv_bias=qkv_bias))
    expected = 3 * 4 * 3 + (3 * 3 if qkv_bias else 0)
    assert parameter_count(info) == expected, (
        f"CausalAttention(4, 3, qkv_bias={qkv_bias}) should have {expected} trainable values "
        f"(three 3x4 weights{' and three biases of 3' if qkv_bias else ', no biases'}); yours has "
        f"{parameter_count(info)}: {info['parameters']}. Pass bias=qkv_bias to every nn.Linear."
    )


def test_dropout_layer_uses_the_given_rate(stage):
    info = stage.inspect(CLS, dict(d_in=3, d_out=2, context_length=5, dropout=0.25))
    assert info["dropout_p"].get("dropout") == 0.25, (
        f"expected self.dropout = nn.Dropout(0.25); dropout layers found: {info['dropout_p']}"
    )


def test_dropout_acts_on_the_weights_in_training_mode_only(stage, device):
    """With values that are the one-hot inputs the output is the attention weights: dropout=0.5 drops
    about half of them and doubles the rest in training mode, and changes nothing in eval mode."""
    init, x, weights = exposing_case(np.random.default_rng(8), num_heads=1, num_tokens=8, batch=64)
    del init["num_heads"]
    weights = {k: v for k, v in weights.items() if k.startswith("W_")}
    check_module_dropout(stage, CLS, init, x, weights, 0.5, multihead(x, weights, 1, out_proj=False), device)


def test_sizes_come_from_the_constructor(stage):
    init = dict(d_in=7, d_out=5, context_length=11, dropout=0.0)  # without biases: their own check
    check_sizes_from_arguments(stage.inspect(CLS, init), init, 3 * 7 * 5, CLS)


def test_output_of_a_token_ignores_later_tokens(stage):
    init, x, weights = random_case(6, b=1, t=6, d_in=4, d_out=3, context_length=6)
    changed = x.copy()
    changed[:, 4:] += 3.0
    before, after = stage.forward(CLS, init, x, weights), stage.forward(CLS, init, changed, weights)
    assert before.shape == (1, 6, 3), f"output shape {before.shape}, expected (b, num_tokens, d_out) = (1, 6, 3)"
    assert_close("outputs of tokens 0-3 after changing tokens 4-5", after[:, :4], before[:, :4],
                 hint="Token t may only attend to tokens 0..t.")
    assert not np.allclose(after[:, 4:], before[:, 4:]), "changing tokens 4-5 must change their own outputs"


def test_random_cases(stage, reference, rng):
    for _ in range(2):
        init, x, weights = module_case(rng, reference.stage(STAGE), CLS)
        assert_close(f"CausalAttention({init}) on x {x.shape}", stage.forward(CLS, init, x, weights),
                     reference.stage(STAGE).forward(CLS, init, x, weights),
                     diagnosis=diagnosis(stage, init, x, weights))
