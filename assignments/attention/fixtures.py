"""The fixtures of chapter 3's stages (``attnkit fixtures`` writes them, grader.authoring.fixtures).

One generator per stage module, ``s03_context_vectors(ref, public, hidden)``: it fills the two ``Arrays`` it is
given (``public/<stage>.npz`` ships to students, ``hidden/`` never does) from the reference implementation ``ref``.
The public ones hold the book's running example (the journey inputs, the book's seeded weights, the printed
outputs); the hidden ones other shapes and weights, from NumPy's PCG64 generator with fixed seeds (the same
numbers on every platform). ``NO_FIXTURE`` says why a stage has none.
"""
import numpy as np
import torch

from grader.authoring.fixtures import module_case, rng, seeded_weights
from grader.kit import assignment
from suite_runtime.cases import mha_shapes, qkv_shapes, random_weights

example = assignment("attention").module("book")  # the book's running example
BATCH, JOURNEY, HEADS_EXAMPLE = example.BATCH, example.JOURNEY, example.HEADS_EXAMPLE
BOOK_SEED_V1, BOOK_SEED_V2, BOOK_SEED_MODULES = example.BOOK_SEED_V1, example.BOOK_SEED_V2, example.BOOK_SEED_MODULES
NO_FIXTURE = {"s07_dropout": "dropout is tested by its properties; stored masks would differ across platforms"}


def s01_attention_scores(ref, public, hidden):
    s = ref.stage("s01_attention_scores")
    inputs = public.add("inputs", JOURNEY, "embeddings of 'Your journey starts with one step' (6, 3)")
    query = public.add("query", JOURNEY[1], "the query: the embedding of 'journey', inputs[1]")
    public.add("attn_scores_2", s.attention_scores_matmul(inputs, query), "dot product of every token with the query")
    for i, (t, d) in enumerate([(9, 5), (4, 3)]):
        r = rng(100 + i)
        x = hidden.add(f"case{i}/inputs", r.normal(size=(t, d)), f"random inputs ({t}, {d})")
        q = hidden.add(f"case{i}/query", r.normal(size=d), "a random query that is not one of the inputs")
        hidden.add(f"case{i}/scores", s.attention_scores_matmul(x, q), "expected scores")


def s02_normalization(ref, public, hidden):
    s = ref.stage("s02_normalization")
    scores = public.add("attn_scores_2", JOURNEY @ JOURNEY[1], "scores of the query 'journey' (stage 1)")
    public.add("weights_by_sum", s.normalize_by_sum(scores), "scores divided by their sum")
    public.add("weights_softmax", s.softmax_torch(scores), "softmax of the scores")
    public.add("inputs", JOURNEY, "the journey embeddings (6, 3)")
    public.add("attn_scores", s.all_pairs_scores(JOURNEY), "all-pairs scores inputs @ inputs.T (6, 6)")
    public.add("attn_weights", s.all_pairs_weights(JOURNEY), "row-wise softmax of the all-pairs scores")
    r = rng(200)
    scores = hidden.add("scores", r.uniform(0.1, 3.0, size=7), "random positive scores (7,)")
    hidden.add("weights_by_sum", s.normalize_by_sum(scores), "scores divided by their sum")
    hidden.add("weights_softmax", s.softmax_torch(scores), "softmax of the scores")
    matrix = hidden.add("matrix", r.normal(size=(4, 5)) * 3, "random (4, 5) scores, softmax over each row")
    hidden.add("matrix_softmax", s.softmax_torch(matrix), "row-wise softmax")
    large = hidden.add("large", r.normal(size=(3, 5)) * 1000 + 100, "scores around 100 scaled by 1000 (exp overflows)")
    hidden.add("large_softmax", s.softmax_torch(large), "row-wise softmax, computed stably")
    x = hidden.add("inputs", r.normal(size=(8, 4)), "random inputs (8, 4)")
    hidden.add("attn_scores", s.all_pairs_scores(x), "all-pairs scores")
    hidden.add("attn_weights", s.all_pairs_weights(x), "row-wise softmax of the all-pairs scores")


def s03_context_vectors(ref, public, hidden):
    s = ref.stage("s03_context_vectors")
    weights = ref.stage("s02_normalization").all_pairs_weights(JOURNEY)
    public.add("inputs", JOURNEY, "the journey embeddings (6, 3)")
    public.add("attn_weights_2", weights[1], "softmax weights of the query 'journey'")
    public.add("context_vec_2", s.context_vector(weights[1], JOURNEY), "context vector of 'journey'")
    public.add("attn_weights", weights, "all-pairs softmax weights (6, 6)")
    public.add("all_context_vecs", s.all_context_vectors(weights, JOURNEY), "every token's context vector (6, 3)")
    r = rng(300)
    x = hidden.add("inputs", r.normal(size=(7, 5)), "random inputs (7, 5)")
    w = hidden.add("attn_weights", r.dirichlet(np.ones(7), size=7), "random rows that sum to 1 (7, 7)")
    hidden.add("context_vec_3", s.context_vector(w[3], x), "context vector of token 3")
    hidden.add("all_context_vecs", s.all_context_vectors(w, x), "all context vectors (7, 5)")


