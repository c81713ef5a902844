"""Stage k05: flash decoding, one query token against a long cache, the keys split across programs.

Spec: split_partials(q, k, v, num_splits=4, block_n=16) with q (b, num_heads, d) and k, v (b, num_heads, T, d)
returns (partial_o (b, num_heads, num_splits, d), partial_lse (b, num_heads, num_splits)), float32: split s holds the
keys [s * chunk, min((s + 1) * chunk, T)), chunk = cdiv(T, num_splits); its output is the softmax over its own keys
of q.k / sqrt(d) times their values, its lse the natural log of its sum of exp(q.k / sqrt(d)); a split with no key
gives 0 and -inf. combine_splits(partial_o, partial_lse) returns (o (b, num_heads, d), lse (b, num_heads)) float32,
the splits weighed by exp(lse_s - max lse): exactly softmax over all keys (and its log-sum-exp), with no overflow for
lse values in the hundreds. flash_decode(q, k, v, num_splits=4, block_n=16) = combine_splits(split_partials(...))'s
o in q's dtype. Any block_n gives the same values.

Expected values: NumPy float64. Tolerance: float32 against float64 (rtol 1e-4, atol 1e-5); scores of size ~100
(LARGE_LOGITS: rtol = atol = 1e-3). CUDA: against SDPA with one query, float32 (rtol 1e-4, atol 1e-5: no tl.dot
here) and bfloat16 (diagnosis.BFLOAT16).
"""
from functools import cache

import numpy as np
import pytest

from diagnosis import BFLOAT16, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.flash_decoding
STAGE = "k05_flash_decoding"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
LARGE_LOGITS = dict(rtol=1e-3, atol=1e-3)


def second_inputs(q, k, v):
    """A second case: the same heads, two features more and three keys fewer (the splits cut elsewhere)."""
    t = k.shape[-2]
    q2 = np.ascontiguousarray(np.concatenate([q, q[..., :2]], axis=-1))
    k2, v2 = (np.ascontiguousarray(np.concatenate([a, a[..., :2]], axis=-1)[..., :max(1, t - 3), :]) for a in (k, v))
    return q2, k2, v2


def evidence(stage, q, k, v, splits, block):
    """(diagnosis of the partial outputs, of the partial lse, of flash_decode's output): the splits' and the
    combine's switches, searched here and told apart on a second case (run once for the partials)."""
    q2, k2, v2 = second_inputs(q, k, v)

    @cache
    def partials2():
        return stage.split_partials(q2, k2, v2, num_splits=splits, block_n=block)

    def second(part):
        return lambda: (partials2()[part], lambda c: K.decode_partials(q2, k2, v2, splits, block, c)[part])

    def second_o():
        return (stage.flash_decode(q2, k2, v2, num_splits=splits, block_n=block),
                lambda c: K.decode(q2, k2, v2, splits, block, c))

    return ([Searched(lambda c: K.decode_partials(q, k, v, splits, block, c)[0], K.PARTIAL_SWITCHES,
                      "your partial outputs", second(0))],
            [Searched(lambda c: K.decode_partials(q, k, v, splits, block, c)[1], K.PARTIAL_SWITCHES,
                      "your partial log-sum-exps", second(1))],
            [Searched(lambda c: K.decode(q, k, v, splits, block, c), K.DECODE_SWITCHES, "your output", second_o)])


def check(stage, q, k, v, splits, block, what, tolerance=FLOAT32, stored=None):
    """split_partials and flash_decode against NumPy (or the values stored for the public example)."""
    about_o, about_lse, about_decode = evidence(stage, q, k, v, splits, block)
    partial_o, partial_lse = stage.split_partials(q, k, v, num_splits=splits, block_n=block)
    right_o, right_lse = K.decode_partials(q, k, v, splits, block) if stored is None else stored[:2]
    name = f"({what}, num_splits={splits}, block_n={block})"
    assert_close(f"partial_o {name}", partial_o, right_o, **tolerance, diagnosis=about_o)
    assert_close(f"partial_lse {name}", partial_lse, right_lse, **tolerance, diagnosis=about_lse)
    out = stage.flash_decode(q, k, v, num_splits=splits, block_n=block)
    expected = K.attention(np.asarray(q)[..., None, :], k, v, False)[0][..., 0, :] if stored is None else stored[2]
    assert_close(f"flash_decode{name}", out, expected, **tolerance, diagnosis=about_decode)


def check_combine(stage, partial_o, partial_lse, what, tolerance=FLOAT32):
    o, lse = stage.combine_splits(partial_o, partial_lse)
    right_o, right_lse = K.combine(partial_o, partial_lse)

    def compute(part):
        return lambda c: K.combine(partial_o, partial_lse, c)[part]

    assert_close(f"o of combine_splits({what})", o, right_o, **tolerance,
                 diagnosis=[Searched(compute(0), K.COMBINE_SWITCHES, "your combined output")])
    assert_close(f"lse of combine_splits({what})", lse, right_lse, **tolerance,
                 diagnosis=[Searched(compute(1), K.COMBINE_SWITCHES, "your combined log-sum-exp")])


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_small_example(stage, public_fx):
    """One query per head (2 heads of 8) against 30 keys in 3 splits of 10, tiles of 16: each split one partial
    tile."""
    fx = public_fx
    check(stage, fx.q, fx.k, fx.v, int(fx.num_splits), 16, "q (1, 2, 8), k, v (1, 2, 30, 8)",
          stored=(fx.partial_o, fx.partial_lse, fx.o))


