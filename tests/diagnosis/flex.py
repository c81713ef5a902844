"""FlexAttention's two functions as a mechanism (mask_mod: which keys a query sees; score_mod: how a score is changed
before the softmax), in NumPy (float64), written once with their switches: causal, sliding-window and document
masks, ALiBi's biases and logit soft-capping.

``Flex`` describes one model's attention (its mask and its score mod); ``attention(spec, q, k, v, choices)`` is the
dense computation FlexAttention must equal (a query with no key gets 0, as flex_attention gives), ``switches(spec,
...)`` the choices a learner makes there. ``slopes(num_heads, choices)`` are ALiBi's slopes with their own switch.
Probes read the learner's weights through values that are the identity (``exposed_values``): ``alibi_findings``
fits the bias per head and distance that the weights show, ``document_findings`` finds weight that crosses
documents; ``probes.weight_findings`` reads the mask and the temperature.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from .findings import Finding
from .search import Switch, no_effect

Choices = Mapping[str, Hashable]
NONE: Choices = {}


@dataclass(frozen=True)
class Flex:
    """One model's attention as FlexAttention runs it: ``mask`` "causal", "window", "documents" or None (no
    mask_mod), ``score`` "alibi", "soft_cap" or None (no score_mod), and their arguments."""

    mask: str | None = "causal"
    score: str | None = None
    window: int | None = None
    document_ids: tuple | None = None
    cap: float | None = None


def slopes(num_heads: int, choices: Choices = NONE) -> np.ndarray:
    """ALiBi's slope per head: 2^(-8 (h + 1) / n) for n a power of 2; the paper's interleaving rule otherwise."""
    choice = choices.get("slopes")
    start = 0 if choice == "from_zero" else 1

    def geometric(n):
        return [2.0 ** (-8.0 * (h + start) / n) for h in range(n)]

    if choice == "geometric":
        found = geometric(num_heads)
    else:
        n = 2 ** int(math.floor(math.log2(num_heads)))
        found = geometric(n) + geometric(2 * n)[0::2][:num_heads - n]
    if choice == "reversed":
        found = found[::-1]
    return np.asarray(found, np.float64)


def allowed(spec: Flex, n_q: int, n_kv: int, choices: Choices = NONE) -> np.ndarray:
    """bool (n_q, n_kv): which keys each query sees under the mask_mod, as ``choices`` make it."""
    i, j = np.arange(n_q)[:, None], np.arange(n_kv)[None, :]
    everything = np.ones((n_q, n_kv), bool)
    if spec.mask is None or choices.get("mask") == "missing":
        return everything
    causal = {None: j <= i, "diagonal": j < i, "past": j >= i, "next": j <= i + 1,
              "none": everything}[choices.get("causal")]
    if spec.mask == "window":
        w = spec.window
        band = {None: i - j < w, "plus_one": i - j <= w, "minus_one": i - j < w - 1, "none": everything}
        if choices.get("window") == "two_sided":
            return np.abs(i - j) < w
        return causal & band[choices.get("window")]
    if spec.mask == "documents":
        ids = np.asarray(spec.document_ids)
        same = ids[:n_q, None] == ids[None, :n_kv]
        return {None: same & causal, "not_causal": same, "ignored": causal}[choices.get("documents")]
    return causal


def scores(spec: Flex, q, k, choices: Choices = NONE) -> np.ndarray:
    """The scores after the score_mod: q . k scaled by 1/sqrt(head_dim), then ALiBi's bias or the soft cap."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    d = q.shape[-1]
    scale = {None: 1 / np.sqrt(d), "none": 1.0, "twice": 1 / d}[choices.get("scale")]
    s = q @ np.swapaxes(k, -1, -2) * scale
    n_q, n_kv = s.shape[-2:]
    if spec.score == "alibi":
        distance = np.arange(n_q)[:, None] - np.arange(n_kv)[None, :]
        sign = -1.0 if choices.get("alibi") == "plus" else 1.0
        if choices.get("alibi") == "distance_abs":
            distance = np.abs(distance)
        slope = slopes(q.shape[-3], choices)[:, None, None]
        s = s - sign * slope * distance
    elif spec.score == "soft_cap":
        cap, choice = spec.cap, choices.get("cap")
        if choice == "before_scale":  # (the cap taken on q . k before the scaling, the scaling applied after it)
            return cap * np.tanh(s / scale / cap) * scale
        s = {None: lambda a: cap * np.tanh(a / cap), "no_divide": lambda a: cap * np.tanh(a),
             "no_multiply": lambda a: np.tanh(a / cap), "clamp": lambda a: np.clip(a, -cap, cap),
             "missing": lambda a: a, "score_times": lambda a: a * np.tanh(a / cap),
             "times_inside": lambda a: cap * np.tanh(a * cap),
             "twice": lambda a: cap * np.tanh(np.tanh(a / cap))}[choice](s)
    return s