def s04_trainable_projections(ref, public, hidden):
    s = ref.stage("s04_trainable_projections")

    def case(out, prefix, inputs, W_q, W_k, W_v, query_index):
        x_q = out.add(f"{prefix}x_query", inputs[query_index], f"the query token, inputs[{query_index}]")
        W_q, W_k, W_v = (out.add(f"{prefix}{n}", w, f"{n} matrix (d_in, d_out)")
                         for n, w in (("W_query", W_q), ("W_key", W_k), ("W_value", W_v)))
        query = out.add(f"{prefix}query", s.project(x_q, W_q), "the query vector x_query @ W_query")
        keys = out.add(f"{prefix}keys", s.project(inputs, W_k), "keys inputs @ W_key")
        values = out.add(f"{prefix}values", s.project(inputs, W_v), "values inputs @ W_value")
        scores = out.add(f"{prefix}attn_scores", s.scores_for_query(query, keys), "unscaled scores of the query")
        weights = out.add(f"{prefix}attn_weights", s.scaled_weights(scores, keys.shape[-1]),
                          "softmax(scores / sqrt(d_k))")
        out.add(f"{prefix}context_vec", s.context_for_query(weights, values), "weighted sum of the values")

    public.add("inputs", JOURNEY, "the journey embeddings (6, 3)")
    torch.manual_seed(BOOK_SEED_V1)  # the book draws W_query, W_key, W_value in this order
    book = [torch.rand(3, 2).numpy() for _ in range(3)]
    case(public, "", JOURNEY, *book, query_index=1)
    r = rng(400)
    x = hidden.add("inputs", r.normal(size=(7, 5)), "random inputs (7, 5)")
    case(hidden, "", x, *random_weights(r, {n: (5, 4) for n in ("W_q", "W_k", "W_v")}, bound=1.0).values(),
         query_index=4)


def s05_self_attention(ref, public, hidden):
    s = ref.stage("s05_self_attention")
    public.add("inputs", JOURNEY, "the journey embeddings (6, 3)")
    v1 = public.add_weights("v1/", seeded_weights("s05_self_attention", "SelfAttention_v1", BOOK_SEED_V1, 3, 2),
                            "SelfAttention_v1(3, 2) after torch.manual_seed(123)")
    public.add("v1/output", s.forward("SelfAttention_v1", dict(d_in=3, d_out=2), JOURNEY, v1),
               "SelfAttention_v1 output")
    v2 = public.add_weights("v2/", seeded_weights("s05_self_attention", "SelfAttention_v2", BOOK_SEED_V2, 3, 2),
                            "SelfAttention_v2(3, 2) after torch.manual_seed(789)")
    public.add("v2/output", s.forward("SelfAttention_v2", dict(d_in=3, d_out=2), JOURNEY, v2),
               "SelfAttention_v2 output")
    r = rng(500)
    x = hidden.add("inputs", r.normal(size=(7, 5)), "random inputs (7, 5)")
    v1 = hidden.add_weights("v1/", random_weights(r, {n: (5, 3) for n in ("W_query", "W_key", "W_value")}, bound=1.0),
                            "SelfAttention_v1(5, 3)")
    hidden.add("v1/output", s.forward("SelfAttention_v1", dict(d_in=5, d_out=3), x, v1), "SelfAttention_v1 output")
    v2 = hidden.add_weights("v2/", random_weights(r, qkv_shapes(5, 3, bias=True)),
                            "SelfAttention_v2(5, 3, qkv_bias=True)")
    hidden.add("v2/output", s.forward("SelfAttention_v2", dict(d_in=5, d_out=3, qkv_bias=True), x, v2),
               "SelfAttention_v2 output with biases")


def s06_causal_mask(ref, public, hidden):
    s = ref.stage("s06_causal_mask")
    v2 = seeded_weights("s05_self_attention", "SelfAttention_v2", BOOK_SEED_V2, 3, 2)
    queries, keys = JOURNEY @ v2["W_query.weight"].T, JOURNEY @ v2["W_key.weight"].T
    scores = public.add("attn_scores", queries @ keys.T, "queries @ keys.T of SelfAttention_v2 at seed 789 (6, 6)")
    public.add("d_k", np.asarray(2), "key dimension")
    public.add("attn_weights", ref.stage("s02_normalization").softmax_torch(scores / np.sqrt(2)),
               "unmasked weights softmax(scores / sqrt(d_k))")
    public.add("masked_weights", s.causal_weights_efficient(scores, 2), "causally masked weights, rows sum to 1")
    r = rng(600)
    scores = hidden.add("attn_scores", r.normal(size=(3, 5, 5)) * 2, "a batch of random scores (3, 5, 5)")
    hidden.add("d_k", np.asarray(4), "key dimension")
    hidden.add("attn_weights", ref.stage("s02_normalization").softmax_torch(scores / 2), "unmasked weights")
    hidden.add("masked_weights", s.causal_weights_efficient(scores, 4), "causally masked weights")


