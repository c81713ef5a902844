"""Stage k04: FlashAttention-2's backward pass, and an autograd.Function that trains with it.

The forward (stage k03) kept no weights: only O and, per row, LSE = log(sum_j exp(s_ij)). The backward needs the
weights P back, and RECOMPUTES them tile by tile from LSE: p_ij = exp(s_ij - LSE_i), exactly softmax's value,
with no max and no sum to carry. With S = Q K^T * scale (scale = 1 / sqrt(d)), P = softmax(S), O = P V and dO the
gradient arriving at O, the chain rule gives, per tile:

    dV  = P^T dO                        each key's value receives the weights it was given
    dP  = dO V^T
    dS  = P * (dP - D[:, None])         softmax's backward, D_i = rowsum(dO_i * O_i) = rowsum(P_i * dP_i)
    dQ  = dS K * scale                  the scale, because S = Q K^T * scale
    dK  = dS^T Q * scale

D is computed once before the kernels (one number per query row). FlashAttention-2 splits the work in two kernels
so that no two programs add into the same memory:

    dkdv_kernel  one program per tile of KEYS (BLOCK_N of them): holds k, v and the running dK, dV of its keys, and
                 walks over the query tiles; with is_causal only those that can see its keys, the tiles from the
                 one holding query start_n onwards (queries before a key never attend to it)
    dq_kernel    one program per tile of QUERIES: holds q, dO, LSE, D and the running dQ, walks over the key tiles
                 (with is_causal up to the diagonal, as the forward does)

FlashAttention wraps forward and backward in a torch.autograd.Function: forward runs stage k03's kernel and saves
q, k, v, o and lse (never P); backward runs the two kernels. Gradients then flow through it like through any
torch operation, and match F.scaled_dot_product_attention's.

API
    flash_attention_backward(q, k, v, o, lse, do, is_causal=False, block_m=16, block_n=16) -> (dq, dk, dv)
        q, k, v, o, do (b, num_heads, T, d) (float32 or bfloat16), lse (b, num_heads, T) float32 (stage k03's):
        the gradients of the loss with respect to q, k and v, each in its input's dtype, computed in float32;
        block_m, block_n: tile sizes, powers of 2 >= 16 (any give the same values).
    FlashAttention (torch.autograd.Function): FlashAttention.apply(q, k, v, is_causal) -> o, its backward the
        kernels above (no gradient for is_causal).
    flash_attention(q, k, v, is_causal=False) -> o, through FlashAttention.
"""
import math
import os

import torch

# Without a CUDA GPU, Triton's interpreter runs the kernels, on CPU tensors: set before triton is imported (k01).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from k03_flash_forward import flash_attention_forward


@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, s_b, s_h, s_t, num_heads, T, d, scale, IS_CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)  # which tile of keys: keys pid_n * BLOCK_N ... + BLOCK_N - 1
    bh = tl.program_id(1)  # which (batch, head)
    b, h = bh // num_heads, bh % num_heads
    base = b * s_b + h * s_h  # q, k, v, do, dk, dv share one contiguous layout (b, num_heads, T, d)
    start_n = pid_n * BLOCK_N
    keys = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) this program's key positions
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,) features; >= d is padding
    key_ok, feat_ok = keys < T, feats < d
    kv_mask = key_ok[:, None] & feat_ok[None, :]
    k = tl.load(K + base + keys[:, None] * s_t + feats[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + base + keys[:, None] * s_t + feats[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)  # (BLOCK_N, BLOCK_D) the running dK of these keys
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # The first query tile that can see these keys: 0, or with IS_CAUSAL the tile holding query start_n.
    lo = (start_n // BLOCK_M) * BLOCK_M if IS_CAUSAL else 0

    # TODO: Walk over the query tiles start_m = lo, lo + BLOCK_M, ... < T. Each: q, do (BLOCK_M, BLOCK_D), lse and delta
    #       (BLOCK_M,) (LSE and DELTA are contiguous (b * num_heads, T)), rows past T masked; the weights TRANSPOSED, pT
    #       = exp(k q^T * scale - lse[None, :]), (BLOCK_N, BLOCK_M), 0 where the row lies past T or (IS_CAUSAL) before
    #       the key; dv += pT @ do; dpT = v @ do^T; dsT = pT * (dpT - delta[None, :]); dk += dsT @ q.
    raise NotImplementedError("k04_flash_backward: dkdv_kernel: see its TODO")

    # TODO: Store DK = dk * scale (S = Q K^T * scale) and DV = dv, in their dtype, keys < T and features < d only.
    raise NotImplementedError("k04_flash_backward: dkdv_kernel: see its TODO")


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, s_b, s_h, s_t, num_heads, T, d, scale, IS_CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)  # which tile of queries
    bh = tl.program_id(1)
    b, h = bh // num_heads, bh % num_heads
    base = b * s_b + h * s_h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query positions
    feats = tl.arange(0, BLOCK_D)
    row_ok, feat_ok = rows < T, feats < d
    q_mask = row_ok[:, None] & feat_ok[None, :]
    q = tl.load(Q + base + rows[:, None] * s_t + feats[None, :], mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + base + rows[:, None] * s_t + feats[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0)  # (BLOCK_M,)
    delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # (BLOCK_M, BLOCK_D) the running dQ of these queries
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T  # the key tiles after hi are skipped

    # TODO: Walk over the key tiles start_n = 0, BLOCK_N, ... < hi: k^T and v^T (BLOCK_D, BLOCK_N), keys past T masked;
    #       p = exp(q k^T * scale - lse[:, None]), 0 where the key lies past T or (IS_CAUSAL) after the row; dp = do @
    #       v^T; ds = p * (dp - delta[:, None]); dq += ds @ k. Then store DQ = dq * scale, rows < T.
    raise NotImplementedError("k04_flash_backward: dq_kernel: see its TODO")


def flash_attention_backward(q, k, v, o, lse, do, is_causal=False, block_m=16, block_n=16):
    """The gradients of FlashAttention-2 by dkdv_kernel and dq_kernel: -> (dq, dk, dv), each in its input's dtype."""
    b, num_heads, T, d = q.shape
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    block_d = max(16, triton.next_power_of_2(d))
    meta = dict(IS_CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    sizes = (q.stride(0), q.stride(1), q.stride(2), num_heads, T, d, 1.0 / math.sqrt(d))
    # TODO: D = rowsum(dO * O), (b, num_heads, T) in float32 (one number per query row, for softmax's backward); then
    #       dkdv_kernel over a grid of (key tiles, b * num_heads) and dq_kernel over (query tiles, b * num_heads), each
    #       given q, k, v, do, lse, D, its outputs, then sizes, then meta.
    raise NotImplementedError("k04_flash_backward: flash_attention_backward: see its TODO")
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d)) v whose backward is FlashAttention-2's: FlashAttention.apply(q, k, v, is_causal)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        # TODO: Run stage k03's forward; keep for the backward what it needs (ctx.save_for_backward(q, k, v, o, lse) and
        #       ctx.is_causal), never the weights; return o.
        raise NotImplementedError("k04_flash_backward: FlashAttention.forward: see its TODO")

    @staticmethod
    def backward(ctx, do):
        # TODO: The gradients of q, k and v from flash_attention_backward, and None for is_causal.
        raise NotImplementedError("k04_flash_backward: FlashAttention.backward: see its TODO")


def flash_attention(q, k, v, is_causal=False):
    """Attention through FlashAttention (differentiable): q, k, v (b, num_heads, T, d) -> o."""
    return FlashAttention.apply(q, k, v, is_causal)
