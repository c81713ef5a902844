"""Stage 11: the combined-QKV and per-head forms of multi-head attention.

Spec: with weights mapped from a MultiHeadAttention state_dict by
combined_qkv_state_dict / per_head_state_dict, MultiHeadAttentionCombinedQKV
and MultiHeadAttentionPerHead compute exactly what MultiHeadAttention computes.
W_qkv.weight stacks W_query, W_key, W_value along the output rows; head h of
the per-head form owns rows h*head_dim .. (h+1)*head_dim-1 of each projection.
Head(d_in, head_dim, context_length, dropout, qkv_bias) takes every size from
its arguments.
"""
import itertools

import numpy as np
import pytest

from diagnosis import (
    Attention,
    AttentionModule,
    Finding,
    Said,
    assert_close,
    check_module_dropout,
    check_sizes_from_arguments,
    module_of_heads,
    multihead,
    without_out_proj,
)
from suite_runtime.cases import exposing_case, mha_shapes, module_case, qkv_shapes, random_weights

pytestmark = pytest.mark.other_forms
STAGE = "s11_other_forms"
FORMS = {
    "MultiHeadAttentionCombinedQKV": ("combined_qkv_state_dict", "combined/"),
    "MultiHeadAttentionPerHead": ("per_head_state_dict", "per_head/"),
}


def combined(weights, num_heads):
    """MultiHeadAttention's weights in the combined form's layout: W_qkv stacks the three projections' rows."""
    found = {f"W_qkv.{kind}": np.concatenate([weights[f"W_{role}.{kind}"] for role in ("query", "key", "value")])
             for kind in ("weight", "bias") if f"W_query.{kind}" in weights}
    return found | {k: v for k, v in weights.items() if k.startswith("out_proj.")}


LAYOUTS = {"MultiHeadAttentionCombinedQKV": combined, "MultiHeadAttentionPerHead": module_of_heads}


def diagnosis(stage, cls, init, x, mha_weights, **options):
    """What a failed check of a form's output is diagnosed with: MultiHeadAttention's computation
    (diagnosis.AttentionModule), its weights laid out as the form holds them."""
    spec = Attention(num_heads=init["num_heads"])
    return AttentionModule(stage, cls, init, spec, LAYOUTS[cls], options=options).evidence(x, mha_weights)


def mapping(stage, cls, mha_weights, num_heads):
    func, _ = FORMS[cls]
    if cls == "MultiHeadAttentionPerHead":
        return getattr(stage, func)(mha_weights, num_heads)
    return getattr(stage, func)(mha_weights)


def check_mapping(stage, fx, prefix, cls):
    init = fx.init(prefix)
    got = mapping(stage, cls, fx.sub(prefix + "mha/weights/"), init["num_heads"])
    expected = fx.sub(prefix + FORMS[cls][1] + "weights/")
    assert isinstance(got, dict) and sorted(got) == sorted(expected), (
        f"{FORMS[cls][0]} should return a dict with keys {sorted(expected)}; got "
        f"{sorted(got) if isinstance(got, dict) else type(got).__name__}"
    )
    mha = fx.sub(prefix + "mha/weights/")
    for key, value in expected.items():
        assert_close(f"{FORMS[cls][0]}(...)[{key!r}]", got[key], value, mistakes=stacking_mistakes(mha, key))


def stacking_mistakes(mha, key):
    """W_qkv stacked in the wrong order of roles."""
    if not key.startswith("W_qkv."):
        return {}
    kind = key.split(".")[1]
    roles = ("query", "key", "value")
    return {
        f"W_qkv stacks the rows in the order {', '.join(order)}; stack them as query, key, value":
            np.concatenate([mha[f"W_{r}.{kind}"] for r in order])
        for order in itertools.permutations(roles) if order != roles
    }


def check_forward(stage, fx, prefix, cls, device="cpu"):
    init, x = fx.init(prefix), fx[prefix + "x"]
    weights = fx.sub(prefix + FORMS[cls][1] + "weights/")
    out = stage.forward(cls, init, x, weights, device=device)
    assert_close(f"{cls} output", out, fx[prefix + "output"],
                 diagnosis=diagnosis(stage, cls, init, x, fx.sub(prefix + "mha/weights/"), device=device),
                 hint="With the mapped weights this must equal MultiHeadAttention's output.")


@pytest.mark.public
@pytest.mark.parametrize("cls", FORMS)
def test_mapping_the_book_s_weights(stage, public_fx, cls):
    check_mapping(stage, public_fx, "", cls)


@pytest.mark.public
@pytest.mark.parametrize("cls", FORMS)
def test_same_output_as_multihead_attention_on_the_book_example(stage, public_fx, cls):
    check_forward(stage, public_fx, "", cls)


@pytest.mark.parametrize("case", ["case0", "case1"])
@pytest.mark.parametrize("cls", FORMS)
def test_mapping_other_sizes(stage, hidden_fx, cls, case):
    check_mapping(stage, hidden_fx, f"{case}/", cls)


@pytest.mark.parametrize("case", ["case0", "case1"])
@pytest.mark.parametrize("cls", FORMS)
def test_same_output_as_multihead_attention(stage, hidden_fx, cls, case, device):
    check_forward(stage, hidden_fx, f"{case}/", cls, device)


@pytest.mark.parametrize("cls", FORMS)
def test_own_mapping_and_own_class_reproduce_multihead_attention(stage, hidden_fx, cls):
    init, x = hidden_fx.init("case0/"), hidden_fx["case0/x"]
    mha = hidden_fx.sub("case0/mha/weights/")
    weights = mapping(stage, cls, mha, init["num_heads"])
    assert_close(f"{cls} output with your mapped weights", stage.forward(cls, init, x, weights),
                 hidden_fx["case0/output"], diagnosis=diagnosis(stage, cls, init, x, mha))


