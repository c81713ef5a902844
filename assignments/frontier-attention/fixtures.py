"""The fixtures of frontier-attention's stages (``attnkit fixtures`` writes them, grader.authoring.fixtures).

One generator per stage module, ``f01_latent_attention(ref, public, hidden)``: it fills the two ``Arrays`` it is
given (``public/<stage>.npz`` ships to students, ``hidden/`` never does) from the reference implementation ``ref``.
Inputs and weights come from NumPy's PCG64 generator with fixed seeds, the same numbers on every platform; the
public examples of the stages whose modules take (b, num_tokens, d_in) inputs are chapter 3's journey sentence
(assignments/attention/book.py).
"""
import numpy as np

from grader.authoring.fixtures import decoding_case, module_case, rng
from grader.kit import assignment
from suite_runtime.cases import draw_weights

example = assignment("attention").module("book")  # the book's running example
BATCH, JOURNEY = example.BATCH, example.JOURNEY


# ---------------------------------------------------------------- f01

# b, num_tokens, d_in, d_out, context_length, num_heads, kv_latent_dim, rope_dim, theta_base, chunks
# (every case's sizes pairwise distinct: a swapped dimension cannot pass)
F01_HIDDEN = [
    (2, 9, 6, 15, 11, 3, 7, 4, 10_000.0, (4, 1, 1, 3)),
    (1, 8, 10, 12, 13, 2, 3, 4, 500.0, (2, 3, 1, 2)),  # a latent smaller than a head
]


def f01_latent_attention(ref, public, hidden):
    stage, cls = ref.stage("f01_latent_attention"), "MultiHeadLatentAttention"

    def case(out, prefix, r, x, chunks, **init):
        weights = draw_weights(r, stage, cls, init)
        weights["kv_norm.weight"] = r.uniform(0.5, 1.5, init["kv_latent_dim"])  # a norm's scale, near 1
        decoding_case(out, prefix, stage, cls, init, x, chunks, weights)

    # The journey batch (2 x 6 tokens of 3 features) through 4 heads of 5 content features, a latent of 7 and
    # rotary parts of 8: every size different.
    case(public, "", rng(20100), BATCH, (3, 1, 1, 1), d_in=3, d_out=20, context_length=10, num_heads=4,
         kv_latent_dim=7, rope_dim=8)
    for i, (b, t, d_in, d_out, ctx, heads, latent, rope, theta, chunks) in enumerate(F01_HIDDEN):
        r = rng(20110 + i)
        case(hidden, f"case{i}/", r, r.normal(size=(b, t, d_in)).astype(np.float32), chunks, d_in=d_in, d_out=d_out,
             context_length=ctx, num_heads=heads, kv_latent_dim=latent, rope_dim=rope, theta_base=theta)


# ---------------------------------------------------------------- f02

# b, num_tokens, d_in, d_out, num_heads, num_kv_groups, window, num_sink_tokens, qkv_bias, chunks
# (the sizes of each case pairwise distinct: batch, tokens, d_in, d_out, heads, key/value groups, head_dim)
F02_HIDDEN = [
    (3, 12, 5, 24, 4, 2, 4, 2, True, (5, 1, 1, 1, 1, 3)),  # StreamingLLM: sink tokens and a window
    (2, 10, 6, 12, 4, 1, 5, 0, False, (1,) * 10),  # gpt-oss's sliding layers: a window and learned sinks
    (2, 9, 5, 12, 3, None, None, 0, True, (4, 2, 3)),  # no window: full causal attention with learned sinks
]


