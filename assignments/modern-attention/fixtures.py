"""The fixtures of modern-attention's stages (``attnkit fixtures`` writes them, grader.authoring.fixtures).

One generator per stage module, ``m03_kv_cache(ref, public, hidden)``: it fills the two ``Arrays`` it is given
(``public/<stage>.npz`` ships to students, ``hidden/`` never does) from the reference implementation ``ref``.
Inputs and weights come from NumPy's PCG64 generator with fixed seeds, the same numbers on every platform;
the public ones start from the book's running example (chapter 3's, assignments/attention/book.py).
"""
import numpy as np

from grader.authoring.fixtures import decoding_case, module_case, rng, seeded_weights
from grader.kit import assignment
from suite_runtime.cases import draw_weights, linear_shapes, mha_shapes, random_weights

example = assignment("attention").module("book")  # the book's running example
BATCH, BOOK_SEED_MODULES, JOURNEY = example.BATCH, example.BOOK_SEED_MODULES, example.JOURNEY


# ---------------------------------------------------------------- m01, m02

# b, num_tokens, d_in, d_out, context_length, num_heads, qkv_bias (where d_in == d_out: nn.MultiheadAttention too)
M01_HIDDEN = [
    (2, 7, 6, 12, 10, 3, True),
    (3, 6, 8, 8, 6, 4, False),
    (1, 9, 16, 16, 12, 2, True),
]


def m01_pytorch_attention(ref, public, hidden):
    s = ref.stage("m01_pytorch_attention")

    def case(out, prefix, init, x, weights, owner):
        out.add_init(prefix, init)
        weights = out.add_weights(prefix, weights, owner)
        out.add(f"{prefix}output", s.forward("MultiHeadAttention", init, x, weights),
                "chapter 3's MultiHeadAttention output (eval mode): what SDPA and nn.MultiheadAttention must give")

    x = public.add("x", BATCH, "the book's batch of two copies of the journey embeddings (2, 6, 3)")
    init = dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
    book = seeded_weights("m01_pytorch_attention", "MultiHeadAttention", BOOK_SEED_MODULES, **init)
    case(public, "book/", init, x, book,
         "MultiHeadAttention(3, 2, 6, 0.0, 2) at torch.manual_seed(123), the book's example of section 3.6.2")
    # d_in == d_out, as nn.MultiheadAttention needs; every other size distinct from it and from each other
    init = dict(d_in=8, d_out=8, context_length=6, dropout=0.0, num_heads=2, qkv_bias=True)
    r = rng(10100)
    square = public.add("square/x", r.normal(size=(3, 5, 8)), "input batch (3, 5, 8) of the square module")
    case(public, "square/", init, square, random_weights(r, mha_shapes(8, 8, True)),
         "MultiHeadAttention(8, 8, 6, 0.0, 2, qkv_bias=True): d_in == d_out, as nn.MultiheadAttention needs")
    for i, (b, t, d_in, d_out, ctx, heads, bias) in enumerate(M01_HIDDEN):
        r = rng(10110 + i)
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, dropout=0.0, num_heads=heads, qkv_bias=bias)
        x = hidden.add(f"case{i}/x", r.normal(size=(b, t, d_in)), f"input batch ({b}, {t}, {d_in})")
        case(hidden, f"case{i}/", init, x, random_weights(r, mha_shapes(d_in, d_out, bias)), "MultiHeadAttention")


def cross_case(ref, out, prefix, init, x, weights, **inputs):
    """Store a CrossAttention case: constructor, x, the forward's other inputs, weights and output."""
    out.add_init(prefix, init)
    x = out.add(f"{prefix}x", x, f"queries' inputs x {tuple(np.shape(x))}")
    kwargs = {name: out.add(f"{prefix}{name}", value, f"forward's {name}") for name, value in inputs.items()}
    kwargs["causal"] = bool(kwargs.get("causal", False))
    out.add(f"{prefix}causal", np.asarray(kwargs["causal"]), "forward's causal flag")
    weights = out.add_weights(prefix, weights, "CrossAttention")
    [output] = ref.stage("m02_padding_and_cross").session(
        "CrossAttention", init, weights, steps=[{"method": "forward", "args": [x], "kwargs": kwargs}])
    out.add(f"{prefix}output", output, "CrossAttention output (eval mode)")


