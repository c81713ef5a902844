"""Attention in NumPy (float64), written once with its switches: the expected values of the stages that compute
attention, and the searched mistakes of every stage where a mechanism appears.

``Attention`` describes what a stage's module computes (its heads, key/value groups, mask, window, rotary
positions, output projection); ``forward`` computes it from a state_dict with the documented names (W_query,
W_key, W_value, out_proj), and ``attention_weights`` the weights of given scores. Each reads its ``choices``: a
choice not made keeps its right value, so ``forward(spec, x, weights)`` is the reference and ``forward(spec, x,
weights, {"scale": "d_out"})`` what a module that scales by sqrt(d_out) gives. ``switches(spec, ...)`` lists the
choices a learner makes in that computation, each wrong value with its words: the diagnoser searches them
(``diagnosis.search``) in every stage whose computation has them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .search import Switch, no_effect

Choices = Mapping[str, Any]
NONE: Mapping[str, Any] = {}


@dataclass(frozen=True)
class Attention:
    """What an attention module computes. ``head_name``: what the stage calls the width of one head's keys in
    its words (``d_k`` in chapter 3's single-head stages, ``head_dim`` elsewhere)."""

    num_heads: int = 1
    num_kv_groups: int | None = None  # key/value heads (grouped-query attention); None: num_heads
    causal: bool = True
    window: int | None = None  # a sliding window: key j takes part for query i when 0 <= i - j < window
    rope_theta: float | None = None  # rotary positions on queries and keys (Llama's halves layout)
    out_proj: bool = True
    head_name: str = "head_dim"
    # What a query with no key to attend to gets: "nan" (torch.softmax of a row of -inf) or "zero" (weights 0, as
    # F.scaled_dot_product_attention and a padding-aware module give it).
    empty_rows: str = "nan"

    @property
    def groups(self) -> int:
        return self.num_kv_groups or self.num_heads

    def with_heads(self, num_heads: int) -> Attention:
        return replace(self, num_heads=num_heads, num_kv_groups=None if self.num_kv_groups is None else
                       min(self.num_kv_groups, num_heads))


# ---------------------------------------------------------------- the pieces

def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # a row of -inf everywhere gives NaN, as torch.softmax does
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)


def linear(x, weights, name, bias=True):
    out = np.asarray(x, dtype=np.float64) @ np.asarray(weights[f"{name}.weight"], dtype=np.float64).T
    b = weights.get(f"{name}.bias") if bias else None
    return out if b is None else out + b