def f02_attention_sinks(ref, public, hidden):
    stage, cls = ref.stage("f02_attention_sinks"), "SinkAttention"
    positions = public.add("mask/positions", np.arange(8), "query and key positions 0..7")
    public.add("mask/allowed", stage.sink_window_mask(positions, positions, window=3, num_sink_tokens=2),
               "sink_window_mask(positions, positions, window=3, num_sink_tokens=2)")
    r = rng(20200)
    scores = r.normal(size=(1, 2, 4, 5)) * 2
    scores[0, :, 1, 3:] = -np.inf  # masked keys
    scores[0, 0, 2] = scores[0, 0, 2] * 300  # large logits: exp overflows unless the max is subtracted
    scores[0, 1, 3] = -np.inf  # every key masked: the weights are 0 (the sink takes it all)
    scores = public.add("softmax/scores", scores, "scores (b, num_heads, n_q, n_k) with -inf where masked")
    sinks = public.add("softmax/sinks", np.array([0.5, -1.0]), "one sink logit per head")
    public.add("softmax/weights", stage.softmax_with_sinks(scores, sinks), "softmax_with_sinks(scores, sinks)")

    def case(out, prefix, r, x, chunks, **init):
        weights = draw_weights(r, stage, cls, init)
        weights["sinks"] = r.normal(size=init["num_heads"])  # logits of the size of the scores
        decoding_case(out, prefix, stage, cls, init, x, chunks, weights)

    # The journey batch (2 x 6 tokens of 3 features) through 4 query heads of 5 features sharing 1 key/value head.
    case(public, "", rng(20201), BATCH, (3, 1, 1, 1), d_in=3, d_out=20, context_length=6, num_heads=4,
         num_kv_groups=1, window=3, num_sink_tokens=1)
    for i, (b, t, d_in, d_out, heads, kv, window, sinks, bias, chunks) in enumerate(F02_HIDDEN):
        r = rng(20210 + i)
        init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=heads, num_sink_tokens=sinks, qkv_bias=bias)
        if kv is not None:
            init["num_kv_groups"] = kv
        if window is not None:
            init["window"] = window
        case(hidden, f"case{i}/", r, r.normal(size=(b, t, d_in)).astype(np.float32), chunks, **init)


# ---------------------------------------------------------------- f03

def f03_paged_kv_cache(ref, public, hidden):
    stage, cls = ref.stage("f03_paged_kv_cache"), "PagedAttention"

    def full_forward(init, weights, x):
        [out] = stage.session(cls, init, weights, steps=[{"method": "forward", "args": [x[None]], "kwargs": {
            "seq_ids": [0]}}])
        return out

    # Sequence 0 is the journey sentence; sequences 1 and 2 are other tokens of the same width.
    r = rng(20300)
    init = dict(d_in=3, d_out=28, num_heads=4, num_blocks=8, block_size=2)  # (every size different)
    public.add_init("", init)
    weights = public.add_weights("", draw_weights(r, stage, cls, init), cls)
    a = public.add("a/x", JOURNEY, "sequence 0: the journey embeddings (6, 3)")
    public.add("b/x", r.uniform(size=(4, 3)), "sequence 1's tokens (4, 3)")
    public.add("c/x", r.uniform(size=(4, 3)), "sequence 2's tokens (4, 3)")
    public.add("a/output", full_forward(init, weights, a), "sequence 0's full causal forward (1, 6, 4)")

    r = rng(20310)
    init = dict(d_in=5, d_out=8, num_heads=2, num_blocks=9, block_size=3, qkv_bias=True)
    hidden.add_init("", init)
    weights = hidden.add_weights("", draw_weights(r, stage, cls, init), cls)
    for i, n in enumerate((9, 8, 9)):
        hidden.add(f"x{i}", r.normal(size=(n, 5)), f"the tokens of the scenario's sequence {i} ({n}, 5)")
    x1 = hidden.arrays["x1"]
    hidden.add("output7", full_forward(init, weights, x1)[0, 7:8], "the last row of sequence 7 (x1)'s full forward")


# ---------------------------------------------------------------- f04

