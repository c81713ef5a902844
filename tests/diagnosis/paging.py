"""A paged KV cache (vLLM's PagedAttention) as a mechanism: block tables replayed in NumPy (float64), written once
with their switches, and probes that read a module's own tables.

A scenario is a list of operations, ("forward", seq_ids, x) or ("free", seq_id); a module reports, after each, the
block tables of the sequences it touched. ``replay`` runs the scenario on a NumPy pool with THE MODULE'S OWN tables
(so that a mistake in where tokens are written or how blocks are laid out is searched on the blocks the learner
really used), as ``choices`` make it; ``switches`` lists what a learner chooses there (where token p goes, how
a sequence's blocks are gathered, which causal rows the new queries get) beside attention's switches.
``table_findings`` reads the tables themselves: blocks held beyond ceil(n / block_size) (a block taken before the
last one is full), blocks shared by two live sequences, freed blocks never taken again.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from . import attention as A
from . import caches as C
from .findings import Finding
from .search import Switch

Choices = Mapping[str, Hashable]
NONE: Choices = {}


def lay_out(blocks, length, choices: Choices = NONE):
    """A sequence's blocks (held, num_heads, block_size, head_dim) as (num_heads, tokens, head_dim)."""
    num_heads, hd = blocks.shape[1], blocks.shape[3]
    gather = choices.get("gather")
    if gather == "no_transpose":
        return blocks.reshape(num_heads, -1, hd)[:, :length]
    laid = blocks.transpose(1, 0, 2, 3).reshape(num_heads, -1, hd)
    return laid if gather == "whole_blocks" else laid[:, :length]