def s08_causal_attention(ref, public, hidden):
    s = ref.stage("s08_causal_attention")
    init = dict(d_in=3, d_out=2, context_length=6, dropout=0.0)
    book = seeded_weights("s08_causal_attention", "CausalAttention", BOOK_SEED_MODULES, **init)
    module_case(public, "", s, "CausalAttention", init, BATCH, book, "CausalAttention(3, 2, 6, 0.0) at seed 123")
    for i, (b, t, d_in, d_out, ctx, bias) in enumerate([(3, 6, 5, 4, 8, False), (2, 4, 5, 3, 4, True)]):
        r = rng(800 + i)
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, dropout=0.0, qkv_bias=bias)
        module_case(hidden, f"case{i}/", s, "CausalAttention", init, r.normal(size=(b, t, d_in)),
                    random_weights(r, qkv_shapes(d_in, d_out, bias)), "CausalAttention")


def s09_multihead_wrapper(ref, public, hidden):
    s = ref.stage("s09_multihead_wrapper")
    init = dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
    book = seeded_weights("s09_multihead_wrapper", "MultiHeadAttentionWrapper", BOOK_SEED_MODULES, **init)
    module_case(public, "", s, "MultiHeadAttentionWrapper", init, BATCH, book, "wrapper with 2 heads at seed 123")
    r = rng(900)
    init = dict(d_in=5, d_out=2, context_length=8, dropout=0.0, num_heads=3, qkv_bias=True)
    shapes = {}
    for h in range(3):
        shapes.update(qkv_shapes(5, 2, True, prefix=f"heads.{h}."))
    weights = random_weights(r, shapes)
    module_case(hidden, "case0/", s, "MultiHeadAttentionWrapper", init, r.normal(size=(2, 6, 5)), weights, "wrapper")


MHA_HIDDEN = [  # b, num_tokens, d_in, d_out, context_length, num_heads, qkv_bias
    (2, 7, 6, 12, 10, 3, True),
    (3, 6, 7, 8, 6, 4, False),
]


def s10_multihead_attention(ref, public, hidden):
    s = ref.stage("s10_multihead_attention")
    init = dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
    book = seeded_weights("s10_multihead_attention", "MultiHeadAttention", BOOK_SEED_MODULES, **init)
    module_case(public, "", s, "MultiHeadAttention", init, BATCH, book,
                "MultiHeadAttention(3, 2, 6, 0.0, 2) at seed 123")
    a = public.add("a", HEADS_EXAMPLE, "example (b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4) tensor")
    public.add("a_scores", s.batched_head_scores(a), "a @ a.transpose(2, 3)")
    for i, (b, t, d_in, d_out, ctx, heads, bias) in enumerate(MHA_HIDDEN):
        r = rng(1000 + i)
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, dropout=0.0, num_heads=heads, qkv_bias=bias)
        module_case(hidden, f"case{i}/", s, "MultiHeadAttention", init, r.normal(size=(b, t, d_in)),
                    random_weights(r, mha_shapes(d_in, d_out, bias)), "MultiHeadAttention")
    a = hidden.add("a", r.normal(size=(2, 3, 5, 4)), "random (2, 3, 5, 4) heads tensor")
    hidden.add("a_scores", s.batched_head_scores(a), "a @ a.transpose(2, 3)")


def s11_other_forms(ref, public, hidden):
    s = ref.stage("s11_other_forms")
    mha = ref.stage("s10_multihead_attention")

    def case(out, prefix, init, x, weights):
        out.add_init(prefix, init)
        x = out.add(f"{prefix}x", x, "input batch")
        weights = out.add_weights(prefix + "mha/", weights, "MultiHeadAttention")
        out.add(f"{prefix}output", mha.forward("MultiHeadAttention", init, x, weights), "MultiHeadAttention output")
        out.add_weights(prefix + "combined/", s.combined_qkv_state_dict(weights), "MultiHeadAttentionCombinedQKV")
        out.add_weights(prefix + "per_head/", s.per_head_state_dict(weights, init["num_heads"]),
                        "MultiHeadAttentionPerHead")

    init = dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)
    book = seeded_weights("s10_multihead_attention", "MultiHeadAttention", BOOK_SEED_MODULES, **init)
    case(public, "", init, BATCH, book)
    for i, (b, t, d_in, d_out, ctx, heads, bias) in enumerate(MHA_HIDDEN):
        r = rng(1100 + i)
        init = dict(d_in=d_in, d_out=d_out, context_length=ctx, dropout=0.0, num_heads=heads, qkv_bias=bias)
        case(hidden, f"case{i}/", init, r.normal(size=(b, t, d_in)), random_weights(r, mha_shapes(d_in, d_out, bias)))
