"""Stage k03: FlashAttention-2's forward pass in Triton.

Spec: flash_attention_forward(q, k, v, is_causal=False, block_m=16, block_n=16) with q, k, v (b, num_heads, T, d)
returns (o, lse): o = softmax(q k^T / sqrt(d)) v, (b, num_heads, T, d) in q's dtype, and lse (b, num_heads, T)
float32, the natural log of each row's softmax denominator, logsumexp_j(q_i . k_j / sqrt(d)) (with is_causal over
j <= i); by attention_kernel, one program per tile of block_m queries of one head, the key tiles of block_n folded
into a running max, sum and accumulator (the online softmax), the key tiles after a causal query tile skipped. Any
tile sizes give the same values; so does any order of the key tiles.

Expected values: NumPy float64. Tolerances: float32 tl.dot against float64 (rtol 1e-4, atol 1e-5); scores of size
~100 carry float32 rounding of ~1e-5 each, which moves weights by as much relative (LARGE_LOGITS: rtol = atol =
1e-3, far below what a forgotten rescaling gives). CUDA: TF32 (tl.dot rounds float32 inputs to TF32 on a GPU:
rtol = atol = 1e-2) and bfloat16 (diagnosis.BFLOAT16), against SDPA in float32 on the same rounded inputs.
"""
from functools import cache

import numpy as np
import pytest

from diagnosis import BFLOAT16, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.flash_forward
STAGE = "k03_flash_forward"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
LARGE_LOGITS = dict(rtol=1e-3, atol=1e-3)
TF32 = dict(rtol=1e-2, atol=1e-2)


def evidence(stage, q, k, v, causal, bm, bn):
    """(diagnosis of o, diagnosis of lse): the tiled forward's switches, searched on this case and told apart on a
    second (the same heads, five tokens fewer and two features more, so that other tiles are partial); the learner's
    kernel runs on it once, for both."""
    t = q.shape[-2]

    @cache
    def second_case():
        q2, k2, v2 = (np.ascontiguousarray(np.concatenate([a, a[..., :2]], axis=-1)[..., :max(1, t - 5), :])
                      for a in (q, k, v))
        return stage.flash_attention_forward(q2, k2, v2, is_causal=causal, block_m=bm, block_n=bn), (q2, k2, v2)

    def second(part):
        def made():
            ours, (q2, k2, v2) = second_case()
            return ours[part], lambda c: K.forward(q2, k2, v2, causal, bm, bn, c)[part]
        return made

    return ([Searched(lambda c: K.forward(q, k, v, causal, bm, bn, c)[0],
                      K.relevant(K.FORWARD_SWITCHES, causal, t, bm, bn), "your output", second(0))],
            [Searched(lambda c: K.forward(q, k, v, causal, bm, bn, c)[1],
                      K.relevant(K.LSE_SWITCHES, causal, t, bm, bn), "your log-sum-exps", second(1))])


def check(stage, q, k, v, causal, what, bm=16, bn=16, stored=None, tolerance=FLOAT32):
    o, lse = stage.flash_attention_forward(q, k, v, is_causal=causal, block_m=bm, block_n=bn)
    expected_o, expected_lse = K.attention(q, k, v, causal) if stored is None else stored
    about_o, about_lse = evidence(stage, q, k, v, causal, bm, bn)
    name = f"({what}, is_causal={causal}, block_m={bm}, block_n={bn})"
    assert_close(f"o {name}", o, expected_o, **tolerance, diagnosis=about_o)
    assert_close(f"lse {name}", lse, expected_lse, **tolerance, diagnosis=about_lse)


# ---------------------------------------------------------------- public

@pytest.mark.public
@pytest.mark.parametrize("is_causal", [False, True])
def test_small_example(stage, public_fx, is_causal):
    """20 tokens, 2 heads of 6 features, tiles of 16: the second query tile and key tile are partial."""
    check(stage, public_fx.q, public_fx.k, public_fx.v, is_causal, "q, k, v (1, 2, 20, 6)",
          stored=(public_fx[f"o_causal_{is_causal}"], public_fx[f"lse_causal_{is_causal}"]))


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("is_causal", [False, True])
def test_tiles_of_two_sizes(stage, hidden_fx, is_causal):
    """37 tokens, query tiles of 32 and key tiles of 16, d = 12 padded to 16."""
    q, k, v = (hidden_fx[f"ragged/{n}"] for n in "qkv")
    check(stage, q, k, v, is_causal, "37 tokens, d = 12", bm=32, bn=16)


