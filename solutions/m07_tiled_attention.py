"""Stage m07: attention computed tile by tile, FlashAttention's online softmax in plain PyTorch.

Chapter 3 (sections 3.4 to 3.6) computes the whole num_tokens x num_tokens score matrix, softmaxes
each row and multiplies by the values. At 32 heads and 4096 tokens that matrix alone holds half a
billion numbers per sequence. FlashAttention never builds it: it walks over tiles of block_size
queries x block_size keys and keeps, for every query row, three running quantities:

    row_max  the largest score seen so far (softmax is unchanged by subtracting any constant per row,
             and subtracting the max keeps every exp(score - row_max) <= 1: no overflow)
    row_sum  sum of exp(score - row_max) over the keys seen so far (the softmax denominator)
    acc      sum of exp(score - row_max) * value over the keys seen so far (the numerator, a vector per row)

(the paper's m, l and O). When a tile brings a larger max, what row_sum and acc summed relative to the
old max is rescaled by exp(old max - new max), so that everything stays relative to the current max.
After the last tile, acc / row_sum is the softmax-weighted sum of the values: the same output as the
full computation. The fused kernels do this in fast on-chip memory; here it is plain PyTorch, for the idea.

Tested: the output against standard attention (float64) for any n_q, n_kv, d and block_size (a last tile shorter
than block_size, tiles of 1, a tile larger than the sequence), causal or not (top-left: query i sees keys 0..i);
no NaN where standard attention has none (a row whose scores are all masked so far); finite outputs for scores in
the thousands; at 8192 tokens no n_q x n_kv matrix is ever made (the memory it may take is bounded) and
F.scaled_dot_product_attention is never called; float32, and bfloat16 on the GPU (its memory bounded too).
"""
import math

import torch


def tiled_attention(q, k, v, is_causal=False, block_size=64):
    """softmax(q k^T / sqrt(d)) v over tiles of block_size queries x block_size keys, with an online
    softmax; never holds an n_q x n_kv matrix (the largest is one block_size x block_size tile per head).

    q: (b, num_heads, n_q, d); k, v: (b, num_heads, n_kv, d)   returns: (b, num_heads, n_q, d), q's dtype
    is_causal: query i attends to keys j <= i only. With n_q != n_kv the mask is aligned top-left, as
    F.scaled_dot_product_attention(is_causal=True) does: query i sees keys 0..i whatever n_kv is.
    Sums are accumulated in float32 (float64 inputs stay float64), as the fused kernels do.
    """
    n_q, n_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    # A bfloat16 running sum over thousands of keys would lose most of its digits: work in float32.
    work = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    for q_start in range(0, n_q, block_size):
        q_end = min(q_start + block_size, n_q)
        q_blk = q[..., q_start:q_end, :].to(work) * scale  # (b, num_heads, bq, d)
        rows = torch.arange(q_start, q_end, device=q.device)[:, None]  # query positions, (bq, 1)
        # Start this block's running statistics, one per query row: row_max = -inf (nothing seen yet),
        # shape (b, num_heads, bq, 1); row_sum = 0, same shape; acc = 0, one head_dim vector per row.
        ### BEGIN SOLUTION
        row_max = torch.full((*q_blk.shape[:-1], 1), -torch.inf, dtype=work, device=q.device)
        row_sum = torch.zeros_like(row_max)  # sum of exp(score - row_max) over the keys seen
        acc = torch.zeros_like(q_blk)  # sum of exp(score - row_max) * value, (b, num_heads, bq, d)
        ### END SOLUTION
        # With is_causal no row of this block sees a key at or after q_end: those tiles are skipped.
        kv_end = min(n_kv, q_end) if is_causal else n_kv
        for k_start in range(0, kv_end, block_size):
            k_end = min(k_start + block_size, kv_end)
            k_blk = k[..., k_start:k_end, :].to(work)  # (b, num_heads, bk, d)
            s = q_blk @ k_blk.transpose(-2, -1)  # (b, num_heads, bq, bk): one tile of scores
            if is_causal:
                cols = torch.arange(k_start, k_end, device=q.device)  # key positions, (bk,)
                s = s.masked_fill(cols > rows, -torch.inf)  # a key after its query takes no part
            # Fold the tile into the running statistics: the new max is the larger of row_max and the tile's
            # row max; what row_sum and acc summed relative to the old max is rescaled by exp(old - new max)
            # before the tile's exp(s - new max) terms are added to row_sum, and those terms times the tile's
            # values v[..., k_start:k_end, :] to acc. A row whose scores so far are all masked has new max
            # -inf: subtract 0 there instead, since -inf - (-inf) is NaN.
            ### BEGIN SOLUTION
            v_blk = v[..., k_start:k_end, :].to(work)  # (b, num_heads, bk, d)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            shift = torch.where(new_max == -torch.inf, 0.0, new_max)
            p = torch.exp(s - shift)  # (b, num_heads, bq, bk), each <= 1
            correction = torch.exp(row_max - shift)  # (b, num_heads, bq, 1); 0 on the first tile (row_max = -inf)
            row_sum = row_sum * correction + p.sum(dim=-1, keepdim=True)
            acc = acc * correction + p @ v_blk
            row_max = new_max
            ### END SOLUTION
        # Normalise: the output rows are acc / row_sum, in q's dtype.
        ### BEGIN SOLUTION
        out[..., q_start:q_end, :] = (acc / row_sum).to(q.dtype)
        ### END SOLUTION
    return out
