"""Stage f05: sparse attention with a lightning indexer (DeepSeek Sparse Attention, DeepSeek-V3.2).

Spec: lightning_index_scores(q_idx (b, n_q, H, D), k_idx (b, n_k, D), w (b, n_q, H)) -> I (b, n_q, n_k),
I[t, s] = sum_j w[t, j] ReLU(q_idx[t, j] . k_idx[s] / sqrt(D)) / sqrt(H). SparseAttention(d_in, d_out,
context_length, num_heads, index_heads, index_dim, top_k, qkv_bias=False): chapter 3's W_query, W_key, W_value,
out_proj; W_index_query (index_heads * index_dim), W_index_key (index_dim), W_index_weights (index_heads), no biases.
index_scores(x): I with -inf above the diagonal; select(x): bool (b, T, T), the top_k keys of each query among
those at or before it (all of them while there are no more than top_k); forward(x): causal attention over the
selected keys only.

A selection is only well defined where a query's top_k-th and (top_k+1)-th index scores differ: every case here
is drawn so that they differ by more than SELECTION_MARGIN (rounding cannot swap them).
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, assert_mask, linear, multihead, softmax, split_heads
from suite_runtime.cases import linear_shapes, mha_shapes, normal, random_weights

pytestmark = pytest.mark.sparse_indexer
STAGE = "f05_sparse_indexer"
CLS = "SparseAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
# Float32 index scores are off by ~1e-7 of their size: a gap of 1e-3 between the last kept and the first dropped
# key's score cannot be closed by rounding, whatever order the sums take.
SELECTION_MARGIN = 1e-3

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
NO_RELU = "the ReLU is missing: each indexer head's dot product is clipped at 0 before the heads are weighted"
UNWEIGHTED = "the indexer heads were summed without their weights: multiply head j's ReLU score by w[t, j]"
NO_HEAD_SCALE = "the index scores were not divided by sqrt(index_heads), the scale of DeepSeek's indexer"
FUTURE_IN_TOP_K = ("the top-k was taken before the future was masked: a query picks its top_k among the keys at or "
                   "before it (index scores of -inf for the others), so the future cannot take places")
NOT_CAUSAL = "the future is selected: a query may only attend to keys at or before it"
SMALLEST = "the keys with the LOWEST index scores were kept: topk keeps the largest (largest=True)"
WRONG_AXIS = "top-k was taken over the queries (dim -2): each QUERY keeps its top_k keys, along the last axis"
DENSE = ("the attention ignores the selection: mask out (-inf) every key select(x) did not choose, so each query "
         "attends to its top_k keys only")


# ---------------------------------------------------------------- NumPy references (float64)

def np_index_scores(q_idx, k_idx, w, *, relu=True, weighted=True, head_scale=True):
    q_idx, k_idx, w = (np.asarray(a, np.float64) for a in (q_idx, k_idx, w))
    dots = np.einsum("bthd,bsd->bths", q_idx, k_idx) / np.sqrt(q_idx.shape[-1])
    if relu:
        dots = np.maximum(dots, 0)
    scores = np.einsum("bth,bths->bts", w if weighted else np.ones_like(w), dots)
    return scores / np.sqrt(q_idx.shape[-2]) if head_scale else scores


def index_mistakes(q_idx, k_idx, w):
    return {NO_RELU: np_index_scores(q_idx, k_idx, w, relu=False),
            UNWEIGHTED: np_index_scores(q_idx, k_idx, w, weighted=False),
            NO_HEAD_SCALE: np_index_scores(q_idx, k_idx, w, head_scale=False)}


def indexer_inputs(x, weights, index_heads):
    """The indexer's queries (b, T, H, D), keys (b, T, D) and head weights (b, T, H) of x."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    q_idx = linear(x, weights, "W_index_query").reshape(b, t, index_heads, -1)
    return q_idx, linear(x, weights, "W_index_key"), linear(x, weights, "W_index_weights")


def np_scores(x, weights, index_heads, causal=True, **mistake):
    scores = np_index_scores(*indexer_inputs(x, weights, index_heads), **mistake)
    t = scores.shape[-1]
    return np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, scores) if causal else scores


def top_k_mask(scores, k, axis=-1, largest=True):
    """True at each row's (axis -1) or column's (axis -2) k best entries."""
    s = scores if axis == -1 else np.swapaxes(scores, -1, -2)
    s = s if largest else np.where(np.isneginf(s), -np.inf, -s)  # (the smallest finite first, -inf still last)
    order = np.argsort(-s, axis=-1, kind="stable")[..., :min(k, s.shape[-1])]
    chosen = np.zeros(s.shape, bool)
    np.put_along_axis(chosen, order, True, axis=-1)
    return chosen if axis == -1 else np.swapaxes(chosen, -1, -2)