def f04_flex_attention(ref, public, hidden):
    def case(out, r, shape, document_ids):
        """Inputs only: every variant's expected output is the suite's own dense computation of it."""
        for name in ("q", "k", "v"):
            out.add(name, r.normal(size=shape), f"{name} (b, num_heads, num_tokens, head_dim) = {shape}")
        out.add("document_ids", np.asarray(document_ids, np.int64), "the document of each token")

    case(public, rng(20400), (1, 4, 10, 8), [0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    case(hidden, rng(20410), (2, 6, 12, 4), [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2])


# ---------------------------------------------------------------- f05

def clear_selection_case(stage, cls, init, seed, x=None, shape=None, margin=1e-3):
    """The first seed from ``seed`` on whose inputs and weights give every query a clear top_k (its top_k-th and
    next index scores at least ``margin`` apart, relative to the row's largest): (rng state used, x, weights)."""
    for attempt in range(seed, seed + 1000):
        r = rng(attempt)
        weights = draw_weights(r, stage, cls, init)
        case_x = r.normal(size=shape).astype(np.float32) if x is None else x
        [scores] = stage.session(cls, init, weights, steps=[{"method": "index_scores", "args": [case_x]}])
        rows = [np.sort(row[np.isfinite(row)])[::-1] for row in scores.reshape(-1, scores.shape[-1])]
        k = init["top_k"]
        if all((row[k - 1] - row[k]) > margin * np.abs(row[:k + 1]).max() for row in rows if len(row) > k):
            return case_x, weights
    raise RuntimeError(f"no clear top-k case for {init}")


# b, num_tokens, d_in, d_out, num_heads, index_heads, index_dim, top_k, qkv_bias
# (the sizes of each case pairwise distinct: batch, tokens, d_in, d_out, heads, head_dim, index heads, index_dim)
F05_HIDDEN = [
    (3, 10, 6, 8, 2, 5, 7, 4, True),
    (1, 11, 5, 12, 3, 6, 2, 1, False),  # top_k 1: each query attends to one key
]


def f05_sparse_indexer(ref, public, hidden):
    stage, cls = ref.stage("f05_sparse_indexer"), "SparseAttention"
    r = rng(20500)
    q = public.add("index/queries", r.normal(size=(2, 6, 4, 3)), "indexer queries (b, n_q, index_heads, index_dim)")
    k = public.add("index/keys", r.normal(size=(2, 5, 3)), "indexer keys (b, n_k, index_dim)")
    w = public.add("index/weights", r.normal(size=(2, 6, 4)), "indexer head weights (b, n_q, index_heads)")
    public.add("index/scores", stage.lightning_index_scores(q, k, w), "lightning_index_scores(queries, keys, weights)")

    def case(out, prefix, init, seed, x=None, shape=None):
        x, weights = clear_selection_case(stage, cls, init, seed, x, shape)
        out.add_init(prefix, init)
        x = out.add(f"{prefix}x", x, f"input batch {tuple(x.shape)}")
        weights = out.add_weights(prefix, weights, cls)
        selected, output = stage.session(cls, init, weights, steps=[{"method": "select", "args": [x]},
                                                                   {"method": "forward", "args": [x]}])
        out.add(f"{prefix}selected", selected, "select(x): each query's top_k keys")
        out.add(f"{prefix}output", output, "forward(x): attention over the selected keys")

    # The journey batch: 4 heads of 5 features, an indexer of 7 heads of 8 features, the top 3 keys of each query.
    case(public, "", dict(d_in=3, d_out=20, context_length=6, num_heads=4, index_heads=7, index_dim=8, top_k=3),
         20501, x=BATCH)
    for i, (b, t, d_in, d_out, heads, index_heads, index_dim, top_k, bias) in enumerate(F05_HIDDEN):
        init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=heads, index_heads=index_heads,
                    index_dim=index_dim, top_k=top_k, qkv_bias=bias)
        case(hidden, f"case{i}/", init, 20510 + 100 * i, shape=(b, t, d_in))


# ---------------------------------------------------------------- f06

def delta_rule_inputs(out, r, b, h, t, d_k, d_v, with_state):
    """Stored inputs of the gated delta rule: q, unit keys, v, g = logsigmoid (a few % forgotten per token),
    beta = sigmoid, and an initial state when asked."""
    k = r.normal(size=(b, h, t, d_k))
    inputs = [out.add("q", r.normal(size=(b, h, t, d_k)), f"queries (b, h, T, d_k) = {(b, h, t, d_k)}"),
              out.add("k", k / np.linalg.norm(k, axis=-1, keepdims=True), "keys of unit length (b, h, T, d_k)"),
              out.add("v", r.normal(size=(b, h, t, d_v)), f"values (b, h, T, d_v) = {(b, h, t, d_v)}"),
              out.add("g", -np.log1p(np.exp(-r.normal(3.0, 1.0, size=(b, h, t)))), "log decays g <= 0 (b, h, T)"),
              out.add("beta", 1 / (1 + np.exp(-r.normal(size=(b, h, t)))), "learning rates in (0, 1) (b, h, T)")]
    if with_state:
        inputs.append(out.add("state", r.normal(size=(b, h, d_k, d_v)) * 0.5, "initial state (b, h, d_k, d_v)"))
    return inputs


def f06_gated_delta_rule(ref, public, hidden):
    stage, cls = ref.stage("f06_gated_delta_rule"), "GatedDeltaNet"
    for out, r, sizes, with_state in ((public, rng(20600), (1, 2, 6, 3, 4), False),
                                      (hidden, rng(20610), (2, 3, 20, 4, 5), True)):
        inputs = delta_rule_inputs(out, r, *sizes, with_state)
        result, state = stage.gated_delta_rule_recurrent(*inputs)
        out.add("out", result, "gated_delta_rule_recurrent(q, k, v, g, beta[, state])[0]")
        out.add("state_after", state, "its final state")

    def layer(out, prefix, r, x, **init):
        weights = draw_weights(r, stage, cls, init)
        weights["W_gate.bias"] = weights["W_gate.bias"] + 3.0  # gates near 0.95: a memory of ~20 tokens
        module_case(out, prefix, stage, cls, init, x, weights, cls, f"{cls} forward(x) (recurrent form)")

    layer(public, "layer/", rng(20601), BATCH, d_in=3, d_out=20, num_heads=4)  # (every size different)
    r = rng(20620)
    layer(hidden, "case0/", r, r.normal(size=(2, 9, 5)).astype(np.float32), d_in=5, d_out=12, num_heads=3)
    layer(hidden, "case1/", r, r.normal(size=(1, 9, 7)).astype(np.float32), d_in=7, d_out=8, num_heads=2)


# ---------------------------------------------------------------- f07

def f07_cross_layer_kv(ref, public, hidden):
    stage, cls = ref.stage("f07_cross_layer_kv"), "CrossLayerKVStack"

    def case(out, prefix, r, x, chunks, kv_sources, **init):
        init = dict(init, kv_sources=kv_sources)
        weights = draw_weights(r, stage, cls, init)
        for key, value in init.items():
            if key != "kv_sources":
                out.add(f"{prefix}init/{key}", np.asarray(value), f"constructor argument {key}")
        out.add(f"{prefix}kv_sources", np.asarray(kv_sources, np.int64),
                "constructor argument kv_sources: layer l reads the keys and values of layer kv_sources[l]")
        x = out.add(f"{prefix}x", x, f"input batch {tuple(np.shape(x))}")
        out.add(f"{prefix}chunks", np.asarray(chunks, np.int64), "tokens per forward(use_cache=True) step, in order")
        weights = out.add_weights(prefix, weights, cls)
        out.add(f"{prefix}output", stage.forward(cls, init, x, weights), f"{cls} full causal forward")

    r = rng(20700)
    case(public, "", r, r.normal(size=(2, 6, 15)).astype(np.float32), (3, 1, 1, 1), [0, 0, 2, 2], d_model=15,
         context_length=6, num_heads=3, num_kv_groups=1)  # (every size different)
    r = rng(20710)
    case(hidden, "case0/", r, r.normal(size=(1, 9, 18)).astype(np.float32), (4, 1, 3, 1), [0, 1, 2, 2, 2],
         d_model=18, context_length=10, num_heads=6, num_kv_groups=2)  # Gemma 3n: the last 2 of 5 layers reuse
    case(hidden, "case1/", r, r.normal(size=(2, 8, 15)).astype(np.float32), (2, 2, 1, 3), [0, 1, 1, 1],
         d_model=15, context_length=8, num_heads=3, num_kv_groups=1)  # YOCO: one set for the second half

