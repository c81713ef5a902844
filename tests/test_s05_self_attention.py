"""Stage 5: SelfAttention_v1, SelfAttention_v2 and moving weights between them.

Spec: v1 holds W_query/W_key/W_value as (d_in, d_out) parameters; v2 holds
nn.Linear layers of the same names (weight (d_out, d_in), bias only when
qkv_bias=True). Both return softmax(Q K^T / sqrt(d_out)) V for x (num_tokens, d_in).
transfer_weights_v2_to_v1 makes v1 compute exactly what v2 computes.
"""
import pytest

from diagnosis import Attention, AttentionModule, as_parameters, assert_close, sizes_only, without_out_proj
from suite_runtime.cases import draw_weights, normal

pytestmark = pytest.mark.self_attention
STAGE = "s05_self_attention"
NAMES = ("W_query", "W_key", "W_value")


# What both classes compute: one head (its width d_k = d_out), no mask, no output projection, one sequence at a time.
SPEC = Attention(num_heads=1, causal=False, out_proj=False, head_name="d_k")
LAYOUT = {"SelfAttention_v1": as_parameters, "SelfAttention_v2": without_out_proj}


def as_v2(weights):
    """v1's (d_in, d_out) matrices as nn.Linear weights: the canonical layout the diagnosis works with."""
    return {f"{n}.weight": w.T for n, w in weights.items()} if "W_query" in weights else weights


def diagnosis(stage, cls, init, x, weights):
    """What a failed check of SelfAttention_v1 or _v2 is diagnosed with (diagnosis.AttentionModule)."""
    return AttentionModule(stage, cls, init, SPEC, LAYOUT[cls], sized=sizes_only, batched=False).evidence(
        x, as_v2(weights))


def as_v1(v2_weights):
    """v2's Linear weights as v1 matrices (what the transfer must do)."""
    return {n: v2_weights[f"{n}.weight"].T for n in NAMES}


@pytest.mark.public
def test_v1_with_the_book_s_weights(stage, public_fx):
    w = public_fx.sub("v1/weights/")
    out = stage.forward("SelfAttention_v1", dict(d_in=3, d_out=2), public_fx.inputs, w)
    assert_close("SelfAttention_v1(inputs)", out, public_fx["v1/output"],
                 diagnosis=diagnosis(stage, "SelfAttention_v1", dict(d_in=3, d_out=2), public_fx.inputs, w))


@pytest.mark.public
def test_v2_with_the_book_s_weights(stage, public_fx):
    w = public_fx.sub("v2/weights/")
    out = stage.forward("SelfAttention_v2", dict(d_in=3, d_out=2), public_fx.inputs, w)
    assert_close("SelfAttention_v2(inputs)", out, public_fx["v2/output"],
                 diagnosis=diagnosis(stage, "SelfAttention_v2", dict(d_in=3, d_out=2), public_fx.inputs, w))


@pytest.mark.public
def test_transfer_makes_v1_compute_what_v2_computes(stage, public_fx):
    state, out = stage.run("transfer_v2_to_v1", d_in=3, d_out=2,
                           v2_weights=public_fx.sub("v2/weights/"), x=public_fx.inputs)
    for name, expected in as_v1(public_fx.sub("v2/weights/")).items():
        assert_close(f"sa_v1.{name} after the transfer", state[name], expected,
                     hint="nn.Linear computes x @ weight.T, so v1's matrix is v2's weight transposed.")
    assert_close("sa_v1(inputs) after the transfer", out, public_fx["v2/output"])


@pytest.mark.public
@pytest.mark.book
@pytest.mark.parametrize("cls, seed", [("SelfAttention_v1", 123), ("SelfAttention_v2", 789)])
def test_book_reproduction(stage, public_fx, cls, seed):
    """Following the book's seed and creation order (W_query, W_key, W_value) prints the book's numbers.

    Carries no points: a correct class that creates its parameters in another order differs here.
    """
    out = stage.forward(cls, dict(d_in=3, d_out=2), public_fx.inputs, seed=seed)
    expected = public_fx["v1/output" if cls.endswith("v1") else "v2/output"]
    assert_close(f"{cls}(inputs) at torch.manual_seed({seed})", out, expected,
                 hint="Create W_query, then W_key, then W_value with torch.rand / nn.Linear, as the book does.")


def test_v1_parameters_are_d_in_by_d_out(stage):
    info = stage.inspect("SelfAttention_v1", dict(d_in=5, d_out=3))
    assert info["parameters"] == {n: [5, 3] for n in NAMES}, (
        f"SelfAttention_v1(5, 3) should have parameters W_query, W_key, W_value of shape (5, 3); "
        f"yours: {info['parameters']}"
    )


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_v2_layers_honour_qkv_bias(stage, qkv_bias):
    info = stage.inspect("SelfAttention_v2", dict(d_in=5, d_out=3, qkv_bias=qkv_bias))
    expected = {f"{n}.weight": [3, 5] for n in NAMES}
    if qkv_bias:
        expected.update({f"{n}.bias": [3] for n in NAMES})
    assert info["parameters"] == expected, (
        f"SelfAttention_v2(5, 3, qkv_bias={qkv_bias}) should have parameters {expected}; yours: "
        f"{info['parameters']}. Pass bias=qkv_bias to each nn.Linear."
    )


def test_v1_other_sizes(stage, hidden_fx):
    w = hidden_fx.sub("v1/weights/")
    out = stage.forward("SelfAttention_v1", dict(d_in=5, d_out=3), hidden_fx.inputs, w)
    assert_close("SelfAttention_v1(x)", out, hidden_fx["v1/output"],
                 diagnosis=diagnosis(stage, "SelfAttention_v1", dict(d_in=5, d_out=3), hidden_fx.inputs, w))


def test_v2_other_sizes_with_bias(stage, hidden_fx):
    w = hidden_fx.sub("v2/weights/")
    out = stage.forward("SelfAttention_v2", dict(d_in=5, d_out=3, qkv_bias=True), hidden_fx.inputs, w)
    assert_close("SelfAttention_v2(x)", out, hidden_fx["v2/output"],
                 diagnosis=diagnosis(stage, "SelfAttention_v2", dict(d_in=5, d_out=3, qkv_bias=True),
                                     hidden_fx.inputs, w))


def test_transfer_other_sizes(stage, hidden_fx):
    w = {k: v for k, v in hidden_fx.sub("v2/weights/").items() if k.endswith("weight")}
    state, out = stage.run("transfer_v2_to_v1", d_in=5, d_out=3, v2_weights=w, x=hidden_fx.inputs)
    for name, expected in as_v1(w).items():
        assert_close(f"sa_v1.{name} after the transfer", state[name], expected)


@pytest.mark.parametrize("cls", ["SelfAttention_v1", "SelfAttention_v2"])
def test_random_cases(stage, reference, rng, cls):
    ref = reference.stage(STAGE)
    d_in = int(rng.integers(2, 8))
    init = dict(d_in=d_in, d_out=d_in + int(rng.integers(1, 4)))
    if cls.endswith("v2"):
        init["qkv_bias"] = bool(rng.integers(2))
    x = normal(rng, rng.integers(1, 10), d_in)
    weights = draw_weights(rng, ref, cls, init)
    assert_close(f"{cls}({init})(x)", stage.forward(cls, init, x, weights), ref.forward(cls, init, x, weights),
                 diagnosis=diagnosis(stage, cls, init, x, weights))