def np_select(x, weights, index_heads, top_k, *, order="mask_first", axis=-1, largest=True, **mistake):
    """The selection; order "mask_first" (right), "top_k_first" (future keys take places, then are dropped) or
    "not_causal" (future keys kept)."""
    t = x.shape[1]
    past = ~np.triu(np.ones((t, t), bool), 1)
    if order == "mask_first":
        return top_k_mask(np_scores(x, weights, index_heads, **mistake), top_k, axis, largest) & past
    chosen = top_k_mask(np_scores(x, weights, index_heads, causal=False, **mistake), top_k, axis, largest)
    return chosen & past if order == "top_k_first" else chosen


def np_sparse_attention(x, weights, num_heads, chosen):
    """Multi-head attention over the chosen keys (b, T, T) only."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    q, k, v = (split_heads(linear(x, weights, n), num_heads) for n in ("W_query", "W_key", "W_value"))
    scores = np.where(chosen[:, None], q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -np.inf)
    return linear((softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, t, -1), weights, "out_proj")


def selection_mistakes(x, weights, init):
    run = partial(np_select, x, weights, init["index_heads"], init["top_k"])
    return {NO_RELU: run(relu=False), UNWEIGHTED: run(weighted=False), FUTURE_IN_TOP_K: run(order="top_k_first"),
            NOT_CAUSAL: run(order="not_causal"), SMALLEST: run(largest=False), WRONG_AXIS: run(axis=-2)}


def output_mistakes(x, weights, init):
    t = x.shape[1]
    found = {why: np_sparse_attention(x, weights, init["num_heads"], chosen)
             for why, chosen in selection_mistakes(x, weights, init).items() if chosen.any(-1).all()}
    causal = np.broadcast_to(~np.triu(np.ones((t, t), bool), 1), (x.shape[0], t, t))
    found[DENSE] = np_sparse_attention(x, weights, init["num_heads"], causal)
    return found


def margin(x, weights, index_heads, top_k):
    """The smallest relative gap, over the queries with more than top_k keys, between the top_k-th and the next
    index score (inf when no query has more)."""
    scores = np_scores(x, weights, index_heads)
    gaps = [np.inf]
    for row in scores.reshape(-1, scores.shape[-1]):
        finite = np.sort(row[np.isfinite(row)])[::-1]
        if len(finite) > top_k:
            gaps.append((finite[top_k - 1] - finite[top_k]) / (np.abs(finite[:top_k + 1]).max() + 1e-12))
    return min(gaps)


def sparse_shapes(d_in, d_out, index_heads, index_dim, qkv_bias=False, **_):
    return {**mha_shapes(d_in, d_out, qkv_bias),
            **linear_shapes("W_index_query", d_in, index_heads * index_dim, False),
            **linear_shapes("W_index_key", d_in, index_dim, False),
            **linear_shapes("W_index_weights", d_in, index_heads, False)}


def draw_case(rng, init, b, t):
    """x and weights whose selection is unambiguous (margin above SELECTION_MARGIN), redrawn until it is."""
    for _ in range(200):
        weights = random_weights(rng, sparse_shapes(**init))
        x = normal(rng, b, t, init["d_in"])
        if margin(x, weights, init["index_heads"], init["top_k"]) > SELECTION_MARGIN:
            return x, weights
    raise AssertionError(f"no case with a clear top-{init['top_k']} for {init}")  # (has not happened)


def check_module(stage, init, x, weights, what="", **options):
    """select(x) and forward(x) of the learner's module against the NumPy references."""
    chosen_ref = np_select(x, weights, init["index_heads"], init["top_k"])
    chosen, out = stage.session(CLS, init, weights, steps=[{"method": "select", "args": [x]},
                                                          {"method": "forward", "args": [x]}], **options)
    assert_mask(f"{what}select(x) (True = key s is among query t's top_k)", chosen, chosen_ref,
                mistakes=selection_mistakes(x, weights, init))
    assert_close(f"{what}forward(x)", out, np_sparse_attention(x, weights, init["num_heads"], chosen_ref), **FLOAT32,
                 mistakes=partial(output_mistakes, x, weights, init))


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
def test_index_scores_on_the_example(stage, public_fx):
    """The indexer's scores for the journey batch: 4 indexer heads of 2 features."""
    q_idx, k_idx, w = public_fx["index/queries"], public_fx["index/keys"], public_fx["index/weights"]
    assert_close("lightning_index_scores(index_queries, index_keys, head_weights)",
                 stage.lightning_index_scores(q_idx, k_idx, w), public_fx["index/scores"], **FLOAT32,
                 mistakes=index_mistakes(q_idx, k_idx, w))


