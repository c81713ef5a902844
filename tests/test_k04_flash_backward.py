"""Stage k04: FlashAttention-2's backward pass in Triton, and an autograd.Function around k03 and k04.

Spec: flash_attention_backward(q, k, v, o, lse, do, is_causal=False, block_m=16, block_n=16) with q, k, v, o, do
(b, num_heads, T, d) and lse (b, num_heads, T) (stage k03's) returns (dq, dk, dv), the gradients of
<do, softmax(q k^T / sqrt(d)) v> with respect to q, k and v, each in its input's dtype: the weights recomputed from
lse (p = exp(s - lse)), D = rowsum(do * o), dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = dS K / sqrt(d),
dK = dS^T Q / sqrt(d); with is_causal the same for keys j <= i only. Any tile sizes give the same values. The checks
give it the right o and lse (so that a mistake of the forward costs nothing here). flash_attention(q, k, v,
is_causal=False) is differentiable through FlashAttention (torch.autograd.Function): its gradients equal SDPA's.

Expected values: NumPy float64 (the gradients of attention written out). Tolerance: float32 tl.dot against float64,
gradients summed over up to 40 rows (rtol 1e-4, atol 2e-5). CUDA: against torch's SDPA backward in float32 on the
same rounded inputs, TF32 (rtol = atol = 2e-2: each gradient is a sum over 2048 tl.dot products of TF32-rounded
tiles) and bfloat16 (rtol = atol = 5e-2: dS rounded to bfloat16 for tl.dot, summed over 2048 rows).
"""
from functools import cache

import numpy as np
import pytest

from diagnosis import Listed, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.flash_backward
STAGE = "k04_flash_backward"
FLOAT32 = dict(rtol=1e-4, atol=2e-5)
TF32 = dict(rtol=2e-2, atol=2e-2)
BF16_GRADIENTS = dict(rtol=5e-2, atol=5e-2)
NAMES = ("dq", "dk", "dv")


def swapped(grads, which):
    """A gradient returned in another's place (the order of backward's returns is forward's inputs' order)."""
    return {f"the gradient returned in {which}'s place is {other}: backward returns the gradients in the order of "
            "forward's inputs, (dq, dk, dv, None)": grads[j] for j, other in enumerate(NAMES) if other != which}


def evidence(stage, q, k, v, do, causal, bm, bn):
    """Per gradient, the backward's switches searched on this case and told apart on a second one (the same heads,
    five tokens fewer and two features more); the learner's kernels run on it once, for all three gradients."""
    t = q.shape[-2]
    switches = K.relevant(K.backward_switches(causal), causal, t, bm, bn)

    @cache
    def second_case():
        q2, k2, v2, do2 = (np.ascontiguousarray(np.concatenate([a, a[..., :2]], axis=-1)[..., :max(1, t - 5), :])
                           for a in (q, k, v, do))
        o2, lse2 = (a.astype(np.float32) for a in K.attention(q2, k2, v2, causal))
        ours = stage.flash_attention_backward(q2, k2, v2, o2, lse2, do2, is_causal=causal, block_m=bm, block_n=bn)
        return ours, (q2, k2, v2, do2)

    def second(part):
        def made():
            ours, (q2, k2, v2, do2) = second_case()
            return ours[part], lambda c: K.backward(q2, k2, v2, do2, causal, bm, bn, c)[part]
        return made

    right = K.backward(q, k, v, do, causal, bm, bn)
    return [[Searched(lambda c, part=part: K.backward(q, k, v, do, causal, bm, bn, c)[part], switches,
                      f"your {NAMES[part]}", second(part)), Listed(swapped(right, NAMES[part]))]
            for part in range(3)]


def inputs(q, k, v, causal):
    """The right o and lse, in float32, given to the backward."""
    return tuple(a.astype(np.float32) for a in K.attention(q, k, v, causal))


def check(stage, q, k, v, do, causal, what, bm=16, bn=16, stored=None, given=None):
    o, lse = inputs(q, k, v, causal) if given is None else given
    grads = stage.flash_attention_backward(q, k, v, o, lse, do, is_causal=causal, block_m=bm, block_n=bn)
    expected = K.backward(q, k, v, do, causal, bm, bn) if stored is None else stored
    for name, got, want, about in zip(NAMES, grads, expected, evidence(stage, q, k, v, do, causal, bm, bn)):
        assert_close(f"{name} ({what}, is_causal={causal}, block_m={bm}, block_n={bn})", got, want, **FLOAT32,
                     diagnosis=about)


def check_autograd(stage, q, k, v, do, causal, what):
    """flash_attention's output and the gradients autograd gives its inputs, for the gradient ``do`` of the output."""
    out, grads = stage.run("grad", func="flash_attention", args=[q, k, v], grad_output=do,
                           kwargs={"is_causal": causal})
    o, _ = K.attention(q, k, v, causal)
    assert_close(f"flash_attention({what}, is_causal={causal})", out, o, **FLOAT32)
    right = K.backward(q, k, v, do, causal, 16, 16)
    for name, got, want in zip(NAMES, grads, right):
        assert got is not None, (
            f"autograd gave {name[1:]} no gradient through flash_attention: FlashAttention.forward must take q, k "
            "and v as its inputs (FlashAttention.apply(q, k, v, is_causal)) and backward return their gradients")
        assert_close(f"{name[1:]}.grad through flash_attention ({what}, is_causal={causal})", got, want, **FLOAT32,
                     diagnosis=[Listed(swapped(right, name))])


