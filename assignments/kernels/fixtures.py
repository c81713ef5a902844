"""The fixtures of the kernels assignment's stages (``attnkit fixtures`` writes them, grader.authoring.fixtures).

One generator per stage module, ``k01_fused_softmax(ref, public, hidden)``: the public example's inputs and the
reference kernel's outputs on them (run through Triton's interpreter where there is no GPU), and the hidden cases'
inputs (their expected values are computed at test time, in NumPy float64). Inputs come from NumPy's PCG64 generator
with fixed seeds, the same numbers on every platform. Sizes stay small: the interpreter runs one program at a time.
"""
import numpy as np

from grader.authoring.fixtures import rng


def normal(r, *shape, scale=1.0):
    return (r.normal(size=shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- k01

def k01_fused_softmax(ref, public, hidden):
    stage = ref.stage("k01_fused_softmax")
    x = public.add("x", normal(rng(40100), 4, 37, scale=2.0), "4 rows of 37 logits")
    public.add("block_size", np.int64(16), "the chunk length: two full chunks and a partial one of 5")
    public.add("softmax", stage.softmax(x, block_size=16), "softmax(x, block_size=16), the reference kernel's")
    r = rng(40110)
    for name, shape, block, scale in (("long_rows", (3, 70), 16, 2.0), ("short_rows", (5, 5), 32, 3.0),
                                      ("leading_axes", (2, 3, 21), 8, 2.0)):
        hidden.add(f"{name}/x", normal(r, *shape, scale=scale), f"logits {shape}")
        hidden.add(f"{name}/block_size", np.int64(block), "the chunk length")
    huge = normal(r, 3, 48, scale=300.0)
    huge[:, 2] = [1e4, 9.99e3, 5e3]  # the largest values in the first chunk: later chunks' maxima are far smaller
    huge[1, 30] = 9.995e3  # row 1: two large values in two chunks
    hidden.add("huge/x", huge, "logits up to 1e4, the largest in the first chunk")
    hidden.add("huge/block_size", np.int64(16), "the chunk length")
    hidden.add("negative/x", (-1e4 + r.uniform(0, 1e3, size=(2, 40))).astype(np.float32), "logits in [-1e4, -9e3]")
    hidden.add("negative/block_size", np.int64(16), "the chunk length")


# ---------------------------------------------------------------- k02, k03, k04: one head's q, k, v

def qkv(r, b, h, t, d, scale=1.0):
    return normal(r, b, h, t, d, scale=scale), normal(r, b, h, t, d), normal(r, b, h, t, d)


def k02_tiled_scores(ref, public, hidden):
    stage = ref.stage("k02_tiled_scores")
    q, k, _ = qkv(rng(40200), 1, 2, 20, 6)
    public.add("q", q, "queries (b=1, num_heads=2, T=20, d=6)")
    public.add("k", k, "keys (1, 2, 20, 6)")
    for causal in (False, True):
        public.add(f"weights_causal_{causal}", stage.attention_weights(q, k, causal),
                   f"attention_weights(q, k, is_causal={causal}), tiles of 16 x 16, the reference kernel's")
    r = rng(40210)
    # T not a multiple of either tile; d not a power of 2 (BLOCK_D = 16 or 32 pads it)
    for name, (b, h, t, d) in (("ragged", (1, 2, 37, 12)), ("wide_heads", (2, 1, 23, 24))):
        q, k, _ = qkv(r, b, h, t, d)
        hidden.add(f"{name}/q", q, f"queries {q.shape}")
        hidden.add(f"{name}/k", k, f"keys {k.shape}")


def k03_flash_forward(ref, public, hidden):
    stage = ref.stage("k03_flash_forward")
    q, k, v = qkv(rng(40300), 1, 2, 20, 6)
    for name, a in (("q", q), ("k", k), ("v", v)):
        public.add(name, a, f"{name} (b=1, num_heads=2, T=20, d=6)")
    for causal in (False, True):
        o, lse = stage.flash_attention_forward(q, k, v, causal)
        public.add(f"o_causal_{causal}", o, f"o of flash_attention_forward(q, k, v, is_causal={causal})")
        public.add(f"lse_causal_{causal}", lse, f"lse of flash_attention_forward(q, k, v, is_causal={causal})")
    r = rng(40310)
    for name, (b, h, t, d), scale in (("ragged", (1, 2, 37, 12), 1.0), ("large_logits", (1, 1, 45, 10), 30.0)):
        q, k, v = qkv(r, b, h, t, d, scale)
        if name == "large_logits":  # the keys that score highest come last: later tiles raise the max a lot
            k = k[..., np.argsort((q.mean(axis=-2, keepdims=True) @ np.swapaxes(k, -1, -2))[0, 0, 0]), :]
        for n, a in (("q", q), ("k", k), ("v", v)):
            hidden.add(f"{name}/{n}", a, f"{n} {a.shape}")


def k04_flash_backward(ref, public, hidden):
    stage = ref.stage("k04_flash_backward")
    q, k, v = qkv(rng(40400), 1, 2, 20, 6)
    do = normal(rng(40401), 1, 2, 20, 6)
    for name, a in (("q", q), ("k", k), ("v", v), ("do", do)):
        public.add(name, a, f"{name} (b=1, num_heads=2, T=20, d=6)")
    forward = ref.stage("k03_flash_forward")
    for causal in (False, True):
        o, lse = forward.flash_attention_forward(q, k, v, causal)
        public.add(f"o_causal_{causal}", o, f"stage k03's o, is_causal={causal}")
        public.add(f"lse_causal_{causal}", lse, f"stage k03's lse, is_causal={causal}")
        for g, grad in zip(("dq", "dk", "dv"), stage.flash_attention_backward(q, k, v, o, lse, do, causal)):
            public.add(f"{g}_causal_{causal}", grad, f"{g} of flash_attention_backward(..., is_causal={causal})")
    r = rng(40410)
    q, k, v = qkv(r, 1, 2, 37, 12)
    for n, a in (("q", q), ("k", k), ("v", v), ("do", normal(r, 1, 2, 37, 12))):
        hidden.add(f"ragged/{n}", a, f"{n} {a.shape}")


# ---------------------------------------------------------------- k05, k06: one query against a cache

def k05_flash_decoding(ref, public, hidden):
    stage = ref.stage("k05_flash_decoding")
    r = rng(40500)
    q, k, v = normal(r, 1, 2, 8), normal(r, 1, 2, 30, 8), normal(r, 1, 2, 30, 8)
    for name, a in (("q", q), ("k", k), ("v", v)):
        public.add(name, a, f"{name} {a.shape}: one query per head, a cache of 30 keys")
    public.add("num_splits", np.int64(3), "three splits of 10 keys")
    partial_o, partial_lse = stage.split_partials(q, k, v, 3)
    public.add("partial_o", partial_o, "split_partials(q, k, v, 3)'s outputs, the reference kernel's")
    public.add("partial_lse", partial_lse, "split_partials(q, k, v, 3)'s log-sum-exps")
    public.add("o", stage.flash_decode(q, k, v, 3), "flash_decode(q, k, v, 3)")
    r = rng(40510)
    for name, (b, h, t, d), scale in (("long", (2, 1, 75, 12), 1.0), ("few_keys", (1, 2, 5, 6), 1.0),
                                      ("large_logits", (1, 2, 40, 8), 40.0)):
        arrays = (("q", normal(r, b, h, d, scale=scale)), ("k", normal(r, b, h, t, d)), ("v", normal(r, b, h, t, d)))
        for n, a in arrays:
            hidden.add(f"{name}/{n}", a, f"{n} {a.shape}")


def paged_cache(r, lens, num_heads, d, page, spare=3, scale=1.0):
    """A pool holding sequences of ``lens`` tokens in shuffled blocks, the rest of the pool (and each last block's
    unused slots) filled with large values that must never be read, and tables whose entries past a sequence's
    blocks name real blocks too (reading them gives wrong values, never a fault)."""
    held = [-(-n // page) for n in lens]
    num_blocks = sum(held) + spare
    k_pool = normal(r, num_blocks, num_heads, page, d, scale=8.0)  # junk everywhere ...
    v_pool = normal(r, num_blocks, num_heads, page, d, scale=8.0)
    order = r.permutation(num_blocks)
    tables = r.integers(0, num_blocks, size=(len(lens), max(held) + 1))
    at = 0
    for row, (n, blocks) in enumerate(zip(lens, held)):
        tables[row, :blocks] = order[at:at + blocks]
        at += blocks
        for p in range(n):  # ... but in the slots a sequence holds
            k_pool[tables[row, p // page], :, p % page] = normal(r, num_heads, d, scale=scale)
            v_pool[tables[row, p // page], :, p % page] = normal(r, num_heads, d)
    return k_pool, v_pool, tables.astype(np.int64), np.asarray(lens, np.int64)


def k06_paged_decoding(ref, public, hidden):
    stage = ref.stage("k06_paged_decoding")
    r = rng(40600)
    k_pool, v_pool, tables, lens = paged_cache(r, [13, 6], 2, 8, 4)
    q = normal(r, 2, 2, 8)
    for name, a, what in (("q", q, "one query per sequence and head"), ("k_pool", k_pool, "the pool of keys"),
                          ("v_pool", v_pool, "the pool of values"), ("block_tables", tables, "the block tables"),
                          ("seq_lens", lens, "the sequences' lengths")):
        public.add(name, a, f"{what} {a.shape}")
    public.add("num_splits", np.int64(2), "two splits per sequence")
    public.add("o", stage.paged_decode(q, k_pool, v_pool, tables, lens, 2), "paged_decode(..., num_splits=2)")
    r = rng(40610)
    for name, lens, heads, d, page in (("mixed", [1, 29, 16, 7], 2, 6, 8), ("long_pages", [40, 3], 1, 10, 16)):
        k_pool, v_pool, tables, lens = paged_cache(r, lens, heads, d, page)
        for n, a in (("q", normal(r, len(lens), heads, d)), ("k_pool", k_pool), ("v_pool", v_pool),
                     ("block_tables", tables), ("seq_lens", lens)):
            hidden.add(f"{name}/{n}", a, f"{n} {a.shape}")
