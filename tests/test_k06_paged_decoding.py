"""Stage k06: paged decoding, flash decoding over a block table (frontier-attention's f03 layout).

Spec: paged_partials(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2) with q (b, num_heads, d), pools
(num_blocks, num_heads, block_size, d) (block_size a power of 2), block_tables (b, max_blocks) and seq_lens (b,)
integers returns stage k05's partial results (partial_o (b, num_heads, num_splits, d), partial_lse (b, num_heads,
num_splits), float32) of one query per sequence and head against that sequence's seq_lens[r] cached tokens (token p
in block block_tables[r, p // block_size], slot p % block_size), split s holding the sequence's logical blocks
[s * per_split, (s + 1) * per_split), per_split = cdiv(cdiv(seq_lens[r], block_size), num_splits). The slots past a
sequence's length and the table entries past its blocks are never read. paged_decode(...) returns o (b, num_heads,
d) in q's dtype, the partials combined by k05_flash_decoding.combine_splits (graded with the kit's: a mistake of
stage k05 costs nothing here).

The checks' pools hold large junk in every slot no sequence owns, and the tables' unused entries name real blocks:
reading either gives wrong values, never a fault. Expected values: NumPy float64. Tolerance: float32 against
float64 (rtol 1e-4, atol 1e-5). CUDA: against SDPA on each sequence's gathered keys, in float32 (rtol 1e-4, atol
1e-5) and bfloat16 (diagnosis.BFLOAT16).
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.paged_decoding
STAGE = "k06_paged_decoding"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
SWITCHES = K.PAGED_SWITCHES + K.PARTIAL_SWITCHES[1:]  # (the split bounds of k05 are block-wise here)


def cache_of(rng, lens, num_heads, d, page, spare=2):
    """A paged cache as the fixtures make it (assignments/kernels/fixtures.py): shuffled blocks, junk elsewhere."""
    held = [-(-n // page) for n in lens]
    num_blocks = sum(held) + spare
    k_pool, v_pool = (normal(rng, num_blocks, num_heads, page, d, scale=8.0) for _ in range(2))
    order = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, size=(len(lens), max(held) + 1))
    at = 0
    for row, (n, blocks) in enumerate(zip(lens, held)):
        tables[row, :blocks] = order[at:at + blocks]
        at += blocks
        for p in range(n):
            k_pool[tables[row, p // page], :, p % page] = normal(rng, num_heads, d)
            v_pool[tables[row, p // page], :, p % page] = normal(rng, num_heads, d)
    return k_pool, v_pool, tables.astype(np.int64), np.asarray(lens, np.int64)


def expected(q, k_pool, v_pool, tables, lens):
    """Each sequence's attention over its gathered keys, in float64: (b, num_heads, d)."""
    rows = []
    for r in range(len(lens)):
        keys, values, _ = K.paged_keys(k_pool, v_pool, tables, lens, r)
        rows.append(K.attention(np.asarray(q[r], np.float64)[:, None], keys, values, False)[0][:, 0])
    return np.stack(rows)


def evidence(stage, q, k_pool, v_pool, tables, lens, splits):
    """(diagnosis of the partial outputs, of paged_decode's output): the block table's, the lengths' and the splits'
    switches, searched here and told apart on a second case: the sequences in the other order, one feature fewer."""
    q2, k2, v2 = (np.ascontiguousarray(a[..., :-1]) if np.shape(a)[-1] > 1 else a for a in (q[::-1], k_pool, v_pool))
    tables2, lens2 = np.ascontiguousarray(tables[::-1]), np.ascontiguousarray(lens[::-1])

    def second_partials():
        ours = stage.paged_partials(q2, k2, v2, tables2, lens2, num_splits=splits)[0]
        return ours, lambda c: K.paged_partials(q2, k2, v2, tables2, lens2, splits, c)[0]

    def second_o():
        ours = stage.paged_decode(q2, k2, v2, tables2, lens2, num_splits=splits)
        return ours, lambda c: K.paged(q2, k2, v2, tables2, lens2, splits, c)

    return ([Searched(lambda c: K.paged_partials(q, k_pool, v_pool, tables, lens, splits, c)[0], SWITCHES,
                      "your partial outputs", second_partials)],
            [Searched(lambda c: K.paged(q, k_pool, v_pool, tables, lens, splits, c), SWITCHES, "your output",
                      second_o)])


def check(stage, q, k_pool, v_pool, tables, lens, splits, what, stored=None):
    about_partials, about_o = evidence(stage, q, k_pool, v_pool, tables, lens, splits)
    name = f"({what}, seq_lens={list(map(int, lens))}, num_splits={splits})"
    partial_o, partial_lse = stage.paged_partials(q, k_pool, v_pool, tables, lens, num_splits=splits)
    right_o, right_lse = K.paged_partials(q, k_pool, v_pool, tables, lens, splits)
    assert_close(f"partial_o {name}", partial_o, right_o, **FLOAT32, diagnosis=about_partials)
    assert_close(f"partial_lse {name}", partial_lse, right_lse, **FLOAT32)
    out = stage.paged_decode(q, k_pool, v_pool, tables, lens, num_splits=splits)
    assert_close(f"paged_decode{name}", out, expected(q, k_pool, v_pool, tables, lens) if stored is None else stored,
                 **FLOAT32, diagnosis=about_o)


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_small_example(stage, public_fx):
    """Two sequences of 13 and 6 tokens in blocks of 4 (4 and 2 blocks, the last ones partial), 2 heads of 8, two
    splits each."""
    fx = public_fx
    check(stage, fx.q, fx.k_pool, fx.v_pool, fx.block_tables, fx.seq_lens, int(fx.num_splits), "blocks of 4",
          stored=fx.o)


