"""Attention sinks in NumPy (float64), written once with their switches: gpt-oss's learned sink logits (one logit per
head in the softmax's denominator, mixing no value: a row's weights sum to LESS than 1) and StreamingLLM's sink
tokens (the first num_sink_tokens positions stay visible beside a sliding window, and stay in the cache).

``allowed(spec, query_positions, key_positions, choices)`` is the mask, ``softmax(scores, sinks, choices)`` the
softmax with sinks, ``forward(spec, x, weights, choices, chunks)`` a module's output for a decoding in ``chunks``
(cache eviction included); ``switches`` lists what a learner chooses in each, with ``attention``'s switches that
apply. ``sink_findings`` reads exposed weights (``probes.ExposedWeights``): how much of each row is left to the sink,
and which sink logit that share shows; ``exposure`` makes a module's output its attention weights.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from . import attention as A
from . import caches as C
from .findings import Finding
from .search import Switch, no_effect

Choices = Mapping[str, Hashable]
NONE: Choices = {}


@dataclass(frozen=True)
class Sinks:
    """What a sink attention module computes: heads, key/value groups, a window (None: none) and sink tokens."""

    num_heads: int = 1
    num_kv_groups: int | None = None
    window: int | None = None
    num_sink_tokens: int = 0

    @property
    def groups(self) -> int:
        return self.num_kv_groups or self.num_heads


def allowed(spec: Sinks, query_positions, key_positions, choices: Choices = NONE):
    """bool (n_q, n_k): key j takes part for query i when j <= i and (no window, or j < num_sink_tokens, or
    i - j < window)."""
    causal = A.allowed_keys(A.Attention(causal=True), query_positions, key_positions, choices)
    if spec.window is None:
        return causal
    i, j = np.asarray(query_positions)[:, None], np.asarray(key_positions)[None, :]
    w = spec.window
    band = {None: i - j < w, "plus_one": i - j <= w, "minus_one": i - j < w - 1, "two_sided": abs(i - j) < w,
            "none": np.ones((i.size, j.size), bool)}[choices.get("window")]
    n = spec.num_sink_tokens
    n = {None: n, "plus_one": n + 1, "minus_one": n - 1, "none": 0}[choices.get("sink_tokens")]
    return causal & ((j < n) | band)


def softmax(scores, sinks, choices: Choices = NONE):
    """softmax_with_sinks: exp(s_j - m) / (sum_k exp(s_k - m) + exp(sinks[h] - m)), m the larger of the row's max and
    its head's sink logit; 0 for a row with nothing finite. scores (..., num_heads, n_q, n_k), sinks (num_heads,)."""
    choice = choices.get("sinks")
    wide = choices.get("shift") in ("none", "scores_only")  # float32 as the learner's: an overflow shows
    dtype = np.float32 if wide else np.float64
    s = np.asarray(scores, dtype)
    heads = s.shape[-3]
    z = np.asarray(sinks, dtype).reshape(-1, 1, 1)
    if choice == "ignored":
        z = np.full((heads, 1, 1), -np.inf, dtype)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if choices.get("shift") == "none":
            m = np.zeros_like(s[..., :1])
        elif choices.get("shift") == "scores_only":
            m = s.max(axis=-1, keepdims=True)
        else:
            m = np.maximum(s.max(axis=-1, keepdims=True), z)
        m = np.where(np.isneginf(m), 0, m)
        e = np.exp(s - m)
        sink = np.exp(z) if choice == "unshifted" else np.exp(z - m)
        total = e.sum(axis=-1, keepdims=True) + sink
        if choices.get("empty") == "nan":
            return e / total
        return e / np.where(total == 0, 1, total)