def rope(x, positions, theta, choice=None):
    """x (..., T, head_dim) rotated at ``positions`` (T,), Llama's halves layout; ``choice`` a rotary mistake."""
    d = x.shape[-1]
    if choice == "theta":  # the frequencies of the default theta_base, whatever the module was given
        theta, choice = 10_000.0, None
    inv = float(theta) ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if choice == "frequency":
        inv = float(theta) ** (-np.arange(0, d // 2, dtype=np.float64) / d)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv
    halves = np.concatenate([freqs, freqs], axis=-1)
    interleaved = np.repeat(freqs, 2, axis=-1)
    angles = interleaved if choice in ("interleaved", "angles_interleaved") else halves
    if choice == "sign":
        angles = -angles
    if choice in ("interleaved", "pairs_interleaved"):
        rotated = np.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
    else:
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _unstable(x, axis=-1):
    """softmax without subtracting the max first, in float32 as torch computes it: exp overflows to inf for scores
    above about 88, and inf / inf is NaN."""
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(np.asarray(x, dtype=np.float32))
        return (e / e.sum(axis=axis, keepdims=True)).astype(np.float64)


def _whole_sum(x, axis=-1):
    """exp(x - max per row) divided by the sum over the whole tensor."""
    with np.errstate(invalid="ignore"):
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / e.sum()


def _flat(x, axis=-1):
    """One softmax over every entry of the tensor."""
    return softmax(np.asarray(x).reshape(-1)).reshape(np.shape(x))


def _sum_normalised(x, axis=-1):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(x, dtype=np.float64) / np.sum(x, axis=axis, keepdims=True)


def _global_max(x, axis=-1):
    """exp(x - the max of the whole tensor), in float32 as torch computes it, divided by each row's sum."""
    with np.errstate(under="ignore", invalid="ignore"):
        e = np.exp((np.asarray(x, dtype=np.float64) - np.max(x)).astype(np.float32)).astype(np.float64)
        return e / e.sum(axis=axis, keepdims=True)


BY_HAND = {"unstable": _unstable, "whole_sum": _whole_sum, "flat": _flat, "sum": _sum_normalised,
           "global_max": _global_max}


def allowed_keys(spec: Attention, query_positions, key_positions, choices: Choices = NONE):
    """Boolean (n_queries, n_keys): which keys each query may attend to, by the tokens' positions."""
    i = np.asarray(query_positions)[:, None]
    j = np.asarray(key_positions)[None, :]
    causal = choices.get("causal")
    inverted = causal in ("inverted", "inverted_nan")  # the whole mask read with the opposite convention
    if causal == "top_left":  # a cached step's queries (and its keys) counted from 0, as if they came first
        i, j = i - i.min(), j - j.min()
    allowed = np.ones((i.shape[0], j.shape[1]), bool)
    if spec.causal:
        allowed = {None: j <= i, "top_left": j <= i, "none": allowed, "diagonal": j < i, "next": j <= i + 1,
                   "past": j >= i}.get(causal, j <= i)  # (inverted: the whole mask, below)
    elif causal == "added":  # a causal mask where the attention is not causal
        allowed = j <= i
    if spec.window is not None:
        w = spec.window
        # rows: the band's lower bound counted by row and column index (the new tokens' rows from 0, the keys by
        # their place in the cache), the causal bound by position: the same as the band without a cache.
        rows, keys = np.arange(i.shape[0])[:, None], np.arange(j.shape[1])[None, :]
        band = {None: i - j < w, "plus_one": i - j <= w, "minus_one": i - j < w - 1, "two_sided": abs(i - j) < w,
                "none": np.ones_like(allowed), "rows": rows - keys < w}[choices.get("window")]
        allowed = allowed & band
    return ~allowed if inverted else allowed


def scale_of(spec: Attention, head_dim: int, d_in: int, d_out: int, choices: Choices = NONE) -> float:
    """What the scores are multiplied by before the softmax."""
    return {None: 1 / np.sqrt(head_dim), "none": 1.0, "times": np.sqrt(head_dim), "no_sqrt": 1 / head_dim,
            "d_out": 1 / np.sqrt(d_out), "d_in": 1 / np.sqrt(d_in), "twice": 1 / head_dim,
            "num_heads": 1 / np.sqrt(spec.num_heads), "after_softmax": 1 / np.sqrt(head_dim)}[choices.get("scale")]


def attention_weights(scores, allowed, scale: float, choices: Choices = NONE, empty_rows="nan"):
    """softmax(scores * scale) over the keys each query may attend to. ``empty_rows``: what a query with no key
    gets ("nan" as torch.softmax of a row of -inf gives, or "zero" as F.scaled_dot_product_attention gives)."""
    after = choices.get("scale") == "after_softmax"  # (the weights scaled, not the scores)
    s = np.asarray(scores, dtype=np.float64) * (1.0 if after else scale)
    if choices.get("scores") == "transposed":
        s = np.swapaxes(s, -1, -2)
    axis = -2 if choices.get("softmax") == "queries" else -1
    normalise = BY_HAND.get(str(choices.get("by_hand")), softmax)
    fill = choices.get("fill")
    empty_rows = {"nan": "nan", "uniform": "uniform"}.get(choices.get("empty"), empty_rows)
    if choices.get("causal") == "inverted_nan":  # (a row the inverted mask leaves empty: NaN, as some kernels give)
        empty_rows = "nan"
    if fill == "zero":
        w = normalise(np.where(allowed, s, 0.0), axis)
    elif fill == "after":
        w = normalise(s, axis) * allowed
    elif empty_rows == "uniform":  # masked with a large finite number: a row with no key spreads over every key
        w = normalise(np.where(allowed, s, -1e9), axis)
    else:
        w = normalise(np.where(allowed, s, -np.inf), axis)
        if empty_rows == "zero":
            w = np.where(np.any(allowed, axis=-1, keepdims=True), w, 0.0)
    if choices.get("softmax") == "twice":
        w = softmax(w, axis)
    return w * scale if after else w


def split(a, num_heads, choices: Choices = NONE):
    """(b, T, width) -> (b, num_heads, T, width // num_heads)."""
    b, t, d = a.shape
    if choices.get("split") == "view_only":
        return a.reshape(b, num_heads, t, d // num_heads)
    return a.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def merge(a, choices: Choices = NONE):
    """(b, heads, T, head_dim) -> (b, T, heads * head_dim)."""
    b, h, t, hd = a.shape
    if choices.get("merge") == "no_transpose":
        return a.reshape(b, t, h * hd)
    return a.transpose(0, 2, 1, 3).reshape(b, t, h * hd)


def forward(spec: Attention, x, weights, choices: Choices = NONE, *, context=None, positions=None,
            key_positions=None, key_padding=None, mask_context=False, rotary_positions=None,
            rotary_key_positions=None):
    """The module's output for ``x`` (b, T, d_in) (keys and values from ``context`` when given), the tokens at
    rotary ``positions`` (default 0..T-1), as ``choices`` make it.

    key_positions: the context's tokens' positions (default 0..n-1); key_padding: (b, n) bool, True = a real key
    (False: padding, which no query may see); mask_context: the causal mask (and window) applies to the context
    too, by the positions (a cached step's keys, or causal cross-attention counted from the start of both);
    rotary_positions, rotary_key_positions: the positions the queries and the keys are rotated at, where they are
    not those the mask sees (a cached step whose positions restart at 0)."""
    x = np.asarray(x, dtype=np.float64)
    source = x if context is None or choices.get("context") == "self" else np.asarray(context, dtype=np.float64)
    num_heads = choices.get("num_heads") or spec.num_heads
    groups = spec.groups if choices.get("num_heads") is None else min(spec.groups, num_heads)
    bias = choices.get("bias") != "ignored"
    roles = {None: ("W_query", "W_key", "W_value"), "queries_keys": ("W_key", "W_query", "W_value"),
             "keys_values": ("W_query", "W_value", "W_key"),
             "queries_values": ("W_value", "W_key", "W_query")}[choices.get("roles")]
    q = linear(x, weights, roles[0], bias)
    k = linear(source, weights, roles[1], bias)
    v = {"inputs": lambda: source, "keys": lambda: linear(source, weights, "W_key", bias),
         "queries": lambda: linear(source, weights, "W_query", bias)}.get(
        str(choices.get("values")), lambda: linear(source, weights, roles[2], bias))()
    d_in, d_out = x.shape[-1], q.shape[-1]
    head_dim = d_out // num_heads
    if d_out % num_heads or k.shape[-1] % groups or k.shape[-1] // groups != head_dim:
        raise ValueError("sizes that do not split into these heads")
    q, k, v = split(q, num_heads, choices), split(k, groups, choices), split(v, groups, choices)
    t, n = x.shape[1], source.shape[1]
    query_positions = np.arange(t) if positions is None else np.asarray(positions)
    if key_positions is not None and source is not x:
        key_positions = np.asarray(key_positions)
    else:
        key_positions = np.arange(n) if positions is None or context is not None else np.asarray(positions)
    if spec.rope_theta is not None and choices.get("rope") != "none":
        choice = choices.get("rope")
        turn_q = query_positions if rotary_positions is None else np.asarray(rotary_positions)
        turn_k = key_positions if rotary_key_positions is None else np.asarray(rotary_key_positions)
        if choice == "restart":
            turn_q = turn_k = np.arange(t)
        q = rope(q, turn_q, spec.rope_theta, choice)
        k = rope(k, turn_k, spec.rope_theta, choice)
        if choice == "values":
            v = rope(v, turn_k, spec.rope_theta)
    if groups != num_heads:
        size = num_heads // groups
        repeat = choices.get("kv_repeat")

        def tiled(a):
            return np.tile(a, (1, size, 1, 1))

        def interleaved(a):
            return np.repeat(a, size, axis=1)

        k = (tiled if repeat in ("tile", "keys") else interleaved)(k)
        v = (tiled if repeat in ("tile", "values") else interleaved)(v)
    if context is None or mask_context:
        allowed = allowed_keys(spec, query_positions, key_positions, choices)
    else:
        allowed = np.ones((t, n), bool)
    if key_padding is not None:
        allowed = padded(allowed, np.asarray(key_padding, bool), choices.get("padding"))
    # (an inverted boolean mask given to F.scaled_dot_product_attention: a row left with no key gives 0, or NaN)
    empty = "zero" if choices.get("causal") == "inverted" else spec.empty_rows
    w = attention_weights(q @ np.swapaxes(k, -1, -2), allowed, scale_of(spec, head_dim, d_in, d_out, choices),
                          choices, empty)
    out = merge(w @ v, choices)
    if spec.out_proj and choices.get("out_proj") != "missing":
        out = linear(out, weights, "out_proj")
        if choices.get("out_bias") == "missing" and "out_proj.bias" in weights:
            out = out - np.asarray(weights["out_proj.bias"], dtype=np.float64)
    return out


def padded(allowed, real, choice=None):
    """``allowed`` (n_queries, n_keys) and the key padding mask ``real`` (b, n_keys; True = a real key) as one mask
    (b, 1, n_queries, n_keys); ``choice``: a padding mistake (the mask inverted, put on the queries, ignored)."""
    allowed = np.asarray(allowed, bool)
    if choice == "none":
        return np.broadcast_to(allowed, (real.shape[0], 1, *allowed.shape[-2:]))
    if choice == "queries":  # (only where n_queries == n_keys: the mask read along the query axis)
        return allowed & real[:, None, :, None]
    return allowed & (~real if choice == "inverted" else real)[:, None, None, :]


# ---------------------------------------------------------------- the switches

def not_scaled(k: str) -> str:
    """The words of a scaling left out, where the width of one head's keys is called ``k``."""
    return no_effect("with the scores not scaled", f"the scaling by 1 / sqrt({k})",
                     f"divide the scores by sqrt({k}) before the softmax, and keep the result")


def scaling_switch(spec: Attention, head_dim: int, d_in: int, d_out: int) -> Switch:
    """Scaling the scores: the wrong divisors a learner can pick, those the sizes of the case can tell apart."""
    k = spec.head_name
    wrong = {"none": not_scaled(k),
             "times": f"the scores were multiplied by sqrt({k}); divide by it",
             "no_sqrt": f"the scores were divided by {k}; divide by sqrt({k})",
             "after_softmax": f"the weights were scaled after the softmax, softmax(scores) / sqrt({k}): divide the "
                              f"scores by sqrt({k}) before the softmax, so that each query's weights sum to 1"}
    if d_out != head_dim:
        wrong["d_out"] = (f"the scores were scaled by sqrt(d_out), the model width; each head's dot products have "
                          f"{k} terms, so divide by sqrt({k})")
    if spec.num_heads > 1 and spec.num_heads not in (head_dim, d_out):
        wrong["num_heads"] = (f"the scores were scaled by sqrt(num_heads), the number of heads; each head's dot "
                              f"products have {k} terms, so divide by sqrt({k})")
    if d_in not in (head_dim, d_out):
        wrong["d_in"] = (f"the scores were scaled by sqrt(d_in), the input width; the dot products have {k} terms, "
                         f"so divide by sqrt({k})")
    return Switch("scale", "scaling", wrong)


SCORES = Switch("scores", "scores", {
    "transposed": "keys @ queries^T: the scores are transposed (row i must hold query i's scores, "
                  "queries @ keys.transpose(...))"})
SOFTMAX = Switch("softmax", "softmax", {
    "queries": "softmax over the wrong dimension, the query axis (dim=-2: dim 0 of one table of scores, dim 1 of a "
               "batch); each query's weights over the keys must sum to 1, so use dim=-1",
    "twice": "softmax was applied twice: the weights were already normalised, and a second softmax flattens them "
             "and gives the masked future weight exp(0) > 0"})
# The ways a softmax written by hand goes wrong (the stages that write one; a module's uses torch.softmax).
SOFTMAX_BY_HAND = Switch("by_hand", "softmax", {
    "unstable": "the max was not subtracted before exp: exp overflows to inf for large scores (inf / inf is NaN); "
                "subtract each row's max first, softmax(x) = softmax(x - max(x))",
    "whole_sum": "the exponentials were divided by their sum over the whole tensor; sum each row (dim=dim, "
                 "keepdim=True)",
    "global_max": "the max subtracted before exp was the whole tensor's, not each row's: a row far below it underflows "
                  "to 0 / 0 = NaN; subtract each row's max, x.max(dim=dim, keepdim=True)",
    "flat": "one softmax over the whole tensor: the max and the sum must be taken per row (keepdim=True)",
    "sum": "the scores were divided by their sum, not passed through softmax (exp, then divide by the sum of the "
           "exponentials)"})
NO_CAUSAL_MASK = no_effect("with no causal mask at all (every query sees every key, the later ones included)",
                           "the causal mask", "give the keys after each query -inf before the softmax (or pass "
                           "is_causal=True to F.scaled_dot_product_attention), and keep the result: masked_fill "
                           "returns a new tensor, masked_fill_ changes the scores in place")
CAUSAL = Switch("causal", "masking", {
    "none": NO_CAUSAL_MASK,
    "diagonal": "the mask hides each token's own position too (torch.triu(..., diagonal=0), or j < i): a token "
                "attends to itself and the tokens before it; mask the strict upper triangle, "
                "torch.triu(..., diagonal=1)",
    "next": "the mask starts one diagonal too high (torch.triu(..., diagonal=2), or j <= i + 1): each token also "
            "sees the next one; mask the strict upper triangle, torch.triu(..., diagonal=1)",
    "past": "the mask hides the past instead of the future (tril and triu swapped)"})
INVERTED = ("the mask is inverted: the future takes part and each token's past and its own position are hidden (a "
            "boolean mask of the opposite convention: True = takes part where True = masked out is meant, or the other "
            "way)")
CAUSAL_INVERTED = {"inverted": INVERTED, "inverted_nan": INVERTED}
# A module's attention computed by F.scaled_dot_product_attention, given the causal buffer as it is.
SDPA_MASK = ("the boolean mask is inverted: F.scaled_dot_product_attention takes attn_mask True where a token takes "
             "part, so pass the allowed positions, ~mask (the causal buffer marks the future)")
SDPA_INVERTED = {"inverted": SDPA_MASK,
                 "inverted_nan": SDPA_MASK + " (here a row left with nothing to attend to gives NaN)"}
CAUSAL_ADDED = Switch("causal", "masking", {
    "added": "a causal mask was applied although this attention is not causal here (causal=False)"})
CACHED_ROWS = {"top_left": "the new queries of a cached step were masked as if they came first (rows 0.. of the "
                           "mask, or is_causal with more keys than queries, which aligns them top-left): they are the "
                           "last num_new of num_keys positions"}
FILL = Switch("fill", "masking", {
    "zero": "masked with 0 instead of -inf: a masked score of 0 still gets weight exp(0) > 0",
    "after": "masked after the softmax without renormalising: rows no longer sum to 1"})
WINDOW = Switch("window", "masking", {
    "plus_one": "the window is off by one: i - j <= window lets window + 1 tokens take part; the query's own token "
                "counts, so key j takes part when j <= i and i - j < window",
    "minus_one": "the window is off by one: the query's own token counts as one of the window's, so key j takes "
                 "part when j <= i and i - j < window (yours holds window - 1 tokens)",
    "two_sided": "the band is not causal: keys after the query (j > i) take part; add j <= i",
    "rows": "the window's lower bound was not offset by the cache length, the causal bound was: in a cached step the "
            "band was counted from the new tokens' rows (0, 1, ...) against the keys' places in the cache, so a new "
            "query sees keys further back than window - 1; take the band at the queries' positions (start .. start "
            "+ num_new - 1) as the causal mask is",
    "none": no_effect("with no window (every earlier token takes part: plain causal attention)", "the window",
                      "key j takes part when j <= i and i - j < window")})
PADDING = Switch("padding", "padding", {
    "inverted": "the key_padding_mask is inverted: True marks a REAL token that takes part, False a padding token",
    "queries": "the key_padding_mask was applied on the query axis (rows of the scores): it says which KEYS are "
               "padding, so it masks columns, key_padding_mask[:, None, None, :] against (b, num_heads, n_q, n_kv)",
    "none": "padding keys took part, as if the key_padding_mask were ignored: it is not applied, or it is combined "
            "with the causal mask by | (or) where & (and) is meant"})
EMPTY = Switch("empty", "padding", {
    "nan": "a query with nothing to attend to (every key masked) got NaN: its softmax row is all -inf, 0/0. Give "
           "such rows attention weights 0, so that its context vector is 0",
    "uniform": "masked scores were filled with a large negative number (not -inf) and rows with nothing to attend "
               "to kept: such a query then spreads its weight evenly over every key, masked ones included; give "
               "such rows weights 0"})
CONTEXT = Switch("context", "cross attention", {
    "self": "the keys and values came from x: with a context, W_key and W_value project the context"})
ROLES = Switch("roles", "projections", {
    "queries_keys": "the queries were projected with W_key and the keys with W_query (the two swapped)",
    "keys_values": "the keys were projected with W_value and the values with W_key (the two swapped)",
    "queries_values": "the queries were projected with W_value and the values with W_query (the two swapped)"})
OUT_BIAS = Switch("out_bias", "projections", {
    "missing": no_effect("with out_proj's bias left out", "out_proj's bias", "the output is out_proj(context) "
                         "with its bias added (its bias loaded, not left at zeros)")})
NO_QKV_BIAS = no_effect("with no biases in W_query, W_key and W_value", "qkv_bias",
                        "pass bias=qkv_bias to W_query, W_key and W_value")
NO_OUT_PROJ = no_effect("without out_proj", "out_proj",
                        "apply it to the concatenated heads, self.out_proj(context_vec), and return its result")
PROJECTIONS = {
    "values": Switch("values", "projections", {
        "inputs": "the values were the inputs: mix the projected values W_value(x), not x",
        "keys": "the values were projected with W_key: values = W_value(x)",
        "queries": "the values were projected with W_query: values = W_value(x)"}),
    "bias": Switch("bias", "projections", {
        "ignored": NO_QKV_BIAS}),
    "out_proj": Switch("out_proj", "projections", {
        "missing": NO_OUT_PROJ}),
}
HEADS = {
    "split": Switch("split", "heads", {
        "view_only": "the heads were split with view alone: view to (b, num_tokens, num_heads, head_dim), then "
                     "transpose(1, 2)"}),
    "merge": Switch("merge", "heads", {
        "no_transpose": "the heads were merged without moving the head axis back: transpose(1, 2) to (b, "
                        "num_tokens, num_heads, head_dim), then view (or reshape) to (b, num_tokens, d_out)"}),
}
KV_REPEAT = Switch("kv_repeat", "grouped-query attention", {
    "tile": "the key/value heads were expanded with `repeat`, which tiles them (query head h got kv head "
            "h % num_kv_groups); use repeat_interleave(group_size, dim=1): query head h uses kv head "
            "h // group_size, consecutive query heads share one",
    "keys": "the keys were expanded with `repeat` (the values right), which tiles them (query head h got key head "
            "h % num_kv_groups); use repeat_interleave(group_size, dim=1) for both: query head h uses kv head "
            "h // group_size",
    "values": "the values were expanded with `repeat` (the keys right), which tiles them (query head h got value "
              "head h % num_kv_groups); use repeat_interleave(group_size, dim=1) for both: query head h uses kv "
              "head h // group_size"})
ROPE = Switch("rope", "rotary positions", {
    "none": no_effect("with no rotation at all", "RoPE", "rotate the queries and the keys with apply_rope before the "
                      "scores, along the token axis: apply_rope takes (b, num_heads, num_tokens, head_dim), and "
                      "where another axis stands in the tokens' place a query and a key of one head turn by the same "
                      "angle, which cancels in q . k"),
    "values": "RoPE was applied to the values: rotate only the queries and the keys (a score q.k depends on their "
              "positions); the values carry content, not position",
    "interleaved": "interleaved pairs (x[2i], x[2i+1]) were rotated where Llama's halves layout is meant: pair "
                   "feature i with feature i + head_dim/2, x * cos + rotate_half(x) * sin",
    "pairs_interleaved": "interleaved pairs (x[2i], x[2i+1]) were rotated with the halves layout's angles: the two "
                         "layouts are mixed; pair feature i with feature i + head_dim/2 (rotate_half)",
    "angles_interleaved": "cos and sin are in the interleaved layout (each angle repeated twice) but the pairs are the "
                          "halves (rotate_half): the two layouts are mixed; duplicate the angles with "
                          "cat([freqs, freqs])",
    "sign": "the rotation goes the wrong way: rotate_half(x) is cat([-x2, x1]) (x2 the second half), not "
            "cat([x2, -x1])",
    "frequency": "the frequencies use i / head_dim: inv_freq = theta_base ** (-arange(0, head_dim, 2) / head_dim), "
                 "one frequency per pair"})
ROPE_THETA = {"theta": "theta_base was ignored (10_000 used): compute the frequencies from the theta_base argument"}


def head_count_switch(spec: Attention, d_out: int, kv_width: int) -> Switch:
    """Other head counts a module could have read from somewhere else than its constructor's arguments."""
    wrong = {}
    for other in range(1, d_out + 1):
        if d_out % other == 0 and other != spec.num_heads and (spec.num_kv_groups is None or kv_width % (
                d_out // other) == 0):
            wrong[other] = (f"the output is that of {other} heads, not num_heads={spec.num_heads}: take every size "
                            "from the constructor's arguments (num_heads, d_out), never from a global or the book's "
                            "example")
    return Switch("num_heads", "heads", wrong)


def switches(spec: Attention, d_in: int, d_out: int, kv_width: int | None = None, *, cached: bool = False,
             values_from_inputs: bool | None = None, padded: bool = False, context: bool = False,
             causal_added: bool = False) -> list[Switch]:
    """Every choice of ``spec``'s computation that the sizes of a case can show, with its wrong values.

    cached: a cached step's (its queries after the cached keys); padded: a key padding mask is given; context: the
    keys and values come from a context (of x's width: else they could not come from x); causal_added: a
    non-causal computation that a learner could mask causally by mistake (a module with a causal flag)."""
    head_dim = d_out // spec.num_heads
    kv_width = d_out if kv_width is None else kv_width
    found = [scaling_switch(spec, head_dim, d_in, d_out), SCORES, SOFTMAX, FILL, *PROJECTIONS.values()]
    if spec.causal:
        found.append(CAUSAL.plus(SDPA_INVERTED).plus(CACHED_ROWS if cached else {}))
    elif causal_added:
        found.append(CAUSAL_ADDED)
    if padded:
        found.append(PADDING)
    if spec.empty_rows == "zero":  # (a row with no key: NaN or spread over every key, where 0 is meant)
        found.append(EMPTY)
    if context:
        found.append(CONTEXT)
    if spec.window is not None:
        found.append(WINDOW)
    if not spec.out_proj:
        found.remove(PROJECTIONS["out_proj"])
    values = PROJECTIONS["values"]
    if values_from_inputs is False or (values_from_inputs is None and d_in != kv_width):
        values = values.without("inputs")
    if kv_width != d_out:
        values = values.without("queries")
    found[found.index(PROJECTIONS["values"])] = values
    if spec.num_heads > 1:
        found += [*HEADS.values(), head_count_switch(spec, d_out, kv_width)]
    if spec.groups not in (1, spec.num_heads) or (spec.num_kv_groups and spec.num_kv_groups < spec.num_heads > 2):
        found.append(KV_REPEAT)
    if spec.rope_theta is not None:
        found.append(ROPE.plus(ROPE_THETA) if spec.rope_theta != 10_000.0 else ROPE)
    return found
