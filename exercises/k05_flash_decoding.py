"""Stage k05: flash decoding, one query token against a long cache, the keys split across programs.

Generating text, a model attends with ONE new query per sequence to every cached key: T keys (thousands), one
row of scores. FlashAttention's forward (stage k03) gives each program a tile of queries, so here it would run
b * num_heads programs, each walking alone over all T keys, while the rest of the GPU idles. FLASH DECODING (Dao,
Haziza, Massa and Sizov, 2023) splits the KEYS instead: num_splits programs per head each take one chunk of the
cache and compute, with the online softmax of stage k03, a PARTIAL result of their chunk alone:

    split s: keys [s * chunk, min((s + 1) * chunk, T)),  chunk = cdiv(T, num_splits)
      o_s   = softmax over its keys of the scores, times their values   (d,)   normalised within the split
      lse_s = log(sum over its keys of exp(score))                        a number; -inf for a split with no key

A second, small kernel COMBINES the splits of each head by their log-sum-exps. With M = max_s lse_s,

    w_s = exp(lse_s - M)          each split's share of the denominator, relative to the largest (<= 1: no overflow)
    o   = sum_s w_s o_s / sum_s w_s
    lse = M + log(sum_s w_s)

which is exactly softmax over all T keys (the denominator of the whole row is sum_s exp(lse_s)). A split with no
key has lse_s = -inf, so w_s = 0, and its o_s must be 0, not 0 / 0 (0 * NaN is NaN).

One query row is a vector: its scores are a (BLOCK_N,) vector per tile, sum(q[None, :] * k, axis=1), not a tl.dot
(which needs 16 rows); the statistics are scalars. The same partial-then-combine scheme reads a paged cache in
stage k06.

API
    split_partials(q, k, v, num_splits=4, block_n=16) -> (partial_o, partial_lse)
        q (b, num_heads, d), k, v (b, num_heads, T, d) -> partial_o (b, num_heads, num_splits, d) float32 (0 for
        an empty split), partial_lse (b, num_heads, num_splits) float32 (natural log of the split's sum of
        exp(q.k / sqrt(d)); -inf for an empty split); split s holds keys [s * chunk, min((s + 1) * chunk, T)),
        chunk = cdiv(T, num_splits). block_n: keys per tile, a power of 2 (any gives the same values).
    combine_splits(partial_o, partial_lse) -> (o, lse): o (b, num_heads, d) float32, lse (b, num_heads) float32.
    flash_decode(q, k, v, num_splits=4, block_n=16) -> o (b, num_heads, d) in q's dtype:
        softmax(q k^T / sqrt(d)) v for the one query of each head, through the two kernels.
    split_kernel[grid]: grid (b * num_heads, num_splits); combine_kernel[grid]: grid (b * num_heads,).
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
def split_kernel(Q, K, V, PO, PLSE, sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, num_heads, T, d, chunk, scale,
                 NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)  # which (batch, head): bh = b * num_heads + h
    split = tl.program_id(1)  # which chunk of the keys: 0 .. NUM_SPLITS - 1
    b, h = bh // num_heads, bh % num_heads
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,) features; >= d is padding
    feat_ok = feats < d
    q = tl.load(Q + b * sq_b + h * sq_h + feats, mask=feat_ok, other=0.0).to(tl.float32)  # (BLOCK_D,) the query
    k_base, v_base = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
    # This split's keys: [start, end), empty when start >= T.
    start = split * chunk
    end = tl.minimum(start + chunk, T)

    # TODO: The online softmax of stage k03 over the keys start, start + BLOCK_N, ... < end: each tile's k and v
    #       (BLOCK_N, BLOCK_D) masked to keys < end (the next split's keys are not this split's), scores s = sum(q[None,
    #       :] * k, axis=1) * scale (BLOCK_N,), -inf past end; the running max m_i, sum l_i (scalars) and acc (BLOCK_D,)
    #       rescaled by alpha = exp(m_i - m_new) at every tile.
    raise NotImplementedError("k05_flash_decoding: split_kernel: see its TODO")

    # TODO: The split's partial result: PO[bh, split, :d] = acc / l_i and PLSE[bh, split] = m_i + log(l_i) (PO is
    #       contiguous (b * num_heads, NUM_SPLITS, d), PLSE (b * num_heads, NUM_SPLITS)); a split that saw no key (l_i =
    #       0) stores 0 and -inf, never 0 / 0.
    raise NotImplementedError("k05_flash_decoding: split_kernel: see its TODO")


@triton.jit
def combine_kernel(PO, PLSE, Out, LSE, d, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)  # which (batch, head)
    splits = tl.arange(0, BLOCK_S)  # (BLOCK_S,) split indices; >= NUM_SPLITS is padding
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    split_ok, feat_ok = splits < NUM_SPLITS, feats < d

    # TODO: Load the head's partial lse (BLOCK_S,) (padding splits as -inf) and partial outputs (BLOCK_S, BLOCK_D);
    #       weigh each split by w = exp(lse_s - max_s lse_s); Out[bh, :d] = sum_s w_s o_s / sum_s w_s and
    #       LSE[bh] = max + log(sum_s w_s) (Out contiguous (b * num_heads, d), LSE (b * num_heads,)).
    raise NotImplementedError("k05_flash_decoding: combine_kernel: see its TODO")


def split_partials(q, k, v, num_splits=4, block_n=16):
    """Each split's partial output and lse by split_kernel: -> (b, num_heads, num_splits, d), (b, num_heads, splits)."""
    b, num_heads, T, d = k.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    partial_o = torch.empty(b, num_heads, num_splits, d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
    chunk = triton.cdiv(T, num_splits)  # keys per split; the last one may hold fewer, or none
    split_kernel[(b * num_heads, num_splits)](
        q, k, v, partial_o, partial_lse, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), num_heads, T, d, chunk, 1.0 / math.sqrt(d), NUM_SPLITS=num_splits,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d))
    return partial_o, partial_lse


def combine_splits(partial_o, partial_lse):
    """The splits of every head combined by combine_kernel: -> o (b, num_heads, d), lse (b, num_heads), float32."""
    b, num_heads, num_splits, d = partial_o.shape
    partial_o, partial_lse = partial_o.float().contiguous(), partial_lse.float().contiguous()
    o = torch.empty(b, num_heads, d, dtype=torch.float32, device=partial_o.device)
    lse = torch.empty(b, num_heads, dtype=torch.float32, device=partial_o.device)
    combine_kernel[(b * num_heads,)](partial_o, partial_lse, o, lse, d, NUM_SPLITS=num_splits,
                                     BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(d))
    return o, lse


def flash_decode(q, k, v, num_splits=4, block_n=16):
    """softmax(q k^T / sqrt(d)) v for one query per head: q (b, num_heads, d), k, v (b, num_heads, T, d)."""
    # TODO: The two kernels: the partials of the splits, then their combination, in q's dtype.
    raise NotImplementedError("k05_flash_decoding: flash_decode: see its TODO")