def padding_mask_of_lengths(lengths, n, left=False):
    """(len(lengths), n) key_padding_mask: True on each sequence's first (left: last) `length` positions."""
    positions = np.arange(n)
    lengths = np.asarray(lengths)[:, None]
    return positions >= n - lengths if left else positions < lengths


def cross_weights(r, d_in, d_out, d_context, bias):
    """Random CrossAttention weights: W_query from d_in, W_key and W_value from d_context features."""
    return random_weights(r, {**linear_shapes("W_query", d_in, d_out, bias),
                              **linear_shapes("W_key", d_context, d_out, bias),
                              **linear_shapes("W_value", d_context, d_out, bias),
                              **linear_shapes("out_proj", d_out, d_out)})


def m02_padding_and_cross(ref, public, hidden):
    lengths = padding_mask_of_lengths
    r = rng(10200)
    # The journey sentence, and its first four tokens followed by two padding tokens (any values: masked out).
    padded = np.stack([JOURNEY, np.concatenate([JOURNEY[:4], r.uniform(size=(2, 3))])])
    init = dict(d_in=3, d_out=20, num_heads=4)  # (head_dim 5: no size equals another)
    weights = cross_weights(r, 3, 20, 3, False)
    cross_case(ref, public, "padded/", init, padded, weights, key_padding_mask=lengths([6, 4], 6))
    # Cross-attention: the journey tokens read a context of 8 tokens of width 7 (an encoder's output, say).
    cross_case(ref, public, "cross/", dict(init, d_context=7, qkv_bias=True), np.stack([JOURNEY, JOURNEY]),
               cross_weights(r, 3, 20, 7, True), context=r.normal(size=(2, 8, 7)), key_padding_mask=lengths([8, 5], 8))
    # Left padding with a causal mask: the padded sequence's first two queries have no key to attend to.
    left = np.stack([JOURNEY, np.concatenate([r.uniform(size=(2, 3)), JOURNEY[:4]])])
    cross_case(ref, public, "left/", init, left, weights, key_padding_mask=lengths([6, 4], 6, left=True), causal=True)

    r = rng(10210)
    # (every size of a case distinct from the others: batch, tokens, d_in, d_out, heads, head_dim, the context's)
    cross_case(ref, hidden, "case0/", dict(d_in=5, d_out=8, num_heads=2, qkv_bias=True), r.normal(size=(3, 7, 5)),
               cross_weights(r, 5, 8, 5, True), key_padding_mask=lengths([7, 4, 1], 7))
    cross_case(ref, hidden, "case1/", dict(d_in=4, d_out=18, num_heads=3, d_context=7), r.normal(size=(2, 5, 4)),
               cross_weights(r, 4, 18, 7, False), context=r.normal(size=(2, 9, 7)), key_padding_mask=lengths([9, 3], 9))
    cross_case(ref, hidden, "case2/", dict(d_in=9, d_out=12, num_heads=3), r.normal(size=(2, 6, 9)),
               cross_weights(r, 9, 12, 9, False), key_padding_mask=lengths([6, 2], 6, left=True), causal=True)

# ---------------------------------------------------------------- m03, m04

# b, num_tokens, d_in, d_out, context_length, num_heads, qkv_bias, chunks
M03_HIDDEN = [  # (every size of a case distinct from the others)
    (2, 9, 5, 12, 12, 3, True, (4, 1, 1, 3)),
    (3, 8, 6, 10, 8, 2, False, (2, 3, 1, 2)),  # the sequence fills the whole context
]


def m03_kv_cache(ref, public, hidden):
    stage, cls = ref.stage("m03_kv_cache"), "MultiHeadAttentionWithCache"

    def case(out, prefix, r, b, t, d_in, d_out, context_length, num_heads, qkv_bias, chunks, x=None):
        init = dict(d_in=d_in, d_out=d_out, context_length=context_length, num_heads=num_heads, dropout=0.0,
                    qkv_bias=qkv_bias)
        x = r.normal(size=(b, t, d_in)).astype(np.float32) if x is None else x
        weights = draw_weights(r, stage, cls, init)
        decoding_case(out, prefix, stage, cls, init, x, chunks, weights)
        return init, weights

    # The book's batch of two "Your journey starts with one step" sequences: a prompt of 3 tokens, then 1 by 1.
    case(public, "", rng(3000), *BATCH.shape, 20, 8, 4, False, (3, 1, 1, 1), x=BATCH)
    for i, sizes in enumerate(M03_HIDDEN):
        case(hidden, f"case{i}/", rng(3001 + i), *sizes)
    # Two sequences one after the other in one module, reset_cache() between them.
    r = rng(3010)
    init, weights = case(hidden, "first/", r, 2, 6, 4, 15, 11, 3, True, (3, 1, 2))
    second = r.normal(size=(2, 7, 4)).astype(np.float32)
    hidden.add("second/x", second, "the next sequence (2, 7, 4), decoded with the same weights after reset_cache()")
    hidden.add("second/chunks", np.asarray((2, 2, 1, 2), np.int64), "its tokens per cached step")
    hidden.add("second/output", stage.forward(cls, init, second, weights),
               "its full causal forward")