def test_head_takes_its_sizes_from_its_arguments(stage, reference):
    r = np.random.default_rng(11)
    init = dict(d_in=5, head_dim=3, context_length=7, dropout=0.0, qkv_bias=True)
    weights = random_weights(r, qkv_shapes(5, 3, bias=True))
    x = r.normal(size=(2, 4, 5)).astype(np.float32)
    head = AttentionModule(stage, "Head", init, Attention(num_heads=1, out_proj=False), without_out_proj,
                           sized=head_sizes)
    assert_close("Head(5, 3, 7, 0.0, True)(x)", stage.forward("Head", init, x, weights),
                 reference.stage(STAGE).forward("Head", init, x, weights), diagnosis=head.evidence(x, weights))


def head_sizes(init, d_in, d_out, context_length):
    """Head's constructor arguments for these sizes: its width is head_dim."""
    return {**init, "d_in": d_in, "head_dim": d_out, "context_length": context_length, "dropout": 0.0,
            "qkv_bias": False}


def test_combined_qkv_mask_broadcasts_over_batch_and_heads(stage):
    info = stage.inspect("MultiHeadAttentionCombinedQKV",
                         dict(d_in=4, d_out=4, context_length=5, dropout=0.0, num_heads=2))
    mask = np.asarray(info["buffers"].get("mask", np.zeros(0)))
    assert mask.shape == (1, 1, 5, 5), (
        f"MultiHeadAttentionCombinedQKV's mask buffer should have shape (1, 1, context_length, context_length); "
        f"yours: {mask.shape}"
    )
    assert info["parameters"].get("W_qkv.weight") == [12, 4], (
        f"W_qkv should be nn.Linear(d_in, 3 * d_out): weight (12, 4); parameters: {info['parameters']}"
    )


@pytest.mark.parametrize("cls", FORMS)
def test_random_cases(stage, reference, rng, cls, device):
    mha = reference.stage("s10_multihead_attention")
    init, x, weights = module_case(rng, mha, "MultiHeadAttention", heads=True, head_dim=True)
    expected = mha.forward("MultiHeadAttention", init, x, weights)
    mapped = mapping(reference.stage(STAGE), cls, weights, init["num_heads"])
    assert_close(f"{cls}({init}) on x {x.shape}", stage.forward(cls, init, x, mapped, device=device), expected,
                 diagnosis=diagnosis(stage, cls, init, x, weights, device=device))
    mine = mapping(stage, cls, weights, init["num_heads"])
    assert sorted(mine) == sorted(mapped), f"{FORMS[cls][0]} keys: expected {sorted(mapped)}, got {sorted(mine)}"
    for key in mapped:
        assert_close(f"{FORMS[cls][0]}(...)[{key!r}]", mine[key], mapped[key])


@pytest.mark.parametrize("cls", FORMS)
def test_dropout_acts_on_the_weights_in_training_mode_only(stage, reference, cls, device):
    """Every head's values are the one-hot inputs and out_proj is the identity, so the output is the
    heads' attention weights: dropout=0.5 drops about half and doubles the rest in training mode only."""
    init, x, weights = exposing_case(np.random.default_rng(12), num_heads=2, num_tokens=8, batch=32)
    mapped = mapping(reference.stage(STAGE), cls, weights, init["num_heads"])
    check_module_dropout(stage, cls, init, x, mapped, 0.5, multihead(x, weights, init["num_heads"]), device)


WIDTH = Finding("the same check passed with d_in == d_out, and your output has x's width d_in here.",
                ("the output has width d_out even when the input's width d_in differs: take it from the constructor "
                 "(self.d_out), never from x's last size",), "shapes", "probe")


@pytest.mark.parametrize("cls", FORMS)
def test_output_width_is_d_out_when_d_in_differs(stage, reference, cls, device):
    mha = reference.stage("s10_multihead_attention")
    for d_in in (8, 5):  # d_in == d_out first: a width taken from x passes that one, not the next
        r = np.random.default_rng(d_in)
        init = dict(d_in=d_in, d_out=8, context_length=6, dropout=0.0, num_heads=2, qkv_bias=True)
        x, weights = r.normal(size=(2, 6, d_in)).astype(np.float32), random_weights(r, mha_shapes(d_in, 8, True))
        mapped = mapping(reference.stage(STAGE), cls, weights, init["num_heads"])
        out = stage.forward(cls, init, x, mapped, device=device)
        width_from_x = d_in != init["d_out"] and np.shape(out)[-1:] == (d_in,)  # what a width read from x gives
        assert_close(f"{cls}(d_in={d_in}, d_out=8) output", out, mha.forward("MultiHeadAttention", init, x, weights),
                     diagnosis=[*diagnosis(stage, cls, init, x, weights, device=device),
                                *([Said(lambda values: [WIDTH])] if width_from_x else [])])


SIZES = {  # unlike the book's, so that a size read from a global shows; qkv_bias=False (biases: other checks)
    "MultiHeadAttentionCombinedQKV": (dict(d_in=7, d_out=9, context_length=11, dropout=0.0, num_heads=3),
                                      7 * 27 + 9 * 9 + 9),
    "MultiHeadAttentionPerHead": (dict(d_in=7, d_out=9, context_length=11, dropout=0.0, num_heads=3),
                                  3 * 7 * 9 + 9 * 9 + 9),
    "Head": (dict(d_in=7, head_dim=4, context_length=11, dropout=0.0), 3 * 7 * 4),
}


@pytest.mark.parametrize("cls", SIZES)
def test_sizes_come_from_the_constructor(stage, cls):
    init, count = SIZES[cls]
    check_sizes_from_arguments(stage.inspect(cls, init), init, count, cls)
