"""Top-k selection of keys as a mechanism (DeepSeek Sparse Attention's lightning indexer), in NumPy (float64),
written once with its switches: the indexer's scores, which keys each query keeps (its top_k among the keys at or
before it), and attention restricted to them.

``index_scores(q_idx, k_idx, w, choices)``, ``select(scores, top_k, choices)`` and ``sparse(x, weights, num_heads,
chosen, choices)`` are the reference of each step; ``*_switches`` list what a learner chooses there. Probes judge the
learner's own selection (``selection_findings``: keys in the future, how many keys each query keeps, whether they
are the best-scored ones, by the learner's own index scores where those differ from the reference) and the
indexer's scale and clipping (``index_probe_case``/``index_findings``: one call on inputs of the probe's own).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from . import attention as A
from .findings import Finding
from .search import Switch

Choices = Mapping[str, Hashable]
NONE: Choices = {}


def index_scores(q_idx, k_idx, w, choices: Choices = NONE):
    """I[b, t, s] = sum_j w[b, t, j] ReLU(q_idx[b, t, j] . k_idx[b, s] / sqrt(D)) / sqrt(H)."""
    q_idx, k_idx, w = (np.asarray(a, np.float64) for a in (q_idx, k_idx, w))
    heads, dim = q_idx.shape[-2:]
    dots = np.einsum("bthd,bsd->bths", q_idx, k_idx)
    if choices.get("dim_scale") != "missing":
        dots = dots / np.sqrt(dim)
    relu = choices.get("relu")
    if relu is None:
        dots = np.maximum(dots, 0)
    weights = {"missing": np.ones_like(w), "softmax": A.softmax(w)}.get(choices.get("head_weights"), w)
    scores = np.einsum("bth,bths->bts", weights, dots)
    if relu == "after":
        scores = np.maximum(scores, 0)
    head_scale = choices.get("head_scale")
    return scores if head_scale == "missing" else scores / (heads if head_scale == "no_sqrt" else np.sqrt(heads))


def causal(scores):
    t_q, t_k = np.shape(scores)[-2:]
    return np.where(np.triu(np.ones((t_q, t_k), bool), 1), -np.inf, np.asarray(scores, np.float64))


def top_k_mask(scores, k, axis=-1, largest=True):
    """True at each row's (axis -1) or column's (axis -2) k best entries (-inf ones last, also for the smallest)."""
    s = np.asarray(scores, np.float64)
    s = s if axis == -1 else np.swapaxes(s, -1, -2)
    if not largest:
        s = np.where(np.isneginf(s), -np.inf, -s)
    k = max(0, min(k, s.shape[-1]))
    order = np.argsort(-s, axis=-1, kind="stable")[..., :k]
    chosen = np.zeros(s.shape, bool)
    np.put_along_axis(chosen, order, True, axis=-1)
    return chosen if axis == -1 else np.swapaxes(chosen, -1, -2)


def select(scores, top_k: int, choices: Choices = NONE):
    """bool: each query's top_k keys among those at or before it; ``scores`` the indexer's, unmasked (b, T, T)."""
    t = np.shape(scores)[-1]
    past = ~np.triu(np.ones((t, t), bool), 1)
    k = {None: top_k, "plus_one": top_k + 1, "minus_one": top_k - 1}[choices.get("k")]
    axis = -2 if choices.get("axis") == "queries" else -1
    largest = choices.get("largest") != "smallest"
    order = choices.get("order")
    if order is None:
        return top_k_mask(causal(scores), k, axis, largest) & past
    chosen = top_k_mask(scores, k, axis, largest)
    return chosen & past if order == "top_k_first" else chosen


def sparse(x, weights, num_heads: int, chosen, choices: Choices = NONE):
    """Multi-head attention of x (b, T, d_in) over the ``chosen`` keys (b, T, T) only."""
    x = np.asarray(x, np.float64)
    b, t, d_in = x.shape
    if choices.get("selection") == "ignored":
        chosen = np.broadcast_to(~np.triu(np.ones((t, t), bool), 1), (b, t, t))
    bias = choices.get("bias") != "ignored"
    q, k, v = (A.split(A.linear(x, weights, n, bias), num_heads, choices) for n in ("W_query", "W_key", "W_value"))
    d_out = q.shape[1] * q.shape[-1]
    scale = A.scale_of(A.Attention(num_heads=num_heads), q.shape[-1], d_in, d_out, choices)
    s = q @ np.swapaxes(k, -1, -2) * scale
    fill = choices.get("fill")
    allowed = np.asarray(chosen, bool)[:, None]
    if fill == "zero":
        w = A.softmax(np.where(allowed, s, 0.0))
    else:
        w = A.softmax(np.where(allowed, s, -np.inf))
    out = A.merge(w @ v, choices)
    return out if choices.get("out_proj") == "missing" else A.linear(out, weights, "out_proj")


# ---------------------------------------------------------------- the switches

NO_RELU = "the ReLU is missing: each indexer head's dot product is clipped at 0 before the heads are weighted"
UNWEIGHTED = "the indexer heads were summed without their weights: multiply head j's ReLU score by w[t, j]"
NO_HEAD_SCALE = "the index scores were not divided by sqrt(index_heads), the scale of DeepSeek's indexer"
INDEX = [
    Switch("relu", "indexer", {
        "missing": NO_RELU,
        "after": "the ReLU was applied to the weighted sum: clip each head's dot product at 0, then weight and sum"}),
    Switch("head_weights", "indexer", {
        "missing": UNWEIGHTED,
        "softmax": "the head weights were normalised (a softmax) before weighting: head j's ReLU score is multiplied "
                   "by w[t, j] as given"}),
    Switch("head_scale", "indexer", {
        "missing": NO_HEAD_SCALE,
        "no_sqrt": "the index scores were divided by index_heads: divide by sqrt(index_heads)"}),
    Switch("dim_scale", "indexer", {
        "missing": "the indexer's dot products were not divided by sqrt(index_dim) before the ReLU"}),
]
FUTURE_IN_TOP_K = ("the top-k was taken before the future was masked: a query picks its top_k among the keys at or "
                   "before it (index scores of -inf for the others), so the future cannot take places")
NOT_CAUSAL = "the future is selected: a query may only attend to keys at or before it"
SMALLEST = "the keys with the LOWEST index scores were kept: topk keeps the largest (largest=True)"
WRONG_AXIS = "top-k was taken over the queries (dim -2): each QUERY keeps its top_k keys, along the last axis"
SELECT = [
    Switch("order", "top-k selection", {"top_k_first": FUTURE_IN_TOP_K, "not_causal": NOT_CAUSAL}),
    Switch("largest", "top-k selection", {"smallest": SMALLEST}),
    Switch("axis", "top-k selection", {"queries": WRONG_AXIS}),
    Switch("k", "top-k selection", {
        "plus_one": "each query keeps top_k + 1 keys: torch.topk(scores, k=min(top_k, T))",
        "minus_one": "each query keeps top_k - 1 keys: torch.topk(scores, k=min(top_k, T))"}),
]
DENSE = ("the attention ignores the selection: mask out (-inf) every key select(x) did not choose, so each query "
         "attends to its top_k keys only")
SPARSE = [Switch("selection", "top-k selection", {"ignored": DENSE})]


def select_switches(top_k: int) -> list[Switch]:
    return SELECT if top_k > 1 else [*SELECT[:3], SELECT[3].only("plus_one")]


def sparse_switches(d_in: int, d_out: int, num_heads: int, bias: bool) -> list[Switch]:
    head_dim = d_out // num_heads
    found = [*SPARSE, A.scaling_switch(A.Attention(num_heads=num_heads), head_dim, d_in, d_out),
             A.FILL.only("zero"), A.PROJECTIONS["out_proj"]]
    if bias:
        found.append(A.PROJECTIONS["bias"])
    if num_heads > 1:
        found += list(A.HEADS.values())
    return found


# ---------------------------------------------------------------- probes

def selection_findings(chosen, scores, top_k: int, *, own_scores=None, what="your select(x)") -> list[Finding]:
    """What the learner's selection ``chosen`` (b, T, T) shows against the indexer's ``scores`` (b, T, T, unmasked;
    the reference's): keys after a query, how many keys each query keeps, and whether they are its best ones.
    ``own_scores``: the learner's own index_scores(x), when they could be read: a selection that is right for them
    is said to follow them."""
    chosen = np.asarray(chosen, bool)
    scores = np.asarray(scores, np.float64)
    if chosen.shape != scores.shape:
        return []
    b, t, _ = chosen.shape
    past = ~np.triu(np.ones((t, t), bool), 1)
    found = []
    later = chosen & ~past
    if np.any(later):
        _, i, j = (int(v) for v in np.argwhere(later)[0])
        found.append(Finding(f"{what} selects key {j} for query {i}, a later token: the output depends on future "
                             "tokens.", (NOT_CAUSAL,), "top-k selection", "probe", weight=1))
    counts = (chosen & past).sum(axis=-1)
    expected = np.minimum(np.arange(1, t + 1), top_k)
    columns = chosen.sum(axis=-2)
    if np.all(columns == min(top_k, t)) and not np.all(counts == expected):
        found.append(Finding(f"every key of {what} is selected by exactly {min(top_k, t)} queries, while query 0 keeps "
                             f"{int(counts[0, 0])} keys: the top_k was counted per key.", (WRONG_AXIS,),
                             "top-k selection", "probe", weight=2))
        return found
    short = counts < expected
    if np.any(short):
        bb, i = (int(v) for v in np.argwhere(short)[0])
        causes = []
        if own_scores is None or np.array_equal(chosen, select(own_scores, top_k, {"order": "top_k_first"})) or \
                np.array_equal(chosen, select(scores, top_k, {"order": "top_k_first"})):
            causes.append(FUTURE_IN_TOP_K)
        if np.all(counts == np.minimum(np.arange(1, t + 1), top_k - 1)):
            causes = [SELECT[3].wrong["minus_one"]]
        found.append(Finding(f"{what} keeps {_count(counts[bb, i])} for query {i}, which has {_count(i + 1)} at or "
                             f"before it: with top_k = {top_k} it keeps {int(expected[i])}.", tuple(causes) or (
                                 "a query keeps fewer keys than min(top_k, the number of keys at or before it)",),
                             "top-k selection", "probe", weight=2))
    elif np.any(counts > expected):
        bb, i = (int(v) for v in np.argwhere(counts > expected)[0])
        found.append(Finding(f"{what} keeps {_count(counts[bb, i])} for query {i}; with top_k = {top_k} it keeps "
                             f"{int(expected[i])}.", (SELECT[3].wrong["plus_one"],) if np.all(
                                 counts == np.minimum(np.arange(1, t + 1), top_k + 1)) else (
                                 "a query keeps more keys than top_k",), "top-k selection", "probe", weight=2))
    if own_scores is not None and np.shape(own_scores) == scores.shape:
        own = causal(own_scores)
        if np.array_equal(chosen, select(own_scores, top_k)) and not np.allclose(
                np.where(past, own, 0), np.where(past, scores, 0), rtol=1e-4, atol=1e-5):
            found.append(Finding(f"{what} keeps the top_k keys of your own index_scores(x), which differ from the "
                                 "indexer's: the selection follows your index scores (see their check).",
                                 (), "top-k selection", "probe", weight=5))
            return found
    ranked = _ranking(chosen, causal(scores), past)
    if ranked is not None and not found:
        found.append(ranked)
    return found


def _count(n) -> str:
    return f"{int(n)} key" + ("" if n == 1 else "s")


def _ranking(chosen, scores, past):
    """A query that keeps a key scored lower than one it drops (among the keys it may see)."""
    for b, i in np.argwhere((chosen & past).any(axis=-1)):
        row, keep = scores[b, i], chosen[b, i] & past[i]
        drop = ~chosen[b, i] & past[i]
        if not np.any(drop):
            continue
        worst_kept, best_dropped = row[keep].min(), row[drop].max()
        if worst_kept < best_dropped:
            j = int(np.flatnonzero(keep)[np.argmin(row[keep])])
            j2 = int(np.flatnonzero(drop)[np.argmax(row[drop])])
            every = all(chosen[bb, ii][past[ii]].sum() == 0 or scores[bb, ii][chosen[bb, ii] & past[ii]].max()
                        <= scores[bb, ii][~chosen[bb, ii] & past[ii]].min() for bb, ii in np.argwhere(
                            (~chosen & past).any(axis=-1) & (chosen & past).any(axis=-1)))
            return Finding(f"query {int(i)} keeps key {j} (index score {worst_kept:.4g}) and drops key {j2} (index "
                           f"score {best_dropped:.4g}).", (SMALLEST,) if every else (
                               "select keeps the best top_k index scores of each query: torch.topk(..., "
                               "largest=True) along the keys",), "top-k selection", "probe", weight=3)
    return None


def index_probe_case(heads: int = 3, dim: int = 5):
    """Inputs of the probe's own for lightning_index_scores, (q (2, 2, heads, dim), k (2, 2, dim), w (2, 2, heads)):
    in batch row 0, head 0 is weighted 1 (the others 0) and its query's dot product with key 0 is positive, with
    key 1 negative; in batch row 1 every head weight is 0."""
    rng = np.random.default_rng(77)
    q = rng.normal(size=(2, 2, heads, dim)).astype(np.float32)
    k = np.zeros((2, 2, dim), np.float32)
    k[:, 0, 0] = k[:, 1, 1] = 1
    q[0, 0] = 0
    q[0, 0, :, :2] = (0.8, -0.6)  # (every head the same query: weighted or not, key 1's clipped terms are 0)
    w = np.zeros((2, 2, heads), np.float32)
    w[0, :, 0] = 1
    return q, k, w


def index_findings(actual, q, k, w, *, what="your lightning_index_scores") -> list[Finding]:
    """What the learner's scores of ``index_probe_case`` show: the factor of head 0's clipped dot product, the sign
    a negative dot product keeps, and what zero head weights give."""
    actual = np.asarray(actual, np.float64)
    if actual.shape != (2, 2, 2):
        return []
    heads, dim = q.shape[-2:]
    dots = np.einsum("bthd,bsd->bths", np.asarray(q, np.float64), np.asarray(k, np.float64))[0, 0, 0]
    found = []
    if abs(actual[0, 0, 1]) > 1e-6 and dots[1] < 0:
        found.append(Finding(f"with one head weighted 1 and its dot product with key 1 negative ({dots[1]:.3g}), "
                             f"{what} gives key 1 the score {actual[0, 0, 1]:.3g}, not 0: the dot product was not "
                             "clipped at 0.", (NO_RELU,), "indexer", "probe", weight=3))
    if np.any(np.abs(actual[1]) > 1e-6):
        relu = np.maximum(np.einsum("thd,sd->ths", np.asarray(q[1], np.float64), np.asarray(k[1], np.float64))
                          / np.sqrt(dim), 0)
        summed = relu.sum(axis=1) / np.sqrt(heads)
        causes = {UNWEIGHTED: summed, INDEX[1].wrong["softmax"]: summed / heads}
        named = [why for why, values in causes.items() if np.allclose(actual[1], values, rtol=1e-3, atol=1e-6)]
        found.append(Finding(f"with every head weight 0, {what} gives scores like {actual[1, 0, 0]:.3g}, not 0: the "
                             "heads' terms were not multiplied by the weights as given.", tuple(named) or (
                                 "the head weights were left out, or changed before they multiply the heads' terms",),
                             "indexer", "probe", weight=3))
    if dots[0] > 0 and not found:
        factor = actual[0, 0, 0] / dots[0]
        right = 1 / np.sqrt(dim) / np.sqrt(heads)
        if abs(factor / right - 1) > 1e-3:
            names = {"1 / sqrt(index_dim)": 1 / np.sqrt(dim), "1 / sqrt(index_heads)": 1 / np.sqrt(heads),
                     "1": 1.0, "1 / (sqrt(index_dim) * index_heads)": 1 / np.sqrt(dim) / heads}
            named = [n for n, v in names.items() if abs(factor / v - 1) < 1e-3]
            words = {"1 / sqrt(index_dim)": NO_HEAD_SCALE,
                     "1 / sqrt(index_heads)": INDEX[3].wrong["missing"],
                     "1 / (sqrt(index_dim) * index_heads)": INDEX[2].wrong["no_sqrt"]}
            found.append(Finding(f"{what} is {factor:.4g} times the clipped dot product of the one weighted head"
                                 + (f" ({named[0]})" if named else "")
                                 + f"; it must be 1 / (sqrt(index_dim) sqrt(index_heads)) = {right:.4g}.",
                                 (words[named[0]],) if named and named[0] in words else (
                                     "the index scores are scaled by something else than 1 / sqrt(index_dim) and "
                                     "1 / sqrt(index_heads)",), "indexer", "probe", weight=4))
    return found