def attention(spec: Flex, q, k, v, choices: Choices = NONE) -> np.ndarray:
    """softmax over the keys each query sees of the modified scores, mixing v; 0 for a query with no key."""
    s = scores(spec, q, k, choices)
    mask = allowed(spec, s.shape[-2], s.shape[-1], choices)
    s = np.where(mask, s, -np.inf)
    empty = np.isneginf(s).all(axis=-1, keepdims=True)
    s = np.where(empty, 0, s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    w = np.where(empty, 0, e / e.sum(axis=-1, keepdims=True))
    return w @ np.asarray(v, np.float64)


# ---------------------------------------------------------------- the switches

STRICT = "the diagonal was masked: a query sees its own token too, q_idx >= kv_idx (not >)"
NO_MASK = no_effect("with no mask_mod (every query sees every key)", "the mask_mod",
                    "pass a block mask made from it to flex_attention (block_mask=...)")
CAUSAL = Switch("causal", "masking", {
    "diagonal": STRICT,
    "past": "the mask is reversed: queries see later keys instead of earlier ones; q_idx >= kv_idx",
    "next": "the mask lets each query see the next token too (q_idx + 1 >= kv_idx): q_idx >= kv_idx",
    "none": no_effect("with no causal condition in the mask (a query sees later keys)", "the mask_mod's causal "
                      "condition", "require q_idx >= kv_idx")})
MASK = Switch("mask", "masking", {"missing": NO_MASK})
WINDOW = Switch("window", "masking", {
    "plus_one": "the window is off by one: q_idx - kv_idx < window (window tokens, the query's own included)",
    "minus_one": "the window is off by one: q_idx - kv_idx < window (window tokens, the query's own included; yours "
                 "holds window - 1)",
    "two_sided": "the window is not causal: also require q_idx >= kv_idx (a window of past tokens only)",
    "none": no_effect("with no window (every earlier key takes part)", "the mask_mod's window condition",
                      "also require q_idx - kv_idx < window")})
DOC_NOT_CAUSAL = "tokens of a document see its later tokens: the document mask must be causal too (q_idx >= kv_idx)"
DOC_IGNORED = "the documents were ignored: a token sees only its own document's tokens (document_ids must match)"
DOCUMENTS = Switch("documents", "documents", {"not_causal": DOC_NOT_CAUSAL, "ignored": DOC_IGNORED})
ALIBI_SIGN = ("the ALiBi bias has the wrong sign: subtract slope[h] * (q_idx - kv_idx), a penalty that grows with "
              "the distance")
ALIBI = Switch("alibi", "ALiBi", {"plus": ALIBI_SIGN})
ALIBI_FROM_ZERO = "the ALiBi slopes start one step early: slope[h] = 2^(-8 (h + 1) / num_heads), the first 2^(-8/n)"
ALIBI_GEOMETRIC = ("for a head count that is not a power of 2 the slopes follow the ALiBi paper's rule: those of the "
                   "largest power of 2 below it, then every other slope of twice that, not one geometric sequence")
SLOPES = Switch("slopes", "ALiBi", {
    "from_zero": ALIBI_FROM_ZERO,
    "geometric": ALIBI_GEOMETRIC,
    "reversed": "the slopes are in reverse order of the heads: slope[h] = 2^(-8 (h + 1) / num_heads) gives head 0 "
                "the largest (2^(-8/n)) and the last head the smallest"})
CAP_NO_DIVIDE = "soft-capping is cap * tanh(score / cap): the score was not divided by cap inside tanh"
CAP_NO_MULTIPLY = "soft-capping is cap * tanh(score / cap): tanh's result was not multiplied back by cap"
CAP = Switch("cap", "soft-capping", {
    "no_divide": CAP_NO_DIVIDE,
    "no_multiply": CAP_NO_MULTIPLY,
    "clamp": "the scores were clipped at +-cap (clamp): soft-capping squashes them smoothly, cap * tanh(score / cap)",
    "score_times": "tanh's result was multiplied by the score, not by cap: soft-capping is cap * tanh(score / cap) "
                   "(score * tanh(score / cap) is not bounded by cap: a large score passes through unchanged)",
    "times_inside": "the score was multiplied by cap inside tanh, not divided: soft-capping is cap * tanh(score / cap)",
    "twice": "the scores were capped twice: soft-capping is applied once, cap * tanh(score / cap)",
    "before_scale": "the cap was taken on q . k before the scaling by 1/sqrt(head_dim): the score_mod receives the "
                    "scaled score and caps it as it is, cap * tanh(score / cap) (flex_attention scales first)",
    "missing": no_effect("with no score_mod (the scores not capped)", "soft-capping",
                         "pass score_mod=soft_cap(cap) to flex_attention")})
SCALE = Switch("scale", "scaling", {
    "none": no_effect("with the scores not scaled", "the scaling by 1/sqrt(head_dim)", "flex_attention scales "
                      "them itself unless given scale=...; leave its default"),
    "twice": "the scores were scaled twice (divided by head_dim): flex_attention already divides by sqrt(head_dim) "
             "before the score_mod"})


def switches(spec: Flex, num_heads: int) -> list[Switch]:
    """The choices of ``spec``'s computation, each wrong value with its words."""
    found = [SCALE]
    if spec.mask is not None:
        found += [MASK, CAUSAL.without("none") if spec.mask == "documents" else CAUSAL]
    if spec.mask == "window":
        found.append(WINDOW)
    if spec.mask == "documents":
        found.append(DOCUMENTS)
    if spec.score == "alibi":
        found += [ALIBI, slope_switch(num_heads)]
    if spec.score == "soft_cap":
        found.append(CAP)
    return found


def slope_switch(num_heads: int) -> Switch:
    """The slopes' mistakes that ``num_heads`` heads can show (one geometric sequence is right for a power of 2)."""
    if num_heads & (num_heads - 1):
        return SLOPES
    return SLOPES.without("geometric")


# ---------------------------------------------------------------- probes

def exposed_values(q, k):
    """Values that are the identity over the keys, (b, heads, n_kv, n_kv): attention over them gives its weights."""
    b, h, n_kv = np.shape(k)[:3]
    return np.broadcast_to(np.eye(n_kv, dtype=np.float32), (b, h, n_kv, n_kv)).copy()


def alibi_findings(observed, q, k, mask, expected_slopes, *, what="your attention weights") -> list[Finding]:
    """The bias per unit of distance each head's weights show: log w[i, j] - q_i . k_j / sqrt(d) = -slope * (i - j)
    + a constant per row, fitted over the keys each query gives weight to; against ALiBi's slopes."""
    observed = np.asarray(observed, np.float64)
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    n_q, n_kv = s.shape[-2:]
    distance = (np.arange(n_q)[:, None] - np.arange(n_kv)[None, :]).astype(np.float64)
    use = np.broadcast_to(mask, observed.shape) & (observed > 1e-30)
    shown = []
    for h in range(observed.shape[1]):
        xs, ys = [], []
        for b in range(observed.shape[0]):
            for i in range(n_q):
                keep = use[b, h, i]
                if keep.sum() < 2:
                    continue
                y = np.log(observed[b, h, i, keep]) - s[b, h, i, keep]
                x = distance[i, keep]
                xs.append(x - x.mean())
                ys.append(y - y.mean())
        if not xs:
            return []
        x, y = np.concatenate(xs), np.concatenate(ys)
        if np.sum(x * x) < 1e-12:
            return []
        slope = -float(np.sum(x * y) / np.sum(x * x))
        if np.sqrt(np.mean((y + slope * x) ** 2)) > 1e-3 * max(1.0, np.sqrt(np.mean(y ** 2))):
            return []  # not a bias linear in the distance: another probe or the search says why
        shown.append(slope)
    expected = np.asarray(expected_slopes, np.float64)
    if np.allclose(shown, expected, rtol=1e-3, atol=1e-6):
        return []
    said = ", ".join(f"{v:.4g}" for v in shown)
    right = ", ".join(f"{v:.4g}" for v in expected)
    shows = (f"{what} fall off with the distance q_idx - kv_idx at a slope of {said} per token (head by head) on top "
             f"of the scores; ALiBi's slopes are {right}")
    if np.allclose(shown, -expected, rtol=1e-3, atol=1e-6):
        return [Finding(shows + ": yours favour distant keys.", (ALIBI_SIGN,), "ALiBi", "probe", weight=3)]
    for value in ("from_zero", "geometric", "reversed"):
        if np.allclose(shown, slopes(len(expected), {"slopes": value}), rtol=1e-3, atol=1e-6):
            return [Finding(shows + ".", (SLOPES.wrong[value],), "ALiBi", "probe", weight=3)]
    return [Finding(shows + ".", ("the slopes or the distance in the score_mod differ from ALiBi's: score - slopes[h] "
                                  "* (q_idx - kv_idx) with alibi_slopes(num_heads)",), "ALiBi", "probe", weight=4)]


def document_findings(observed, document_ids, *, what="your attention weights") -> list[Finding]:
    """Weight that a query puts on a key of another document."""
    observed = np.asarray(observed, np.float64)
    ids = np.asarray(document_ids)
    n_q, n_kv = observed.shape[-2:]
    other = ids[:n_q, None] != ids[None, :n_kv]
    crossing = np.nan_to_num(observed) > 1e-12
    crossing &= other
    if not np.any(crossing):
        return []
    index = tuple(int(v) for v in np.argwhere(crossing)[0])
    i, j = index[-2], index[-1]
    return [Finding(f"query {i} (document {ids[i]}) puts weight {observed[index]:.3g} on key {j} (document {ids[j]}): "
                    "attention crosses documents.", (DOC_IGNORED,), "documents", "probe", weight=2)]