# ---------------------------------------------------------------- public

@pytest.mark.public
@pytest.mark.parametrize("is_causal", [False, True])
def test_small_example(stage, public_fx, is_causal):
    """20 tokens, 2 heads of 6 features, tiles of 16, with stage k03's o and lse."""
    fx = public_fx
    check(stage, fx.q, fx.k, fx.v, fx.do, is_causal, "q, k, v, do (1, 2, 20, 6)",
          stored=tuple(fx[f"{g}_causal_{is_causal}"] for g in NAMES),
          given=(fx[f"o_causal_{is_causal}"], fx[f"lse_causal_{is_causal}"]))


@pytest.mark.public
@pytest.mark.parametrize("is_causal", [False, True])
def test_autograd_function(stage, public_fx, is_causal):
    """loss = <do, flash_attention(q, k, v)>, backpropagated by torch's autograd through FlashAttention."""
    check_autograd(stage, public_fx.q, public_fx.k, public_fx.v, public_fx.do, is_causal, "q, k, v (1, 2, 20, 6)")


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("is_causal", [False, True])
def test_tiles_of_two_sizes(stage, hidden_fx, is_causal):
    """37 tokens, query tiles of 16 and key tiles of 32, d = 12: the key tiles' causal loop starts at the query
    tile holding their first key."""
    q, k, v, do = (hidden_fx[f"ragged/{n}"] for n in ("q", "k", "v", "do"))
    check(stage, q, k, v, do, is_causal, "37 tokens, d = 12", bm=16, bn=32)


def test_random_case(stage, rng):
    b, h, t, d = 1, int(rng.integers(1, 3)), int(rng.integers(2, 36)), int(rng.integers(1, 18))
    q, k, v, do = (normal(rng, b, h, t, d) for _ in range(4))
    causal = bool(rng.integers(2))
    check(stage, q, k, v, do, causal, f"q, k, v, do {q.shape}", bm=int(rng.choice([16, 32])),
          bn=int(rng.choice([16, 32])))
    check_autograd(stage, q, k, v, do, causal, f"q, k, v {q.shape}")


SIZES = {  # the CUDA case: 8 heads of 128 of a Llama layer over 2048 tokens, trained through FlashAttention
    "cpu": dict(b=1, h=2, t=40, d=16, dtypes=("float32",)),
    "cuda": dict(b=1, h=8, t=2048, d=128, dtypes=("float32", "bfloat16")),
    # the dry run: float32 only (Triton 3.9's interpreter computes tl.dot of bfloat16 tiles wrongly)
    "dry run": dict(b=1, h=2, t=80, d=32, dtypes=("float32",)),
}


def test_llama_sized_gradients(stage, target):
    """Causal: flash_attention's gradients (through autograd) against F.scaled_dot_product_attention's, in float32
    on the same rounded inputs, on the device."""
    import torch
    import torch.nn.functional as F

    size = SIZES[target.size]
    rng = np.random.default_rng(2049)
    q, k, v, do = (normal(rng, size["b"], size["h"], size["t"], size["d"]) for _ in range(4))
    for dtype in size["dtypes"]:
        out, grads = stage.run("grad", func="flash_attention", args=[q, k, v], grad_output=do,
                               kwargs={"is_causal": True}, device=target.device, dtype=dtype)
        leaves = [torch.from_numpy(a).to(device=target.device, dtype=getattr(torch, dtype)).float().requires_grad_()
                  for a in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(torch.from_numpy(do).to(target.device))
        tolerance = BF16_GRADIENTS if dtype == "bfloat16" else TF32 if target.cuda else FLOAT32
        for name, got, leaf in zip(NAMES, grads, leaves):
            assert got is not None, f"autograd gave {name[1:]} no gradient through flash_attention"
            expected = leaf.grad.cpu().numpy()
            scale = float(np.abs(expected).max())  # gradients are compared relative to their size
            assert_close(f"{name[1:]}.grad ({target.device}, {dtype}, T={size['t']}, {size['h']} heads)",
                         np.asarray(got) / scale, expected / scale, **tolerance)


@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """The backward of causal attention, 32 heads of 128 over 4096 tokens in bfloat16 on a GPU: your kernels against
    the reference's (SDPA's backward shown beside them)."""
    import torch
    import torch.nn.functional as F

    speed.require(impl, request.config)
    rng = np.random.default_rng(10)
    q, k, v, do = (normal(rng, 1, 32, 4096, 128) for _ in range(4))
    qt, kt, vt = (torch.from_numpy(a).cuda() for a in (q, k, v))  # the right o and lse, in float32 on the GPU
    s = (qt @ kt.transpose(-1, -2) / 128 ** 0.5).masked_fill(
        torch.ones(4096, 4096, dtype=torch.bool, device="cuda").triu(1), -torch.inf)
    o, lse = (torch.softmax(s, dim=-1) @ vt).cpu().numpy(), torch.logsumexp(s, dim=-1).cpu().numpy()
    del s

    def sdpa_backward(qt, kt, vt, ot, lt, dot):
        leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]
        with torch.enable_grad():
            return torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves, dot)

    speed.check(stage, fraction, STAGE, "flash_attention_backward", [q, k, v, o, lse, do],
                {"is_causal": True, "block_m": 64, "block_n": 64}, {"SDPA's backward": sdpa_backward},
                what="bfloat16, causal, 32 heads of 128, T = 4096")