@pytest.mark.public
def test_combine_the_small_example(stage, public_fx):
    """combine_splits on the example's partial results: softmax over all 30 keys."""
    check_combine(stage, public_fx.partial_o, public_fx.partial_lse, "the example's 3 splits")


# ---------------------------------------------------------------- hidden

def test_long_cache(stage, hidden_fx):
    """75 keys in 4 splits of 19 (the last of 18), tiles of 8: several tiles per split, a partial one at each
    split's end, where the next split's keys begin."""
    q, k, v = (hidden_fx[f"long/{n}"] for n in "qkv")
    check(stage, q, k, v, 4, 8, "2 sequences, 75 keys")


def test_splits_with_no_key(stage, hidden_fx):
    """5 keys in 8 splits of 1: splits 5, 6 and 7 hold no key (0 and -inf), and must weigh nothing (not NaN)."""
    q, k, v = (hidden_fx[f"few_keys/{n}"] for n in "qkv")
    check(stage, q, k, v, 8, 16, "5 keys, 8 splits")


def test_large_logits(stage, hidden_fx):
    """q scaled by 40: the splits' lse reach the hundreds, where exp(lse) overflows float32 unless the largest is
    subtracted first."""
    q, k, v = (hidden_fx[f"large_logits/{n}"] for n in "qkv")
    check(stage, q, k, v, 3, 16, "q scaled by 40", tolerance=LARGE_LOGITS)


def test_combine_given_partials(stage, rng):
    """Partial results of 5 splits, one empty (lse -inf, output 0), the others' lse from -3 to 300."""
    partial_o = normal(rng, 2, 3, 5, 7)
    partial_lse = np.stack([rng.uniform(-3, 3, (2, 3)), np.full((2, 3), -np.inf), rng.uniform(280, 300, (2, 3)),
                            rng.uniform(0, 5, (2, 3)), rng.uniform(290, 300, (2, 3))], axis=-1).astype(np.float32)
    partial_o[..., 1, :] = 0.0
    check_combine(stage, partial_o, partial_lse, "5 splits, one empty, lse up to 300", tolerance=LARGE_LOGITS)


def test_random_case(stage, rng):
    b, h, t, d = int(rng.integers(1, 3)), 1, int(rng.integers(1, 50)), int(rng.integers(1, 17))
    q, k, v = normal(rng, b, h, d), normal(rng, b, h, t, d), normal(rng, b, h, t, d)
    check(stage, q, k, v, int(rng.integers(1, 6)), int(rng.choice([4, 8, 16])), f"q {q.shape}, k {k.shape}")


SIZES = {  # the CUDA case: Llama 2 7B decoding, 32 heads of 128, 8 sequences with 8192 cached tokens, 16 splits
    "cpu": dict(b=2, h=2, t=64, d=16, splits=4, block=16, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=8, h=32, t=8192, d=128, splits=16, block=64, dtypes=("float32", "bfloat16")),
    "dry run": dict(b=1, h=2, t=200, d=32, splits=8, block=16, dtypes=("float32", "bfloat16")),
}


def test_llama_sized_decoding(stage, target):
    """flash_decode against F.scaled_dot_product_attention with one query, in float32 on the same rounded inputs, on
    the device."""
    import torch
    import torch.nn.functional as F

    size = SIZES[target.size]
    rng = np.random.default_rng(8192)
    q = normal(rng, size["b"], size["h"], size["d"])
    k, v = (normal(rng, size["b"], size["h"], size["t"], size["d"]) for _ in range(2))
    for dtype in size["dtypes"]:
        [out] = stage.session(None, steps=[{"function": "flash_decode", "args": [q, k, v], "kwargs": {
            "num_splits": size["splits"], "block_n": size["block"]}}], device=target.device, dtype=dtype)
        qt, kt, vt = (torch.from_numpy(a).to(device=target.device, dtype=getattr(torch, dtype)).float()
                      for a in (q, k, v))
        expected = F.scaled_dot_product_attention(qt[:, :, None], kt, vt)[:, :, 0].cpu().numpy()
        about = () if target.cuda or dtype != "float32" else evidence(stage, q, k, v, size["splits"], size["block"])[2]
        assert_close(f"flash_decode ({target.device}, {dtype}, T={size['t']}, {size['h']} heads)", out, expected,
                     **(BFLOAT16 if dtype == "bfloat16" else FLOAT32), diagnosis=about)


@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """One query per head against 16384 cached tokens, 8 sequences of 32 heads of 128 in bfloat16 on a GPU, 16
    splits: against the reference kernels (SDPA with one query shown beside them)."""
    import torch.nn.functional as F

    speed.require(impl, request.config)
    rng = np.random.default_rng(11)
    q = normal(rng, 8, 32, 128)
    k, v = (normal(rng, 8, 32, 16384, 128) for _ in range(2))
    speed.check(stage, fraction, STAGE, "flash_decode", [q, k, v], {"num_splits": 16, "block_n": 64},
                {"F.scaled_dot_product_attention": lambda qt, kt, vt: F.scaled_dot_product_attention(
                    qt[:, :, None], kt, vt)[:, :, 0]}, what="bfloat16, 8 x 32 heads of 128, T = 16384")