# b, num_tokens, d_in, d_out, context_length, num_heads, num_kv_groups, qkv_bias, chunks
M04_HIDDEN = [  # (every size of a case distinct from the others)
    (1, 9, 6, 24, 10, 8, 2, True, (3, 1, 5)),  # groups of 4 query heads
    (1, 7, 5, 12, 7, 6, 3, False, (2, 2, 1, 2)),  # groups of 2, the whole context
    (2, 6, 5, 12, 8, 4, 1, True, (4, 1, 1)),  # multi-query attention
]


def m04_grouped_query(ref, public, hidden):
    stage, cls = ref.stage("m04_grouped_query"), "GroupedQueryAttention"

    def case(out, prefix, r, b, t, d_in, d_out, context_length, num_heads, num_kv_groups, qkv_bias, chunks, x=None):
        init = dict(d_in=d_in, d_out=d_out, context_length=context_length, num_heads=num_heads,
                    num_kv_groups=num_kv_groups, dropout=0.0, qkv_bias=qkv_bias)
        x = r.normal(size=(b, t, d_in)).astype(np.float32) if x is None else x
        decoding_case(out, prefix, stage, cls, init, x, chunks, draw_weights(r, stage, cls, init))

    # The journey batch through 8 query heads (of 5 features) that share 4 key/value heads in pairs.
    case(public, "", rng(4000), *BATCH.shape, 40, 6, 8, 4, False, (3, 1, 1, 1), x=BATCH)
    for i, sizes in enumerate(M04_HIDDEN):
        case(hidden, f"case{i}/", rng(4001 + i), *sizes)


# ---------------------------------------------------------------- m05, m06

def stored_module_case(out, prefix, stage, cls, init, x, seed, owner):
    """A module case with weights drawn for every parameter of the reference ``cls`` (arguments that are None, a
    default, are left out of the stored init); its output is the full forward."""
    init = {k: v for k, v in init.items() if v is not None}
    weights = random_weights(rng(seed), stage.inspect(cls, init)["parameters"])
    module_case(out, prefix, stage, cls, init, x, weights, owner, output=f"{cls} output, the full forward")


# b, num_tokens, d_in, d_out, context_length, num_heads, num_kv_groups, qkv_bias, theta_base
M05_HIDDEN = [  # (every size of a case distinct from the others)
    (2, 9, 10, 24, 12, 6, 3, True, 10_000.0),
    (1, 11, 12, 16, 16, 2, None, False, 500_000.0),  # head_dim 8, Llama 3's theta_base
]


def m05_rotary_embeddings(ref, public, hidden):
    s = ref.stage("m05_rotary_embeddings")

    def rope_case(out, r, head_dim, context_length, theta_base, x_shape, offset):
        cos, sin = s.rope_angles(head_dim, context_length, theta_base)
        out.add("angles/init", np.array([head_dim, context_length, theta_base]),
                "rope_angles(head_dim, context_length, theta_base) arguments")
        out.add("angles/cos", cos, f"rope_angles({head_dim}, {context_length}, {theta_base:g})[0]")
        out.add("angles/sin", sin, f"rope_angles({head_dim}, {context_length}, {theta_base:g})[1]")
        x = out.add("rope/x", r.normal(size=x_shape), f"a (b, heads, num_tokens, head_dim) = {x_shape} tensor")
        out.add("rope/offset", np.asarray(offset), "the position of x's first token in the second case")
        out.add("rope/at_0", s.apply_rope(x, cos, sin), "apply_rope(x, cos, sin): positions 0, 1, ...")
        out.add("rope/at_offset", s.apply_rope(x, cos, sin, offset=offset),
                "apply_rope(x, cos, sin, offset): positions offset, offset + 1, ...")

    rope_case(public, rng(10500), 8, 6, 10_000.0, (1, 2, 4, 8), 2)
    rope_case(hidden, rng(10501), 16, 12, 500_000.0, (2, 3, 5, 16), 7)
    init = dict(d_in=6, d_out=12, context_length=8, num_heads=3)
    stored_module_case(public, "", s, "RoPEAttention", init, rng(10502).normal(size=(2, 7, 6)), 10503,
                       "RoPEAttention(6, 12, 8, 3)")
    for i, (b, t, d_in, d_out, ctx, heads, groups, bias, theta) in enumerate(M05_HIDDEN):
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, num_heads=heads, num_kv_groups=groups,
                    qkv_bias=bias, theta_base=theta)
        stored_module_case(hidden, f"case{i}/", s, "RoPEAttention", init, rng(10510 + i).normal(size=(b, t, d_in)),
                           10520 + i, "RoPEAttention")