@pytest.mark.public
def test_selection_and_output_on_the_example(stage, public_fx):
    """top_k = 3 of the journey's 6 tokens: the first 3 queries see all their keys, the others 3 of them."""
    init, x, weights = public_fx.init(), public_fx.x, public_fx.sub("weights/")
    chosen, out = stage.session(CLS, init, weights, steps=[{"method": "select", "args": [x]},
                                                          {"method": "forward", "args": [x]}])
    assert_mask("select(x)", chosen, public_fx.selected, mistakes=selection_mistakes(x, weights, init))
    assert_close("forward(x)", out, public_fx.output, **FLOAT32, mistakes=partial(output_mistakes, x, weights, init))


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_stored_cases(stage, hidden_fx, case):
    init, x, weights = hidden_fx.init(f"{case}/"), hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    check_module(stage, init, x, weights, f"{init}: ")
    assert_close(f"{init}: forward(x) (stored)", stage.forward(CLS, init, x, weights), hidden_fx[f"{case}/output"],
                 **FLOAT32)


def test_index_scores_match_numpy(stage, rng):
    b, n_q, n_k, h, d = (int(rng.integers(1, 3)), int(rng.integers(1, 8)), int(rng.integers(1, 9)),
                         int(rng.integers(1, 9)), int(rng.integers(1, 9)))
    q_idx, k_idx, w = normal(rng, b, n_q, h, d), normal(rng, b, n_k, d), normal(rng, b, n_q, h)
    assert_close(f"lightning_index_scores of {h} heads of {d} features, {n_q} queries, {n_k} keys",
                 stage.lightning_index_scores(q_idx, k_idx, w), np_index_scores(q_idx, k_idx, w), **FLOAT32,
                 mistakes=index_mistakes(q_idx, k_idx, w))


def test_index_scores_are_causal(stage, rng):
    """index_scores(x) is -inf exactly above the diagonal, the indexer's scores elsewhere."""
    init = dict(d_in=4, d_out=4, context_length=7, num_heads=2, index_heads=3, index_dim=2, top_k=2)
    x, weights = normal(rng, 2, 6, 4), random_weights(rng, sparse_shapes(**init))
    [scores] = stage.session(CLS, init, weights, steps=[{"method": "index_scores", "args": [x]}])
    expected = np_scores(x, weights, 3)
    assert np.shape(scores) == expected.shape and np.array_equal(np.isneginf(scores), np.isneginf(expected)), (
        f"index_scores(x) is -inf at {np.argwhere(np.isneginf(scores)).tolist()}; expected -inf exactly above the "
        "diagonal (the keys after each query), finite scores elsewhere")
    finite = np.isfinite(expected)
    mistakes = {NO_RELU: np_scores(x, weights, 3, relu=False), UNWEIGHTED: np_scores(x, weights, 3, weighted=False),
                NO_HEAD_SCALE: np_scores(x, weights, 3, head_scale=False)}
    assert_close("index_scores(x) at and below the diagonal", np.where(finite, scores, 0),
                 np.where(finite, expected, 0), **FLOAT32,
                 mistakes={why: np.where(finite, s, 0) for why, s in mistakes.items()})


def test_top_k_of_the_whole_length_is_causal_attention(stage, rng):
    """top_k >= T: every key at or before each query is selected, and the output is causal attention."""
    init = dict(d_in=5, d_out=6, context_length=8, num_heads=3, index_heads=2, index_dim=3, top_k=8, qkv_bias=True)
    x, weights = normal(rng, 2, 8, 5), random_weights(rng, sparse_shapes(**init))
    chosen, out = stage.session(CLS, init, weights, steps=[{"method": "select", "args": [x]},
                                                          {"method": "forward", "args": [x]}])
    assert_mask("select(x) with top_k = T", chosen, np.broadcast_to(np.tril(np.ones((8, 8), bool)), (2, 8, 8)),
                mistakes=selection_mistakes(x, weights, init))
    assert_close("forward(x) with top_k = T (causal attention)", out, multihead(x, weights, 3), **FLOAT32)


