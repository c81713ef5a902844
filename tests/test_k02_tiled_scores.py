"""Stage k02: attention weights in tiles, with tl.dot, causal masking inside a tile and the tiles above it skipped.

Spec: attention_weights(q, k, is_causal=False, block_m=16, block_n=16) with q, k (b, num_heads, T, d) returns
softmax(q k^T / sqrt(d), dim=-1), (b, num_heads, T, T) in q's dtype, by weights_kernel: one program per tile of block_m
queries of one head, its key tiles of block_n walked three times (max, sum, weights); with is_causal query i attends
to keys j <= i, the key tiles after the query tile's last row skipped (their weights are exactly 0), the tiles that
cross the diagonal masked inside. Any tile sizes (powers of 2 >= 16, block_m != block_n too) give the same values,
for every T >= 1 and d >= 1 (d padded to BLOCK_D).

Expected values: NumPy float64. Tolerance: float32 tl.dot against float64 (rtol 1e-4, atol 1e-6; weights lie in
[0, 1]); the CUDA case in float32 allows TF32 (tl.dot rounds float32 inputs to TF32 on a GPU by default, 10 bits of
mantissa: rtol = atol = 1e-2) and bfloat16 diagnosis.BFLOAT16.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, About, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.tiled_scores
STAGE = "k02_tiled_scores"
FLOAT32 = dict(rtol=1e-4, atol=1e-6)
TF32 = dict(rtol=1e-2, atol=1e-2)


def expected(q, k, causal):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def evidence(stage, q, k, causal, bm, bn):
    """The tiled weights' switches, searched on this case and told apart on a second one: the same heads, four
    tokens fewer (other tiles fill up) and two features more."""
    t = q.shape[-2]

    def second():
        q2, k2 = (np.ascontiguousarray(np.concatenate([a, a[..., :2]], axis=-1)[..., :max(1, t - 4), :])
                  for a in (q, k))
        out = stage.attention_weights(q2, k2, is_causal=causal, block_m=bm, block_n=bn)
        return out, lambda c: K.weights(q2, k2, causal, bm, bn, c)

    return [Searched(lambda c: K.weights(q, k, causal, bm, bn, c),
                     K.relevant(K.WEIGHTS_SWITCHES, causal, t, bm, bn), "your weights", second)]


def check(stage, q, k, causal, what, bm=16, bn=16, stored=None):
    out = stage.attention_weights(q, k, is_causal=causal, block_m=bm, block_n=bn)
    name = f"attention_weights({what}, is_causal={causal}, block_m={bm}, block_n={bn})"
    diagnosis = evidence(stage, q, k, causal, bm, bn)
    assert_close(name, out, expected(q, k, causal) if stored is None else stored, **FLOAT32, diagnosis=diagnosis)
    if causal:  # exactly 0: skipped tiles keep the output's zeros, masked scores give exp(-inf) = 0
        future = np.asarray(out)[..., np.triu(np.ones((q.shape[-2],) * 2, bool), 1)]
        assert_close(f"{name}: weights above the diagonal", future, np.zeros_like(future), rtol=0, atol=0,
                     diagnosis=[About(out, diagnosis)])


# ---------------------------------------------------------------- public

@pytest.mark.public
@pytest.mark.parametrize("is_causal", [False, True])
def test_small_example(stage, public_fx, is_causal):
    """20 tokens, 2 heads of 6 features, tiles of 16: two query tiles, the second partial; with is_causal the first
    tile of queries skips the second tile of keys."""
    check(stage, public_fx.q, public_fx.k, is_causal, "q, k (1, 2, 20, 6)",
          stored=public_fx[f"weights_causal_{is_causal}"])


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("is_causal", [False, True])
def test_tiles_of_two_sizes(stage, hidden_fx, is_causal):
    """37 tokens in query tiles of 32 and key tiles of 16: the causal loop ends after the query tile's last row
    (32), not after a key tile; d = 12 padded to 16."""
    check(stage, hidden_fx["ragged/q"], hidden_fx["ragged/k"], is_causal, "37 tokens, d = 12", bm=32, bn=16)


@pytest.mark.parametrize("is_causal", [False, True])
def test_wide_heads(stage, hidden_fx, is_causal):
    """23 tokens, 2 sequences of one head of 24 features (BLOCK_D = 32): the scale is 1 / sqrt(24)."""
    check(stage, hidden_fx["wide_heads/q"], hidden_fx["wide_heads/k"], is_causal, "2 x 1 heads of 24, T = 23")


def test_random_case(stage, rng):
    b, h, t, d = 1, int(rng.integers(1, 3)), int(rng.integers(3, 40)), int(rng.integers(1, 20))
    q, k = normal(rng, b, h, t, d), normal(rng, b, h, t, d)
    bm, bn = int(rng.choice([16, 32])), int(rng.choice([16, 32]))
    check(stage, q, k, bool(rng.integers(2)), f"q, k {q.shape}", bm=bm, bn=bn)


SIZES = {  # the CUDA case: 8 of a Llama layer's heads of 128 over 2048 tokens (the weights are T x T per head)
    "cpu": dict(b=1, h=2, t=40, d=16, dtypes=("float32",)),
    "cuda": dict(b=1, h=8, t=2048, d=128, dtypes=("float32", "bfloat16")),
    # the dry run: the CUDA case's code on the CPU, float32 only (Triton 3.9's interpreter computes tl.dot of
    # bfloat16 tiles wrongly: it has no bfloat16 of its own)
    "dry run": dict(b=1, h=2, t=64, d=32, dtypes=("float32",)),
}


def test_llama_sized_heads(stage, target):
    """Causal weights compared with torch.softmax of the masked scores in float32 on the same rounded inputs, on
    the device; tiles of 64 x 32."""
    import torch

    size = SIZES[target.size]
    rng = np.random.default_rng(2048)
    q, k = (normal(rng, size["b"], size["h"], size["t"], size["d"]) for _ in range(2))
    for dtype in size["dtypes"]:
        [out] = stage.session(None, steps=[{"function": "attention_weights", "args": [q, k],
                                            "kwargs": {"is_causal": True, "block_m": 64, "block_n": 32}}],
                              device=target.device, dtype=dtype)
        qt, kt = (torch.from_numpy(a).to(device=target.device, dtype=getattr(torch, dtype)).float() for a in (q, k))
        s = qt @ kt.transpose(-1, -2) / size["d"] ** 0.5
        s = s.masked_fill(torch.ones(size["t"], size["t"], dtype=torch.bool, device=target.device).triu(1), -torch.inf)
        tolerance = BFLOAT16 if dtype == "bfloat16" else TF32 if target.cuda else FLOAT32
        assert_close(f"attention_weights ({target.device}, {dtype}, T={size['t']}, {size['h']} heads)", out,
                     torch.softmax(s, dim=-1).cpu().numpy(), **tolerance,
                     diagnosis=() if target.cuda or dtype != "float32" else evidence(stage, q, k, True, 64, 32))


@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """Causal weights of 8 heads of 128 over 2048 tokens in bfloat16 on a GPU, tiles of 64 x 32: against the
    reference kernel (and torch's masked softmax of q k^T, shown beside them)."""
    import torch

    speed.require(impl, request.config)
    rng = np.random.default_rng(8)
    q, k = (normal(rng, 1, 8, 2048, 128) for _ in range(2))

    def torch_weights(qt, kt):
        s = (qt @ kt.transpose(-1, -2)).float() / 128 ** 0.5
        return torch.softmax(s.masked_fill(torch.ones(2048, 2048, dtype=torch.bool, device=qt.device).triu(1),
                                           -torch.inf), dim=-1).to(qt.dtype)

    speed.check(stage, fraction, STAGE, "attention_weights", [q, k],
                {"is_causal": True, "block_m": 64, "block_n": 32}, {"torch (matmul, mask, softmax)": torch_weights},
                what="bfloat16, causal, 8 heads of 128, T = 2048")