@pytest.mark.parametrize("is_causal", [False, True])
def test_large_logits(stage, hidden_fx, is_causal):
    """q scaled by 30 and the keys that score highest last: every key tile raises the running max by a lot, so the
    running sum and the accumulator must be rescaled each time (and exp taken relative to the max)."""
    q, k, v = (hidden_fx[f"large_logits/{n}"] for n in "qkv")
    check(stage, q, k, v, is_causal, "q scaled by 30", tolerance=LARGE_LOGITS)


def test_random_case(stage, rng):
    b, h, t, d = 1, int(rng.integers(1, 3)), int(rng.integers(2, 40)), int(rng.integers(1, 20))
    q, k, v = (normal(rng, b, h, t, d) for _ in range(3))
    check(stage, q, k, v, bool(rng.integers(2)), f"q, k, v {q.shape}", bm=int(rng.choice([16, 32])),
          bn=int(rng.choice([16, 32])))


SIZES = {  # the CUDA case: a layer of Llama 2 7B, 32 heads of 128 over 4096 tokens
    "cpu": dict(b=1, h=2, t=48, d=16, dtypes=("float32",), blocks=(16, 16)),
    # tiles of 64 x 32: in float32, 64 x 64 tiles need 177 KiB of shared memory, more than an A100 has (163 KiB)
    "cuda": dict(b=1, h=32, t=4096, d=128, dtypes=("float32", "bfloat16"), blocks=(64, 32)),
    # the dry run: float32 only (Triton 3.9's interpreter computes tl.dot of bfloat16 tiles wrongly)
    "dry run": dict(b=1, h=2, t=96, d=32, dtypes=("float32",), blocks=(32, 16)),
}


@pytest.mark.parametrize("is_causal", [False, True])
def test_llama_sized_heads(stage, target, is_causal):
    """o against F.scaled_dot_product_attention and lse against torch.logsumexp, in float32 on the same rounded
    inputs, on the device."""
    import torch
    import torch.nn.functional as F

    size = SIZES[target.size]
    rng = np.random.default_rng(4096)
    q, k, v = (normal(rng, size["b"], size["h"], size["t"], size["d"]) for _ in range(3))
    bm, bn = size["blocks"]
    for dtype in size["dtypes"]:
        [(o, lse)] = stage.session(None, steps=[{"function": "flash_attention_forward", "args": [q, k, v], "kwargs": {
            "is_causal": is_causal, "block_m": bm, "block_n": bn}}], device=target.device, dtype=dtype)
        qt, kt, vt = (torch.from_numpy(a).to(device=target.device, dtype=getattr(torch, dtype)).float()
                      for a in (q, k, v))
        s = qt @ kt.transpose(-1, -2) / size["d"] ** 0.5
        if is_causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -torch.inf)
        tolerance = BFLOAT16 if dtype == "bfloat16" else TF32 if target.cuda else FLOAT32
        what = f"({target.device}, {dtype}, T={size['t']}, {size['h']} heads, is_causal={is_causal})"
        about_o, about_lse = ((), ()) if target.cuda else evidence(stage, q, k, v, is_causal, bm, bn)
        assert_close(f"o {what}", o, F.scaled_dot_product_attention(qt, kt, vt, is_causal=is_causal).cpu().numpy(),
                     **tolerance, diagnosis=about_o)
        assert_close(f"lse {what}", lse, torch.logsumexp(s, dim=-1).cpu().numpy(), **tolerance, diagnosis=about_lse)


@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """Causal attention, 32 heads of 128 over 4096 tokens in bfloat16 on a GPU, tiles of 64 x 64: against the
    reference kernel (SDPA, FlashAttention's own kernels, shown beside them)."""
    import torch.nn.functional as F

    speed.require(impl, request.config)
    rng = np.random.default_rng(9)
    q, k, v = (normal(rng, 1, 32, 4096, 128) for _ in range(3))
    speed.check(stage, fraction, STAGE, "flash_attention_forward", [q, k, v],
                {"is_causal": True, "block_m": 64, "block_n": 64},
                {"F.scaled_dot_product_attention": lambda *t: F.scaled_dot_product_attention(*t, is_causal=True)},
                what="bfloat16, causal, 32 heads of 128, T = 4096")
