"""Stage k03: FlashAttention-2's forward pass in Triton.

Stage k02 read every key tile three times (the max, the sum, the weights) and wrote a T x T matrix of weights.
Attention only needs P @ V, and stage m07 showed how to get it in ONE pass over the keys without ever holding P:
the ONLINE SOFTMAX. For each query row the program keeps three running quantities (FlashAttention's m, l and O):

    m_i   the largest score seen so far                                               (BLOCK_M,)
    l_i   the sum of exp(s - m_i) over the keys seen so far                           (BLOCK_M,)
    acc   the sum of exp(s - m_i) * v over the keys seen so far                       (BLOCK_M, BLOCK_D)

and folds each tile of scores s (BLOCK_M, BLOCK_N) into them:

    m_new = max(m_i, rowmax(s))
    alpha = exp(m_i - m_new)           what the old sums were relative to, moved to the new max (0 on the first tile)
    p     = exp(s - m_new[:, None])    (BLOCK_M, BLOCK_N), every entry <= 1
    l_i   = l_i * alpha + rowsum(p)
    acc   = acc * alpha[:, None] + tl.dot(p, v)
    m_i   = m_new

After the last tile, O = acc / l_i[:, None] is softmax(S) @ V, and LSE = m_i + log(l_i) = log(sum_j exp(s_ij)) is
the log of the softmax's denominator, one number per row: the backward pass (stage k04) recomputes every weight
from it, exp(s - LSE), instead of storing P. That is FlashAttention-2 (Dao, 2023): one program per tile of queries,
the keys and values streamed through on-chip memory once, nothing of size T x T ever written.

With is_causal, the key tiles after the program's last query are skipped (stage k02): the loop ends at
hi = min((pid_m + 1) * BLOCK_M, T). Every row sees key 0 in the first tile, so m_i is finite after it.

API
    flash_attention_forward(q, k, v, is_causal=False, block_m=16, block_n=16) -> (o, lse)
        q, k, v (b, num_heads, T, d), float32 or bfloat16 -> o (b, num_heads, T, d) = softmax(q k^T / sqrt(d)) v in
        q's dtype, and lse (b, num_heads, T) float32 = logsumexp over the keys of q k^T / sqrt(d) (natural log; with
        is_causal over keys j <= i). block_m, block_n: tile sizes, powers of 2 >= 16, any give the same values.
        Accumulation in float32 whatever the inputs (in bfloat16, p is rounded to v's dtype for tl.dot).
    attention_kernel[grid](...): grid (cdiv(T, BLOCK_M), b * num_heads).
"""
import math
import os

import torch

# Without a CUDA GPU, Triton's interpreter runs the kernels, on CPU tensors: set before triton is imported (k01).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl


@triton.jit
def attention_kernel(Q, K, V, Out, LSE, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                     num_heads, T, d, scale, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)  # which tile of queries: rows pid_m * BLOCK_M ... + BLOCK_M - 1
    bh = tl.program_id(1)  # which (batch, head): bh = b * num_heads + h
    b, h = bh // num_heads, bh % num_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query positions
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key offsets inside a tile
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,) features; >= d is padding
    row_ok, feat_ok = rows < T, feats < d
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + feats[None, :],
                mask=row_ok[:, None] & feat_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    k_base, v_base = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h  # this head's first key and value
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T  # the key tiles after hi are skipped

    # Start the running statistics (m_i = -inf: nothing seen yet; l_i = 0; acc = 0, float32), then fold in the key
    # tiles start_n = 0, BLOCK_N, ... < hi. Each: k^T (BLOCK_D, BLOCK_N) and v (BLOCK_N, BLOCK_D), keys past T
    # masked to 0; s = tl.dot(q, k^T) * scale, -inf where the key lies past T or (IS_CAUSAL) after the row; then
    # m_new, alpha = exp(m_i - m_new), p = exp(s - m_new[:, None]), l_i = l_i * alpha + rowsum(p), acc = acc *
    # alpha[:, None] + tl.dot(p in v's dtype, v), m_i = m_new (the order matters: alpha needs the old m_i).
    ### BEGIN SOLUTION
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # (BLOCK_M,) running max
    l_i = tl.zeros((BLOCK_M,), tl.float32)  # (BLOCK_M,) running sum of exp(s - m_i)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)  # (BLOCK_M, BLOCK_D) running sum of exp(s - m_i) * v
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + cols  # (BLOCK_N,) the key positions of this tile
        key_ok = keys < T
        kt = tl.load(k_base + keys[None, :] * sk_t + feats[:, None], mask=feat_ok[:, None] & key_ok[None, :],
                     other=0.0)  # (BLOCK_D, BLOCK_N): keys transposed
        v = tl.load(v_base + keys[:, None] * sv_t + feats[None, :], mask=key_ok[:, None] & feat_ok[None, :],
                    other=0.0)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, kt) * scale  # (BLOCK_M, BLOCK_N)
        allowed = key_ok[None, :]  # (1, BLOCK_N)
        if IS_CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None])  # (BLOCK_M, BLOCK_N)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BLOCK_M,)
        alpha = tl.exp(m_i - m_new)  # (BLOCK_M,) 0 on the first tile, where m_i = -inf
        p = tl.exp(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    ### END SOLUTION

    # The epilogue: Out[b, h, rows, :d] = acc / l_i[:, None] in Out's dtype, and LSE[bh, rows] = m_i + log(l_i)
    # (LSE is contiguous, (b * num_heads, T)), only rows < T (and features < d).
    ### BEGIN SOLUTION
    o = acc / l_i[:, None]  # (BLOCK_M, BLOCK_D)
    tl.store(Out + b * so_b + h * so_h + rows[:, None] * so_t + feats[None, :], o.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & feat_ok[None, :])
    tl.store(LSE + bh * T + rows, m_i + tl.log(l_i), mask=row_ok)
    ### END SOLUTION


def flash_attention_forward(q, k, v, is_causal=False, block_m=16, block_n=16):
    """FlashAttention-2's forward by attention_kernel: q, k, v (b, num_heads, T, d) -> (o, lse)."""
    b, num_heads, T, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(b, num_heads, T, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(T, block_m), b * num_heads)
    attention_kernel[grid](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                           k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                           num_heads, T, d, 1.0 / math.sqrt(d), IS_CAUSAL=is_causal, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_D=block_d)
    return o, lse