# b, num_tokens, d_in, d_out, context_length, num_heads, window, qkv_bias
M06_HIDDEN = [  # (every size of a case distinct from the others)
    (2, 11, 10, 12, 12, 3, 5, True),
    (1, 9, 7, 10, 11, 2, 3, False),
]


def m06_sliding_window(ref, public, hidden):
    s = ref.stage("m06_sliding_window")
    public.add("mask", s.sliding_window_mask(6, 3), "sliding_window_mask(6, 3)")
    for n, window in [(9, 4), (5, 1), (4, 7)]:
        hidden.add(f"mask/{n}_{window}", s.sliding_window_mask(n, window), f"sliding_window_mask({n}, {window})")
    init = dict(d_in=6, d_out=10, context_length=8, num_heads=2, window=4)
    stored_module_case(public, "", s, "SlidingWindowAttention", init, rng(10600).normal(size=(3, 7, 6)), 10601,
                       "SlidingWindowAttention(6, 10, 8, 2, window=4)")
    for i, (b, t, d_in, d_out, ctx, heads, window, bias) in enumerate(M06_HIDDEN):
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, num_heads=heads, window=window, qkv_bias=bias)
        stored_module_case(hidden, f"case{i}/", s, "SlidingWindowAttention", init,
                           rng(10610 + i).normal(size=(b, t, d_in)), 10620 + i, "SlidingWindowAttention")


# ---------------------------------------------------------------- m07

def m07_tiled_attention(ref, public, hidden):
    s = ref.stage("m07_tiled_attention")

    def qkv(out, prefix, r, b, h, n_q, n_kv, d, block_size, q_scale=1.0, what=""):
        q = out.add(f"{prefix}q", r.normal(size=(b, h, n_q, d)) * q_scale, f"queries (b, h, n_q, d){what}")
        # Keys shrink along the sequence: the first tiles hold the largest scores, later tiles smaller maxima.
        shrink = np.linspace(1.0, 0.1, n_kv)[:, None] if q_scale != 1.0 else 1.0
        k = out.add(f"{prefix}k", r.normal(size=(b, h, n_kv, d)) * shrink, "keys (b, h, n_kv, d)")
        v = out.add(f"{prefix}v", r.normal(size=(b, h, n_kv, d)), "values (b, h, n_kv, d)")
        out.add(f"{prefix}block_size", np.int64(block_size), "tiles of block_size queries x block_size keys")
        return q, k, v

    q, k, v = qkv(public, "", rng(70), 1, 2, 10, 10, 4, 3)
    for is_causal, name in ((False, "output"), (True, "output_causal")):
        public.add(name, s.tiled_attention(q, k, v, is_causal=is_causal, block_size=3),
                   f"tiled_attention(q, k, v, is_causal={is_causal}, block_size=3)")
    qkv(public, "long/", rng(71), 1, 2, 256, 256, 8, 32, what=": the memory check's inputs")

    r = rng(72)
    for prefix, n_q, n_kv, d, block_size in (("ragged/", 37, 37, 16, 8), ("fewer_queries/", 5, 37, 8, 4),
                                             ("more_queries/", 37, 5, 8, 4), ("block_one/", 9, 13, 4, 1),
                                             ("block_beyond/", 20, 20, 8, 128)):
        qkv(hidden, prefix, r, 2, 3, n_q, n_kv, d, block_size)
    for prefix, q_scale in (("large_1e3/", 1e3), ("large_1e4/", 1e4)):
        # (small: a failure prints both arrays whole when one holds NaN)
        qkv(hidden, prefix, r, 1, 2, 24, 24, 4, 6, q_scale=q_scale, what=f", scaled by {q_scale:g}")
