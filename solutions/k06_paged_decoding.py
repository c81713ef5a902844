"""Stage k06: paged decoding, flash decoding over a block table, sequences of different lengths.

frontier-attention's stage f03 kept every sequence's keys and values in one pool of fixed-size BLOCKS (pages):

    k_pool, v_pool   (num_blocks, num_heads, block_size, d)     allocated once, shared by every sequence
    block_tables     (b, max_blocks) int32                       row r: the physical blocks of sequence r, in order
    seq_lens         (b,) int32                                  how many tokens each sequence holds

The token at position p of sequence r lives in block block_tables[r, p // block_size], slot p % block_size. f03
GATHERED a sequence's blocks into one tensor before attending; vLLM's PagedAttention kernel reads them IN PLACE:
the program that attends for sequence r walks over its LOGICAL blocks j = 0, 1, ..., looks up the PHYSICAL block
block_tables[r, j], and loads that block's (block_size, d) keys and values straight from the pool. Sequences of a
batch have different lengths: each program reads its own length, its last block is partial (the slots at
positions >= seq_len hold nothing yet, or a freed sequence's keys: masked), and the table's entries past a
sequence's blocks are never read.

Decoding one query per sequence, the splits of stage k05 keep the GPU busy: split s of sequence r takes its
logical blocks [s * per_split, min((s + 1) * per_split, num_blocks_r)), per_split = cdiv(num_blocks_r, num_splits)
and num_blocks_r = cdiv(seq_lens[r], block_size) (a short sequence leaves some splits empty: lse -inf); stage k05's
combine_splits joins the partial results.

API
    paged_partials(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2) -> (partial_o, partial_lse)
        q (b, num_heads, d); k_pool, v_pool (num_blocks, num_heads, block_size, d), block_size a power of 2;
        block_tables (b, max_blocks) and seq_lens (b,) integers (seq_lens[r] >= 1; entries of a row past its
        cdiv(seq_lens[r], block_size) blocks are never read) -> partial_o (b, num_heads, num_splits, d) float32,
        partial_lse (b, num_heads, num_splits) float32, as stage k05's, with the splits over each sequence's
        logical blocks as above.
    paged_decode(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2) -> o (b, num_heads, d), q's dtype:
        softmax(q k^T / sqrt(d)) v over the seq_lens[r] cached tokens of each sequence, through
        k05_flash_decoding.combine_splits.
    paged_kernel[grid]: grid (b * num_heads, num_splits).
"""
import math
import os

import torch

# Without a CUDA GPU, Triton's interpreter runs the kernels, on CPU tensors: set before triton is imported (k01).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from k05_flash_decoding import combine_splits


@triton.jit
def paged_kernel(Q, K_POOL, V_POOL, TABLES, LENS, PO, PLSE, sq_b, sq_h, sp_block, sp_head, sp_slot, st_b,
                 num_heads, d, scale, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)  # which (sequence, head): bh = r * num_heads + h
    split = tl.program_id(1)  # which share of the sequence's blocks
    r, h = bh // num_heads, bh % num_heads
    feats = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    feat_ok = feats < d
    slots = tl.arange(0, PAGE)  # (PAGE,) the slots of one block
    q = tl.load(Q + r * sq_b + h * sq_h + feats, mask=feat_ok, other=0.0).to(tl.float32)  # (BLOCK_D,)
    seq_len = tl.load(LENS + r)  # this sequence's own length
    num_blocks = tl.cdiv(seq_len, PAGE)  # the logical blocks it holds
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    first = split * per_split  # this split's logical blocks: [first, last)
    last = tl.minimum(first + per_split, num_blocks)

    # For each logical block j in [first, last): its physical block TABLES[r, j] (row stride st_b); its keys and
    # values k_pool[physical, h, :, :d] (PAGE, BLOCK_D) (strides sp_block, sp_head, sp_slot; features contiguous),
    # the slots whose position j * PAGE + slot >= seq_len masked; the scores, -inf there; then stage k05's online
    # softmax (m_i, l_i scalars, acc (BLOCK_D,)).
    ### BEGIN SOLUTION
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in range(first, last):
        physical = tl.load(TABLES + r * st_b + j)  # where logical block j of sequence r lives in the pool
        token_ok = j * PAGE + slots < seq_len  # (PAGE,) the slots that hold tokens of this sequence
        mask = token_ok[:, None] & feat_ok[None, :]
        where = physical * sp_block + h * sp_head + slots[:, None] * sp_slot + feats[None, :]  # (PAGE, BLOCK_D)
        k = tl.load(K_POOL + where, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V_POOL + where, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(token_ok, tl.sum(q[None, :] * k, axis=1) * scale, float("-inf"))  # (PAGE,)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    ### END SOLUTION

    # The split's partial result, as stage k05's: PO[bh, split, :d] and PLSE[bh, split]; 0 and -inf when empty.
    ### BEGIN SOLUTION
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(PO + (bh * NUM_SPLITS + split) * d + feats, tl.where(seen, acc / l_safe, 0.0), mask=feat_ok)
    tl.store(PLSE + bh * NUM_SPLITS + split, tl.where(seen, m_i + tl.log(l_safe), float("-inf")))
    ### END SOLUTION


def paged_partials(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2):
    """Each split's partial output and lse over the paged cache, by paged_kernel."""
    b, num_heads, d = q.shape
    page = k_pool.shape[2]
    q, k_pool, v_pool = q.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    tables = block_tables.to(device=q.device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    partial_o = torch.empty(b, num_heads, num_splits, d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
    paged_kernel[(b * num_heads, num_splits)](
        q, k_pool, v_pool, tables, lens, partial_o, partial_lse, q.stride(0), q.stride(1), k_pool.stride(0),
        k_pool.stride(1), k_pool.stride(2), tables.stride(0), num_heads, d, 1.0 / math.sqrt(d),
        NUM_SPLITS=num_splits, PAGE=page, BLOCK_D=triton.next_power_of_2(d))
    return partial_o, partial_lse


def paged_decode(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2):
    """One query per sequence and head against its paged cache: -> (b, num_heads, d) in q's dtype."""
    # The partials over the paged cache, combined by stage k05's combine_splits, in q's dtype.
    ### BEGIN SOLUTION
    partial_o, partial_lse = paged_partials(q, k_pool, v_pool, block_tables, seq_lens, num_splits)
    o, _ = combine_splits(partial_o, partial_lse)
    return o.to(q.dtype)
    ### END SOLUTION
