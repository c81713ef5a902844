"""Stage 9: MultiHeadAttentionWrapper.

Spec: heads is an nn.ModuleList of num_heads independent CausalAttention
modules (no shared weights); the output is the heads' outputs concatenated
along the last dimension: (b, num_tokens, num_heads * d_out).
"""
import numpy as np
import pytest

from diagnosis import (
    Attention,
    AttentionModule,
    assert_close,
    check_module_dropout,
    heads_as_one,
    module_of_heads,
    multihead,
    sizes_per_head,
)
from suite_runtime.cases import exposing_case, module_case, qkv_shapes, random_weights, single_heads

pytestmark = pytest.mark.multihead_wrapper
STAGE = "s09_multihead_wrapper"
CLS = "MultiHeadAttentionWrapper"


def diagnosis(stage, init, x, weights, **options):
    """What a failed check of the wrapper's output is diagnosed with (diagnosis.AttentionModule): causal attention in
    init["num_heads"] heads of width init["d_out"] each, side by side, no output projection."""
    spec = Attention(num_heads=init["num_heads"], out_proj=False)
    return AttentionModule(stage, CLS, init, spec, module_of_heads, sized=sizes_per_head, options=options).evidence(
        x, heads_as_one(weights, init["num_heads"]))


def head_weights(seed, num_heads, d_in, d_out, qkv_bias):
    shapes = {}
    for h in range(num_heads):
        shapes.update(qkv_shapes(d_in, d_out, qkv_bias, prefix=f"heads.{h}."))
    return random_weights(np.random.default_rng(seed), shapes)


@pytest.mark.public
def test_book_weights_two_heads(stage, public_fx):
    out = stage.forward(CLS, public_fx.init(), public_fx.x, public_fx.sub("weights/"))
    assert_close("context_vecs", out, public_fx.output,
                 diagnosis=diagnosis(stage, public_fx.init(), public_fx.x, public_fx.sub("weights/")))


@pytest.mark.public
@pytest.mark.book
def test_book_reproduction(stage, public_fx):
    """torch.manual_seed(123), then the wrapper builds head 0 and head 1 in order. No points."""
    out = stage.forward(CLS, public_fx.init(), public_fx.x, seed=123)
    assert_close("context_vecs at torch.manual_seed(123)", out, public_fx.output)


def test_three_heads_with_bias(stage, hidden_fx, device):
    init, x, weights = hidden_fx.init("case0/"), hidden_fx["case0/x"], hidden_fx.sub("case0/weights/")
    out = stage.forward(CLS, init, x, weights, device=device)
    assert_close("context_vecs", out, hidden_fx["case0/output"], diagnosis=diagnosis(stage, init, x, weights))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_output_is_the_heads_side_by_side(stage, num_heads):
    init = dict(d_in=5, d_out=3, context_length=6, dropout=0.0, num_heads=num_heads)
    x = np.random.default_rng(num_heads).normal(size=(2, 6, 5)).astype(np.float32)
    out, heads = stage.heads_forward(CLS, init, x, head_weights(num_heads, num_heads, 5, 3, False))
    assert len(heads) == num_heads, f"expected {num_heads} heads in self.heads, found {len(heads)}"
    assert_close("wrapper output", out, np.concatenate(heads, axis=-1), labels=("your heads side by side", "yours"),
                 hint="The output is the heads' outputs side by side, along the last dimension.")


def heads_built(info, d_in=None, d_out=None) -> str:
    """What the module's own parameters show about how its heads were built: each reading only where it holds.
    d_in, d_out: the constructor's, which every head's W_query must be built with (its weight (d_out, d_in))."""
    names = list(info["parameters"])
    said = []
    built = info["parameters"].get("heads.0.W_query.weight")
    if d_in and d_out and built and built != [d_out, d_in]:
        said.append(f"heads.0.W_query.weight has shape {tuple(built)} where the constructor's arguments give (d_out, "
                    f"d_in) = ({d_out}, {d_in}): each head is a CausalAttention(d_in, d_out, ...) of d_out outputs, "
                    "the wrapper's output num_heads * d_out wide")
    if info.get("unregistered"):
        said.append("not registered as submodules: " + ", ".join(info["unregistered"])
                    + " (hold the heads in nn.ModuleList)")
    if info["distinct_parameter_storages"] < info["parameter_count_with_duplicates"]:
        said.append("some heads share one weight tensor (the same module or tensor reused): create a new "
                    "CausalAttention for every head ([CausalAttention(...) for _ in range(num_heads)])")
    extra = [n for n in names if not n.startswith("heads.")]
    if extra:
        said.append(f"parameters beside the heads: {extra} (the wrapper has none of its own)")
    heads = sorted({n.split(".")[1] for n in names if n.startswith("heads.")})
    if len(heads) != 3 and not info.get("unregistered"):
        said.append(f"self.heads holds {len(heads)} heads with parameters, not num_heads = 3")
    return "; ".join(said) or f"parameters: {names}"


def test_heads_do_not_share_weights(stage):
    info = stage.inspect(CLS, dict(d_in=4, d_out=2, context_length=5, dropout=0.0, num_heads=3))
    assert info["distinct_parameter_storages"] == info["parameter_count_with_duplicates"] == 9, (
        "the 3 heads should own 9 separate weight matrices (W_query, W_key, W_value each); found "
        f"{info['distinct_parameter_storages']} distinct of {info['parameter_count_with_duplicates']}: "
        + heads_built(info, d_in=4, d_out=2))
    shapes = {n: s for n, s in info["parameters"].items()}
    assert shapes.get("heads.2.W_query.weight") == [2, 4], (
        f"heads.2.W_query.weight should have shape (d_out, d_in) = (2, 4); parameters: {shapes}"
    )


def test_any_length_and_bias(stage, reference, device):
    init = dict(d_in=4, d_out=2, context_length=9, dropout=0.0, num_heads=2, qkv_bias=True)
    x = np.random.default_rng(3).normal(size=(3, 5, 4)).astype(np.float32)
    w = head_weights(3, 2, 4, 2, True)
    assert_close("context_vecs (5 of 9 tokens, qkv_bias=True)", stage.forward(CLS, init, x, w, device=device),
                 reference.stage(STAGE).forward(CLS, init, x, w), diagnosis=diagnosis(stage, init, x, w))


def test_random_cases(stage, reference, rng, device):
    init, x, weights = module_case(rng, reference.stage(STAGE), CLS, heads=True)
    assert_close(f"wrapper({init}) on x {x.shape}", stage.forward(CLS, init, x, weights, device=device),
                 reference.stage(STAGE).forward(CLS, init, x, weights), diagnosis=diagnosis(stage, init, x, weights))


def test_every_head_drops_in_training_mode_only(stage, device):
    """Each head's values are the one-hot inputs, so the output is every head's attention weights side
    by side: the wrapper must hand dropout to its heads, which apply it in training mode only."""
    init, x, weights = exposing_case(np.random.default_rng(9), num_heads=3, num_tokens=7, batch=32)
    init["d_out"] = 7  # each head's width
    exposed = multihead(x, weights, 3, out_proj=False)  # the heads' weights side by side
    check_module_dropout(stage, CLS, init, x, single_heads(weights, 3), 0.5, exposed, device)
