"""Stage k02: attention weights in tiles, with tl.dot, causal masking inside a tile and tiles skipped.

Stage k01's programs each owned one row and worked on vectors. Attention's scores are products of matrices:
S = Q K^T / sqrt(d), one row per query and one column per key. A GPU multiplies matrices fastest in TILES: a
program owns BLOCK_M queries (its rows), and walks over the keys BLOCK_N at a time; each step is one tl.dot of a
(BLOCK_M, BLOCK_D) tile of queries with a (BLOCK_D, BLOCK_N) tile of keys, giving a (BLOCK_M, BLOCK_N) tile of
scores, which tensor cores compute in one go. (tl.dot needs every size >= 16 on a GPU: head_dim d is padded up to
BLOCK_D, a power of 2 >= 16, the padded features loaded as 0, which adds nothing to a dot product.)

    program (pid_m, bh): queries pid_m * BLOCK_M ... + BLOCK_M - 1 of head bh (b * num_heads + h)
      q   = load Q[b, h, rows, :d]                          (BLOCK_M, BLOCK_D), rows past T masked to 0
      for each key tile start_n = 0, BLOCK_N, ... < hi:
        k^T = load K[b, h, start_n:start_n + BLOCK_N, :d]^T  (BLOCK_D, BLOCK_N), keys past T masked to 0
        s   = tl.dot(q, k^T) * scale                         (BLOCK_M, BLOCK_N) scores, scale = 1 / sqrt(d)
        s   = where(key may be attended, s, -inf)            keys past T, and with is_causal keys after the row

Each row's softmax then takes the three passes of stage k01 over its key tiles: the running max, the sum of
exp(s - max), and the weights exp(s - max) / sum written to P[b, h, rows, keys].

CAUSAL attention lets query i see keys j <= i. A key tile that starts after the program's last query,
start_n >= (pid_m + 1) * BLOCK_M, holds only future keys for every row: it is SKIPPED, the loops stop at
hi = min((pid_m + 1) * BLOCK_M, T); its weights stay the zeros the output starts with. Only the tiles that cross the
diagonal need the mask inside the tile, key j > row i -> -inf. For long sequences that halves the work.

API
    attention_weights(q, k, is_causal=False, block_m=16, block_n=16)
        q, k (b, num_heads, T, d) -> P (b, num_heads, T, T) = softmax(q k^T / sqrt(d), dim=-1), q's dtype; with
        is_causal query i attends to keys j <= i (P is exactly 0 above the diagonal). block_m, block_n: the tile
        sizes, powers of 2 >= 16 (any give the same values; they need not be equal). Every T >= 1 and d >= 1 work.
    weights_kernel[grid](...): the kernel, one program per (query tile, head): grid (cdiv(T, BLOCK_M), b * num_heads).
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
def weights_kernel(Q, K, P, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sp_b, sp_h, sp_t, num_heads, T, d, scale,
                   IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)  # which tile of queries: rows pid_m * BLOCK_M ... pid_m * BLOCK_M + BLOCK_M - 1
    bh = tl.program_id(1)  # which (batch, head): bh = b * num_heads + h
    b, h = bh // num_heads, bh % num_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) the query positions of this program
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key offsets inside a key tile
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,) features; those >= d are padding
    q_base, k_base = Q + b * sq_b + h * sq_h, K + b * sk_b + h * sk_h  # this head's first query and key
    p_base = P + b * sp_b + h * sp_h

    # The (BLOCK_M, BLOCK_D) tile of queries: element [i, f] is Q[b, h, rows[i], f]; rows past T and features past
    # d are masked (other=0: a zero feature adds nothing to a dot product). Then hi, the end of the key tiles this
    # tile of queries looks at: T, or with IS_CAUSAL the end of this tile's rows, min((pid_m + 1) * BLOCK_M, T).
    ### BEGIN SOLUTION
    q = tl.load(q_base + rows[:, None] * sq_t + feats[None, :],
                mask=(rows[:, None] < T) & (feats[None, :] < d), other=0.0)  # (BLOCK_M, BLOCK_D)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if IS_CAUSAL else T
    ### END SOLUTION

    # Pass 1: the running max of each row's scores, over the key tiles start_n = 0, BLOCK_N, ... < hi. Each step:
    # the (BLOCK_D, BLOCK_N) tile of keys TRANSPOSED (element [f, j] = K[b, h, start_n + j, f], masked like q),
    # the scores s = tl.dot(q, k^T) * scale, (BLOCK_M, BLOCK_N), with -inf where a key lies past T or, with
    # IS_CAUSAL, after the row (start_n + j > rows[i]); row_max = the larger of row_max and the tile's max per
    # row, (BLOCK_M,).
    ### BEGIN SOLUTION
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # (BLOCK_M,) the largest score seen per row
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + cols  # (BLOCK_N,) the key positions of this tile
        kt = tl.load(k_base + keys[None, :] * sk_t + feats[:, None],
                     mask=(keys[None, :] < T) & (feats[:, None] < d), other=0.0)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kt) * scale  # (BLOCK_M, BLOCK_N)
        allowed = keys[None, :] < T  # (1, BLOCK_N), broadcast over the rows
        if IS_CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None])  # (BLOCK_M, BLOCK_N): no key after its query
        s = tl.where(allowed, s, float("-inf"))
        row_max = tl.maximum(row_max, tl.max(s, axis=1))
    ### END SOLUTION

    # Pass 2: row_sum, the sum over the same key tiles of exp(s - row_max[:, None]), (BLOCK_M,), the scores and
    # their mask computed again tile by tile.
    ### BEGIN SOLUTION
    row_sum = tl.zeros((BLOCK_M,), tl.float32)  # (BLOCK_M,) the softmax's denominator per row
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + cols
        kt = tl.load(k_base + keys[None, :] * sk_t + feats[:, None],
                     mask=(keys[None, :] < T) & (feats[:, None] < d), other=0.0)
        s = tl.dot(q, kt) * scale
        allowed = keys[None, :] < T
        if IS_CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None])
        s = tl.where(allowed, s, float("-inf"))
        row_sum += tl.sum(tl.exp(s - row_max[:, None]), axis=1)
    ### END SOLUTION

    # Pass 3: write each tile of weights exp(s - row_max[:, None]) / row_sum[:, None] into P[b, h, rows, keys]
    # (element [i, j] at p_base + rows[i] * sp_t + keys[j]), only rows < T and keys < T, in P's dtype. The tiles
    # past hi are skipped: P starts as zeros.
    ### BEGIN SOLUTION
    for start_n in range(0, hi, BLOCK_N):
        keys = start_n + cols
        kt = tl.load(k_base + keys[None, :] * sk_t + feats[:, None],
                     mask=(keys[None, :] < T) & (feats[:, None] < d), other=0.0)
        s = tl.dot(q, kt) * scale
        allowed = keys[None, :] < T
        if IS_CAUSAL:
            allowed = allowed & (keys[None, :] <= rows[:, None])
        s = tl.where(allowed, s, float("-inf"))
        w = tl.exp(s - row_max[:, None]) / row_sum[:, None]  # (BLOCK_M, BLOCK_N); masked entries exp(-inf) = 0
        tl.store(p_base + rows[:, None] * sp_t + keys[None, :], w.to(P.dtype.element_ty),
                 mask=(rows[:, None] < T) & (keys[None, :] < T))
    ### END SOLUTION


def attention_weights(q, k, is_causal=False, block_m=16, block_n=16):
    """softmax(q k^T / sqrt(d)) by weights_kernel: q, k (b, num_heads, T, d) -> (b, num_heads, T, T)."""
    b, num_heads, T, d = q.shape
    q, k = q.contiguous(), k.contiguous()  # the kernel reads each head's features one after another
    p = torch.zeros(b, num_heads, T, T, dtype=q.dtype, device=q.device)  # skipped tiles stay 0
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot takes sizes >= 16; features >= d are masked
    grid = (triton.cdiv(T, block_m), b * num_heads)  # one program per tile of queries of one head
    weights_kernel[grid](q, k, p, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                         p.stride(0), p.stride(1), p.stride(2), num_heads, T, d, 1.0 / math.sqrt(d),
                         IS_CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    return p