def forward(spec: Sinks, x, weights, choices: Choices = NONE, chunks=None):
    """The module's outputs for ``x`` (b, T, d_in) fed in ``chunks`` (None: one full forward), concatenated; the
    cache keeps, after each step, the first num_sink_tokens positions and the last ``window`` ones."""
    x = np.asarray(x, dtype=np.float64)
    b, t, d_in = x.shape
    h, g = spec.num_heads, spec.groups
    bias = choices.get("bias") != "ignored"
    q = A.split(A.linear(x, weights, "W_query", bias), h, choices)
    k = A.split(A.linear(x, weights, "W_key", bias), g, choices)
    v = A.split(x if choices.get("values") == "inputs" else A.linear(x, weights, "W_value", bias), g, choices)
    if g != h:
        expand = (lambda a: np.tile(a, (1, h // g, 1, 1))) if choices.get("kv_repeat") == "tile" else \
            (lambda a: np.repeat(a, h // g, axis=1))
        k, v = expand(k), expand(v)
    head_dim = q.shape[-1]
    scale = A.scale_of(A.Attention(num_heads=h), head_dim, d_in, weights["W_query.weight"].shape[0], choices)
    sinks = np.asarray(weights["sinks"], np.float64) * (scale if choices.get("sinks") == "scaled" else 1.0)
    kept = np.zeros(0, int)  # the tokens the cache holds
    position = {}  # token -> the position the module gave it (its own, unless its step's offset is another)
    outputs = []
    for step in C.steps(t, chunks, choices):
        a = int(step.queries[0])
        offset = len(kept) if a and choices.get("positions") == "kept_count" else a
        position.update({int(p): offset + i for i, p in enumerate(step.queries)})
        keys = np.asarray([p for p in step.keys if p >= a or p in set(kept.tolist())], int)
        at = np.asarray([position[int(p)] for p in keys], int)
        if spec.window is not None and choices.get("evict") == "early":
            newest = position[int(step.queries[-1])]
            keep = (keys >= a) | (at < spec.num_sink_tokens) | (newest - at < spec.window)
            keys, at = keys[keep], at[keep]
        mask = allowed(spec, np.asarray([position[int(p)] for p in step.queries]), at, choices)
        s = q[:, :, step.queries] @ np.swapaxes(k[:, :, keys], -1, -2) * scale
        if choices.get("scores") == "transposed":
            s = np.swapaxes(s, -1, -2)
        fill = choices.get("fill")
        w = softmax(np.where(mask, s, 0.0 if fill == "zero" else -np.inf) if fill != "after" else s, sinks, choices)
        if fill == "after":
            w = w * mask
        outputs.append(A.merge(w @ v[:, :, keys], choices))
        newest = at[-1]
        if spec.window is None:
            kept = keys
        elif choices.get("evict") == "sinks":
            kept = keys[newest - at < spec.window]
        else:
            kept = keys[(at < spec.num_sink_tokens) | (newest - at < spec.window)]
    out = np.concatenate(outputs, axis=1)
    return out if choices.get("out_proj") == "missing" else A.linear(out, weights, "out_proj")


# ---------------------------------------------------------------- the switches

SINKS_IGNORED = ("the sink logits were left out: softmax_with_sinks adds exp(sinks[h]) to the denominator of every "
                 "row of head h, so the weights sum to less than 1 (the sink mixes no value)")
SINK_SCALED = ("the sink logits were scaled by 1/sqrt(head_dim) with the scores: a sink is a logit of its own, "
               "added to the softmax as it is")
OVERFLOW = ("exp overflowed: subtract the larger of the row's max score and its sink logit before exp (softmax is "
            "unchanged by it, and every exp is then at most 1)")
SINKS = Switch("sinks", "sinks", {
    "ignored": SINKS_IGNORED,
    "unshifted": "the sink's term was not shifted with the scores: the denominator is sum_k exp(s_k - m) + "
                 "exp(sinks[h] - m), the same m subtracted from the sink logit",
})
SCALED = {"scaled": SINK_SCALED}
SHIFT = Switch("shift", "softmax", {
    "none": OVERFLOW,
    "scores_only": "the max subtracted before exp was the scores' alone: a sink logit larger than every score then "
                   "overflows exp(sinks[h] - m); take m = the larger of the row's max score and its sink logit"})
EMPTY = Switch("empty", "softmax", {
    "nan": "a row whose keys are all masked and whose sink is -inf (none) gave 0/0 = NaN: give it weights 0 "
           "(divide by the total only where it is not 0)"})
SINK_TOKENS = Switch("sink_tokens", "sink tokens", {
    "plus_one": "one sink token too many: the sink tokens are positions 0 .. num_sink_tokens - 1 (j < num_sink_tokens)",
    "minus_one": "one sink token too few: the sink tokens are positions 0 .. num_sink_tokens - 1 (j < "
                 "num_sink_tokens)",
    "none": "the sink tokens were not kept: the first num_sink_tokens positions stay visible to every query (and in "
            "the cache) however far the window has moved"})
EVICTED = ("the sink tokens were evicted from the cache: keep the first num_sink_tokens positions for good, besides "
           "the last window")
EVICT = Switch("evict", "KV cache", {
    "sinks": EVICTED,
    "early": "the cache was cut to the window of the step's last query before the step attended: its earlier queries "
             "lost keys inside their own windows; attend to everything cached, then keep what later queries can see"})
WINDOW = Switch("window", "masking", {
    "plus_one": "the window is off by one: key j is inside it when i - j < window (window tokens, the query's own "
                "included)",
    "minus_one": "the window is off by one: key j is inside it when i - j < window (window tokens, the query's own "
                 "included; yours holds window - 1)",
    "none": no_effect("with no window (every earlier token takes part)", "the window", "besides the sink tokens, a "
                      "query sees only its last window positions")})
NOT_CAUSAL = "the mask lets queries see later keys: j <= i must hold as well"
CAUSAL = A.CAUSAL.plus({"none": NOT_CAUSAL})


OFFSET = Switch("positions", "KV cache", {"kept_count": C.FROM_LENGTH})


def kept_positions(spec: Sinks, fed: int) -> np.ndarray:
    """The positions a sink cache holds after ``fed`` tokens: the sink tokens and the last ``window``."""
    p = np.arange(fed)
    return p if spec.window is None else p[(p < spec.num_sink_tokens) | (fed - 1 - p < spec.window)]


def mask_switches(spec: Sinks, cached: bool = False) -> list[Switch]:
    causal = CAUSAL.only("none", "diagonal", "next")
    found = [causal.plus(A.CACHED_ROWS) if cached else causal]
    if spec.window is not None:
        found.append(WINDOW)
        if spec.num_sink_tokens:
            found.append(SINK_TOKENS)
        else:
            found.append(SINK_TOKENS.only("plus_one"))
    return found


def softmax_switches() -> list[Switch]:
    return [SINKS, SHIFT, EMPTY]


def switches(spec: Sinks, d_in: int, d_out: int, chunks=None, *, bias: bool) -> list[Switch]:
    """The choices of a sink attention module that a case of these sizes (and a decoding in ``chunks``) can show."""
    head_dim = d_out // spec.num_heads
    kv_width = spec.groups * head_dim
    cached = bool(chunks and len(chunks) > 1)
    found = [A.scaling_switch(A.Attention(), head_dim, d_in, d_out), SINKS.plus(SCALED), *mask_switches(spec, cached),
             A.FILL, A.PROJECTIONS["out_proj"]]
    if bias:
        found.append(A.PROJECTIONS["bias"])
    if d_in == kv_width:
        found.append(A.PROJECTIONS["values"].only("inputs"))
    if spec.num_heads > 1:
        found += list(A.HEADS.values())
    if spec.groups not in (1, spec.num_heads):
        found.append(A.KV_REPEAT)
    if cached:
        found += C.switches(chunks, rotary=False)
        if spec.window is not None:
            found.append(EVICT if spec.num_sink_tokens else EVICT.only("early"))
            found.append(OFFSET)
    return found


# ---------------------------------------------------------------- the weights, exposed

def exposure(spec: Sinks, num_tokens: int, sinks):
    """(init sizes, x, weights, read): one-hot tokens whose values are those one-hot vectors, out_proj the identity,
    the given sink logits: the output is each head's attention weights."""
    t, h, g = num_tokens, spec.num_heads, spec.groups
    head_dim, d_in = t, t + 2
    d_out, kv = h * head_dim, g * head_dim
    rng = np.random.default_rng(2026)
    x = np.zeros((2, t, d_in), np.float32)
    x[:, np.arange(t), np.arange(t)] = 1
    values = np.zeros((kv, d_in), np.float32)
    for group in range(g):
        values[group * head_dim + np.arange(t), np.arange(t)] = 1
    weights = {"W_query.weight": rng.normal(0, 0.9, (d_out, d_in)).astype(np.float32),
               "W_key.weight": rng.normal(0, 0.9, (kv, d_in)).astype(np.float32),
               "W_value.weight": values,
               "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32),
               "sinks": np.asarray(sinks, np.float32)}
    sizes = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=h, num_kv_groups=g, window=spec.window,
                 num_sink_tokens=spec.num_sink_tokens)

    def read(out):
        out = np.asarray(out)
        return out.reshape(out.shape[0], t, h, head_dim).transpose(0, 2, 1, 3)

    return sizes, x, weights, read


def sink_findings(observed, scores, mask, scale, sinks, *, what="your attention weights") -> list[Finding]:
    """What the share of each row left to the sink shows: ``observed`` (b, heads, n_q, n_k) weights of the raw
    ``scores`` (same shape) under ``mask``, ``sinks`` (heads,) the logits given. A row that must leave
    exp(sinks[h] - m) / total to the sink leaves exp(z - m) / total for the z it shows: z = log(sink share) +
    logsumexp of the row's scaled scores - log(the row's sum)."""
    observed = np.asarray(observed, np.float64)
    s = np.asarray(scores, np.float64) * scale
    mask = np.broadcast_to(mask, observed.shape)
    rows = np.all(np.isfinite(observed), axis=-1) & np.any(mask, axis=-1)
    if not np.any(rows):
        return []
    total = observed.sum(axis=-1)
    share = 1 - total
    sinks = np.asarray(sinks, np.float64)
    if np.all(np.abs(share[rows]) < 1e-5):
        return [Finding(f"every row of {what} sums to 1: no attention is left for the sink, though its logit "
                        f"(sinks[h], here {', '.join(f'{z:.3g}' for z in sinks)}) joins each row's denominator.",
                        (SINKS_IGNORED,), "sinks", "probe", weight=3)]
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(np.sum(np.where(mask, np.exp(s - s.max(axis=-1, keepdims=True)), 0), axis=-1)) + \
            s.max(axis=-1)
        shown = np.log(share) + lse - np.log(total)
    heads = observed.shape[1]
    per_head = [np.nanmedian(shown[:, h][rows[:, h]]) if np.any(rows[:, h]) else np.nan for h in range(heads)]
    if all(abs(z - e) < 1e-3 * max(1, abs(e)) for z, e in zip(per_head, sinks) if np.isfinite(z)):
        return []
    said = ", ".join(f"{z:.4g}" for z in per_head)
    expected = ", ".join(f"{z:.4g}" for z in sinks)
    shows = (f"the share of each row that {what} leave to the sink is that of a sink logit {said} (per head); the "
             f"sinks given are {expected}")
    if all(abs(z - e * scale) < 1e-3 * max(1, abs(e)) for z, e in zip(per_head, sinks) if np.isfinite(z)):
        return [Finding(shows + f": they were multiplied by the scores' scale {scale:.4g}.", (SINK_SCALED,), "sinks",
                        "probe", weight=3)]
    finite = [z for z in per_head if np.isfinite(z)]
    if len(sinks) > 1 and len(finite) == len(sinks) and np.ptp(finite) < 1e-3 * max(1, abs(finite[0])):
        which = "their mean" if abs(finite[0] - np.mean(sinks)) < 1e-3 * max(1, abs(finite[0])) else (
            f"sinks[{int(np.argmin(np.abs(sinks - finite[0])))}]"
            if np.min(np.abs(sinks - finite[0])) < 1e-3 * max(1, abs(finite[0])) else "one value")
        return [Finding(shows + f": every head shows the same one, {which}.", (
            "one sink logit was used for every head: head h's rows take sinks[h] (view sinks as (num_heads, 1, 1) "
            "against scores (b, num_heads, n_q, n_k))",), "sinks", "probe", weight=3)]
    return [Finding(shows + ".", ("the sink's term in the denominator is not exp(sinks[h] - m) with the same m as "
                                  "the scores' terms",), "sinks", "probe", weight=4)]


def mask_findings(mask, query_positions, key_positions, spec: Sinks, *, what="your mask") -> list[Finding]:
    """What a learner's mask (n_q, n_k; True = takes part) shows of the rule j <= i and (j < num_sink_tokens or
    i - j < window): keys after a query, a query's own position, the window's true width, the sink tokens' count."""
    mask = np.asarray(mask) > 0.5
    i, j = np.asarray(query_positions)[:, None], np.asarray(key_positions)[None, :]
    found = []
    later = mask & (j > i)
    if np.any(later):
        a, b = (int(v) for v in np.argwhere(later)[0])
        found.append(Finding(f"query {int(i[a, 0])} sees key {int(j[0, b])}, a later position: the output depends on "
                             "future tokens.", (NOT_CAUSAL,), "masking", "probe", weight=1))
    own = (j == i)
    if np.any(own) and not np.any(mask & own):
        found.append(Finding(f"no query sees its own position ({what} is False where j == i).",
                             (A.CAUSAL.wrong["diagonal"],), "masking", "probe", weight=2))
    if spec.window is None:
        return found
    w, n = spec.window, spec.num_sink_tokens
    back = i - j
    banded = mask & (back >= 0) & (j >= n)
    reach = np.where(banded, back + 1, 0).max(axis=-1)
    full = i[:, 0] >= w + n
    if np.any(full):
        measured = sorted({int(r) for r in reach[full]})
        if measured != [w]:
            found.append(Finding(
                f"the queries at positions {w + n} and later see the last {' or '.join(map(str, measured))} positions "
                f"(themselves included) besides the sink tokens, not window={w}.",
                (WINDOW.wrong["plus_one"] if measured == [w + 1] else WINDOW.wrong["minus_one"] if measured == [w - 1]
                 else "the window's width is not the window argument: key j is in it when 0 <= i - j < window",),
                "masking", "probe", weight=3))
    far = i[:, 0] - w + 1 > n + 1  # queries whose window starts after the sink tokens and one more position
    if np.any(far):
        outside = mask & (back >= w) & (back >= 0)
        kpos = np.asarray(key_positions)
        counts = sorted({int(row.sum()) for row in outside[far]})
        starts = all(np.array_equal(kpos[row], np.arange(row.sum())) for row in outside[far])
        if starts and counts != [n] and len(counts) == 1:
            m = counts[0]
            words = {n + 1: SINK_TOKENS.wrong["plus_one"], n - 1: SINK_TOKENS.wrong["minus_one"],
                     0: SINK_TOKENS.wrong["none"]}
            found.append(Finding(
                f"queries far past the start see the first {m} positions outside their window; num_sink_tokens={n}.",
                (words.get(m, "the sink tokens are positions 0 .. num_sink_tokens - 1: j < num_sink_tokens"),),
                "sink tokens", "probe", weight=3))
    return found