# ---------------------------------------------------------------- hidden

def test_lengths_that_differ(stage, hidden_fx):
    """Four sequences of 1, 29, 16 and 7 tokens in blocks of 8, three splits: the one-token sequence leaves two
    splits empty, the 16-token one ends on a block's end."""
    arrays = [hidden_fx[f"mixed/{n}"] for n in ("q", "k_pool", "v_pool", "block_tables", "seq_lens")]
    check(stage, *arrays, 3, "blocks of 8")


def test_long_pages(stage, hidden_fx):
    """Blocks of 16 (vLLM's), one head of 10, sequences of 40 and 3 tokens, two splits."""
    arrays = [hidden_fx[f"long_pages/{n}"] for n in ("q", "k_pool", "v_pool", "block_tables", "seq_lens")]
    check(stage, *arrays, 2, "blocks of 16")


def test_random_case(stage, rng):
    b, page = int(rng.integers(1, 4)), int(rng.choice([2, 4, 8]))
    lens = [int(n) for n in rng.integers(1, 30, size=b)]
    heads, d = int(rng.integers(1, 3)), int(rng.integers(1, 12))
    k_pool, v_pool, tables, seq_lens = cache_of(rng, lens, heads, d, page)
    check(stage, normal(rng, b, heads, d), k_pool, v_pool, tables, seq_lens, int(rng.integers(1, 4)),
          f"blocks of {page}")


SIZES = {  # the CUDA case: Llama 2 7B's 32 heads of 128 in vLLM's blocks of 16, 8 sequences up to 4096 tokens
    "cpu": dict(lens=(37, 5, 20), heads=2, d=16, page=8, splits=2, dtypes=("float32", "bfloat16")),
    "cuda": dict(lens=(4096, 1, 517, 2048, 3001, 16, 1000, 4000), heads=32, d=128, page=16, splits=8,
                 dtypes=("float32", "bfloat16")),
    "dry run": dict(lens=(90, 3, 41), heads=2, d=32, page=16, splits=4, dtypes=("float32", "bfloat16")),
}


def test_llama_sized_pages(stage, target):
    """paged_decode against F.scaled_dot_product_attention on each sequence's keys gathered through its table, in
    float32 on the same rounded inputs, on the device."""
    import torch
    import torch.nn.functional as F

    size = SIZES[target.size]
    rng = np.random.default_rng(16)
    k_pool, v_pool, tables, lens = cache_of(rng, size["lens"], size["heads"], size["d"], size["page"])
    q = normal(rng, len(lens), size["heads"], size["d"])
    for dtype in size["dtypes"]:
        [out] = stage.session(None, steps=[{"function": "paged_decode", "args": [q, k_pool, v_pool, tables, lens],
                                            "kwargs": {"num_splits": size["splits"]}}], device=target.device,
                              dtype=dtype)
        qt, kp, vp = (torch.from_numpy(a).to(device=target.device, dtype=getattr(torch, dtype)).float()
                      for a in (q, k_pool, v_pool))
        rows = []
        for r, n in enumerate(lens):
            blocks = torch.from_numpy(tables[r, :-(-int(n) // size["page"])]).to(target.device)
            keys, values = (pool[blocks].transpose(0, 1).reshape(size["heads"], -1, size["d"])[:, :n]
                            for pool in (kp, vp))
            rows.append(F.scaled_dot_product_attention(qt[r][:, None], keys, values)[:, 0])
        about = [] if target.cuda or dtype != "float32" else evidence(stage, q, k_pool, v_pool, tables, lens,
                                                                        size["splits"])[1]
        assert_close(f"paged_decode ({target.device}, {dtype}, {len(lens)} sequences, {size['heads']} heads)", out,
                     torch.stack(rows).cpu().numpy(), **(BFLOAT16 if dtype == "bfloat16" else FLOAT32),
                     diagnosis=about)


@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """8 sequences of up to 8192 tokens in blocks of 16, 32 heads of 128 in bfloat16 on a GPU, 8 splits: against
    the reference kernel."""
    speed.require(impl, request.config)
    rng = np.random.default_rng(12)
    k_pool, v_pool, tables, lens = cache_of(rng, [8192, 100, 4000, 8000, 1, 6000, 512, 7777], 32, 128, 16)
    q = normal(rng, 8, 32, 128)
    speed.check(stage, fraction, STAGE, "paged_decode", [q, k_pool, v_pool, tables, lens], {"num_splits": 8},
                what="bfloat16, 8 sequences up to 8192 tokens, 32 heads of 128, blocks of 16")