def where(table, position: int, block_size: int, choices: Choices = NONE):
    """(block id, slot) of the token at ``position`` of a sequence with this table."""
    write = choices.get("write")
    if write == "swapped":
        return table[position % block_size % len(table)], position // block_size
    if write == "no_table":
        return position // block_size, position % block_size
    return table[position // block_size], position % block_size


def replay(weights, num_heads: int, block_size: int, num_blocks: int, ops, tables, choices: Choices = NONE):
    """Each forward's output (None for a free) when ``ops`` run on a NumPy pool with the module's ``tables`` (per op:
    {seq_id: its table after the op}), as ``choices`` make it."""
    d_out = weights["out_proj.weight"].shape[0]
    hd = d_out // num_heads
    spare = sum(op[2].shape[0] * op[2].shape[1] for op in ops if op[0] == "forward") // block_size + 1
    # (blocks past the pool: where the module's table is too short for a computation's tokens, they go there)
    k_pool, v_pool = np.zeros((2, num_blocks + spare, num_heads, block_size, hd))
    virtual = iter(range(num_blocks, num_blocks + spare))
    bias = choices.get("bias") != "ignored"
    lengths, outputs = {}, []
    scale = A.scale_of(A.Attention(num_heads=num_heads), hd, weights["W_query.weight"].shape[1], d_out, choices)
    for op, held in zip(ops, tables):
        if op[0] == "free":
            lengths.pop(op[1], None)
            outputs.append(None)
            continue
        rows = []
        for r, seq in enumerate(op[1]):
            x = np.asarray(op[2][r:r + 1], np.float64)
            q, k, v = (A.split(A.linear(x, weights, n, bias), num_heads, choices)[0]
                       for n in ("W_query", "W_key", "W_value"))
            table, n = list(held[seq]), x.shape[1]
            start = 0 if choices.get("write") == "from_zero" else lengths.get(seq, 0)
            while len(table) * block_size < start + n:
                table.append(next(virtual))
            for t in range(n if choices.get("write") != "lost" else 0):
                block, slot = where(table, start + t, block_size, choices)
                k_pool[block, :, slot] = k[:, t]
                v_pool[block, :, slot] = v[:, t]
            lengths[seq] = start + n
            order = {"sorted": sorted(table), "reversed": table[::-1],
                     "contiguous": [table[0] + i for i in range(len(table))]}.get(choices.get("gather"), table)
            keys, values = (lay_out(pool[order], start + n, choices) for pool in (k_pool, v_pool))
            num_keys = keys.shape[1]
            allowed = A.allowed_keys(A.Attention(), np.arange(num_keys - n, num_keys), np.arange(num_keys), choices)
            w = A.attention_weights(q @ keys.transpose(0, 2, 1), allowed, scale, choices)
            out = A.merge((w @ values)[None], choices)[0]
            rows.append(out if choices.get("out_proj") == "missing" else A.linear(out, weights, "out_proj"))
        outputs.append(np.stack(rows))
    return outputs


# ---------------------------------------------------------------- the switches

WHOLE_BLOCKS = ("the gathered keys were not cut at the sequence's length: whole blocks bring their unwritten slots "
                "(zeros, or a freed sequence's keys) and shift the causal rows; keep the first seq_len tokens")
HEAD_LAYOUT = ("the blocks were laid end to end without moving the head axis first: pool[table] is (blocks, "
               "num_heads, block_size, head_dim); transpose to (num_heads, blocks, block_size, head_dim) before "
               "merging blocks and slots into one token axis")
NO_OFFSET = ("each step wrote its keys from position 0 and attended to its new tokens alone: the new tokens go after "
             "the seq_len tokens already cached (positions seq_len, seq_len + 1, ...)")
GATHER = Switch("gather", "block tables", {
    "whole_blocks": WHOLE_BLOCKS,
    "no_transpose": HEAD_LAYOUT,
    "sorted": "the blocks were gathered in the order of their ids, not the table's: a sequence's blocks need not be "
              "neighbours nor in order; lay them out as block_table lists them",
    "reversed": "the blocks were laid out last to first: token p is in block table[p // block_size], so the table's "
                "first block holds the first tokens",
    "contiguous": "the gather took the blocks that follow the table's first one in the pool (table[0], table[0] + 1, "
                  "...): a sequence's blocks need not be neighbours; read each from the table, pool[block_table]"})
WRITE = Switch("write", "block tables", {
    "from_zero": NO_OFFSET,
    "swapped": "block and slot were swapped: the token at position p goes to block table[p // block_size], slot "
               "p % block_size",
    "no_table": "the token was written to block p // block_size of the pool itself: the sequence's block table says "
                "which block that is (table[p // block_size])",
    "lost": C.COPY})


def switches(d_in: int, d_out: int, num_heads: int, bias: bool) -> list:
    head_dim = d_out // num_heads
    found = [GATHER, WRITE, A.CAUSAL.only("none", "diagonal").plus(A.CACHED_ROWS),
             A.scaling_switch(A.Attention(num_heads=num_heads), head_dim, d_in, d_out), A.SOFTMAX.only("twice"),
             A.FILL, A.PROJECTIONS["out_proj"]]
    if bias:
        found.append(A.PROJECTIONS["bias"])
    if num_heads > 1:
        found += list(A.HEADS.values())
    return found


# ---------------------------------------------------------------- the tables, read

BLOCK_PER_STEP = ("a new block was taken although the last one had free slots: a sequence of n tokens holds "
                  "ceil(n / block_size) blocks")
NOT_RETURNED = "free() must give the sequence's blocks back to the free list (self.free_blocks) for reuse"
TABLE_KEPT = ("free() kept the sequence's block table: forget the table and the length, so that the id can start "
              "a new sequence")


def table_findings(ops, tables, lengths, block_size: int) -> list[Finding]:
    """What the module's block tables show (``tables``: per op, {seq_id: table} of the sequences it touched;
    ``lengths``: per op, {seq_id: tokens} of the live sequences after it): a sequence holding more blocks than its
    tokens need, fewer than they need, or two live sequences sharing a block."""
    found = []
    steps = {}
    for index, (op, held, live) in enumerate(zip(ops, tables, lengths)):
        if op[0] == "forward":
            for seq in op[1]:
                steps[seq] = steps.get(seq, 0) + 1
        else:
            steps.pop(op[1], None)
        for seq, table in held.items():
            n = live.get(seq, 0)
            need = -(-n // block_size)
            if len(table) == need:
                continue
            if n == 0:
                # (the table read back is the cause itself: proven)
                found.append(Finding(f"after free({seq}) (op {index}), block_table({seq}) is still {table}.",
                                     (TABLE_KEPT,), "block tables", "probe", weight=2, proven=True))
            elif len(table) > need:
                # The tables read back are the effect itself: said as what they show, not as the step that did it.
                shows = (f"after op {index}, sequence {seq} holds {n} tokens in {len(table)} blocks {table}: "
                         f"ceil({n} / block_size={block_size}) = {need} would hold them (a block is taken only when "
                         "the last one is full)")
                one_too_many = n % block_size == 0 and len(table) == n // block_size + 1
                if len(table) == steps.get(seq, 0) and not one_too_many:
                    # one block per step, each step's tokens fitting in the last block: what the table shows
                    shows += f"; one block per step ({len(table)} steps): {BLOCK_PER_STEP}"
                found.append(Finding(shows + ".", (), "block tables", "probe", weight=2))
            else:
                found.append(Finding(
                    f"after op {index}, sequence {seq} holds {n} tokens in {len(table)} blocks {table}, fewer than "
                    f"ceil({n} / {block_size}) = {need}: some of its tokens have no slot.",
                    ("allocate takes too few blocks: a sequence of n tokens needs ceil(n / block_size) blocks",),
                    "block tables", "probe", weight=2))
            return found
        owners = {}
        for seq, table in held.items():
            if live.get(seq, 0) == 0:
                continue
            for block in table:
                if block in owners and owners[block] != seq:
                    found.append(Finding(f"after op {index}, sequences {owners[block]} and {seq} both hold block "
                                         f"{block}: two sequences write into the same slots.",
                                         ("a block was given to a sequence while another one still held it",),
                                         "block tables", "probe", weight=2))
                    return found
                owners[block] = seq
    return found


def lost_blocks_finding() -> Finding:
    """The pool ran dry, and the same steps pass with a pool that needs no freed block: freed blocks were never
    taken again."""
    return Finding("the pool ran dry, although it holds every block the live sequences need, and the same steps pass "
                   "with a pool as large as all the blocks ever taken: the blocks of freed sequences were never taken "
                   "again. Each of these two gives exactly that, and no run of the module tells them apart (its "
                   "outputs and tables are the same).", (NOT_RETURNED,
                             "allocate took new block ids (a counter, or blocks past the pool) instead of the free "
                             "list's: take them with self.free_blocks.pop(...)"), "block tables", "listed", weight=1)