def test_random_cases(stage, rng, device):
    """Random sizes and top_k, inputs drawn until every selection is clear."""
    for top_k in (1, int(rng.integers(2, 5))):
        num_heads = int(rng.integers(1, 4))
        init = dict(d_in=int(rng.integers(2, 7)), d_out=num_heads * int(rng.integers(1, 4)), context_length=12,
                    num_heads=num_heads, index_heads=int(rng.integers(2, 6)), index_dim=int(rng.integers(2, 6)),
                    top_k=top_k, qkv_bias=bool(rng.integers(2)))
        x, weights = draw_case(rng, init, int(rng.integers(1, 3)), int(rng.integers(top_k + 2, 12)))
        check_module(stage, init, x, weights, f"{init}: ", device=device)


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is DeepSeek-V3.2's indexer (64 heads of 128, top 2048)
    # over 4096 tokens, in front of 16 attention heads of 128
    "cpu": dict(b=1, t=64, d_model=64, num_heads=4, index_heads=8, index_dim=16, top_k=16,
                dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_model=2048, num_heads=16, index_heads=64, index_dim=128, top_k=2048,
                 dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=128, d_model=256, num_heads=16, index_heads=64, index_dim=32, top_k=64,
                    dtypes=("bfloat16",)),
}


def test_deepseek_sized_selection(stage, target):
    """At the model's sizes, in bfloat16 (and float32 in the CPU twin), rounding may swap near-equal index scores, so
    the learner's own selection is judged: it keeps top_k keys per query, in the past, whose float32 index scores are
    the best up to the dtype's rounding; and the output is attention restricted to that selection (computed by the
    test in float32 on the device)."""
    import torch

    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(501)
    d, t, k = size["d_model"], size["t"], size["top_k"]
    init = dict(d_in=d, d_out=d, context_length=t, num_heads=size["num_heads"], index_heads=size["index_heads"],
                index_dim=size["index_dim"], top_k=k)
    weights = {n: (r.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for n, s in sparse_shapes(**init).items()}
    weights["out_proj.bias"] = np.zeros(d, np.float32)
    x = normal(r, size["b"], t, d)
    w = {n: torch.from_numpy(a).to(device) for n, a in weights.items()}
    tx = torch.from_numpy(x).to(device)
    q_idx = (tx @ w["W_index_query.weight"].T).view(size["b"], t, size["index_heads"], -1)
    keys = tx @ w["W_index_key.weight"].T
    dots = torch.relu(torch.einsum("bthd,bsd->bths", q_idx, keys) / size["index_dim"] ** 0.5)
    scores = torch.einsum("bth,bths->bts", tx @ w["W_index_weights.weight"].T, dots) / size["index_heads"] ** 0.5
    future = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    scores = scores.masked_fill(future, -torch.inf)
    kth = scores.topk(k, dim=-1).values[..., -1:]  # each query's k-th best score (-inf while it has fewer keys)
    for dtype in size["dtypes"]:
        chosen, out = stage.session(CLS, init, weights, steps=[{"method": "select", "args": [x]},
                                                              {"method": "forward", "args": [x]}],
                                    device=device, dtype=dtype)
        chosen_t = torch.from_numpy(np.asarray(chosen)).to(device)
        counts = chosen_t.sum(-1)
        expected_counts = torch.clamp(torch.arange(1, t + 1, device=device), max=k).expand_as(counts)
        assert torch.equal(counts, expected_counts) and not (chosen_t & future).any(), (
            f"{device}, {dtype}: select(x) keeps {counts[0, :8].tolist()}... keys for queries 0..7 and "
            f"{int((chosen_t & future).sum())} future keys; expected min(t + 1, top_k) keys per query, none after it")
        # bfloat16 rounds an index score by about 2**-8 of the largest terms it sums: 3e-2 of the row's largest
        # score leaves room for that; float32 by far less.
        slack = (3e-2 if dtype == "bfloat16" else 1e-4) * scores.masked_fill(future, 0).abs().amax(-1, keepdim=True)
        worst = torch.where(chosen_t, scores, torch.inf).amin(-1, keepdim=True)
        best_kept = bool((worst >= kth - slack).all())
        assert best_kept, (
            f"{device}, {dtype}: a query kept a key whose index score is below its top_k-th by more than the dtype's "
            "rounding: select keeps the best top_k index scores of each query")
        q, kk, v = ((tx @ w[f"{n}.weight"].T).view(size["b"], t, size["num_heads"], -1).transpose(1, 2)
                    for n in ("W_query", "W_key", "W_value"))
        attn = (q @ kk.transpose(2, 3) / q.shape[-1] ** 0.5).masked_fill(~chosen_t[:, None], -torch.inf)
        expected = ((torch.softmax(attn, -1) @ v).transpose(1, 2).reshape(size["b"], t, d) @ w["out_proj.weight"].T)
        assert_close(f"{device}, {dtype}: forward(x) over its own selection", out, expected.cpu().numpy(),
                     **TOLERANCE[dtype])
