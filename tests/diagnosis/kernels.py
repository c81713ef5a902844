"""The mechanisms of attention kernels (the kernels assignment, stages k01-k06), in NumPy, written once with their
switches: a softmax read in chunks, attention over tiles with causal tiles skipped and an online softmax, its
backward recomputed from the log-sum-exp, and decoding split across programs (over a block table too).

Each reference computation follows the kernel's own order (chunks, tiles, splits), because the typical mistakes of a
kernel are mistakes of that order: a running accumulator not rescaled when a later tile raises the max, a causal
loop that stops one tile early, a tail of a chunk that is not masked, a combine that averages splits. A choice not
made keeps its right value, so ``forward(q, k, v, causal, 16, 16)`` is the right output and ``forward(...,
{"rescale": "acc"})`` what a kernel that never rescales its accumulator gives; the ``*_SWITCHES`` lists say which
choices a check of each function can show, each wrong value with its words (``diagnosis.search`` tries them, one
and two at a time).

The tiled forward is the mechanism of modern-attention's m07 too (its tiles and online softmax in PyTorch): it can
search these switches when it is converted.

Numbers: float64, except where float32's range decides what a mistake gives (exp overflows above ~88.7 in float32,
and a kernel computes in float32): those steps run in float32, as the kernels do.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .attention import not_scaled
from .search import Switch

Choices = Mapping[str, Any]
NONE: Mapping[str, Any] = {}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_d(d: int) -> int:
    """The padded head dimension a kernel with tl.dot uses: a power of 2, at least 16."""
    return max(16, 1 << (int(d) - 1).bit_length())


def _exp32(x):
    """exp in float32, as a kernel computes it: inf above ~88.7, 0 below ~-103."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.exp(np.asarray(x, dtype=np.float32)).astype(np.float64)


# ---------------------------------------------------------------- k01: a softmax read in chunks

def chunked_softmax(x, block: int, choices: Choices = NONE):
    """softmax over the last axis, by one program per row reading the row in chunks of ``block`` (stage k01), in
    float32 as the kernel computes it. Choices: "tail" (lanes past the row's end: "zero" = loaded as 0 in every
    pass, "zero_max" = as 0 in the max pass only), "max" ("none": nothing subtracted; "last_chunk": the max of the
    last chunk alone)."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    padded = cdiv(n, block) * block
    tail = choices.get("tail")
    with np.errstate(all="ignore"):
        full = np.concatenate([x, np.full((*x.shape[:-1], padded - n), -np.inf, np.float32)], axis=-1)
        zeros = np.concatenate([x, np.zeros((*x.shape[:-1], padded - n), np.float32)], axis=-1)
        for_max = zeros if tail in ("zero", "zero_max") else full
        chunks = for_max.reshape(*x.shape[:-1], -1, block)
        row_max = {None: chunks.max(axis=(-1, -2)), "last_chunk": chunks[..., -1, :].max(axis=-1),
                   "none": np.zeros(x.shape[:-1], np.float32)}[choices.get("max")][..., None]
        for_sum = zeros if tail == "zero" else full
        e = np.exp((for_sum - row_max).astype(np.float32))
        total = e.sum(axis=-1, keepdims=True, dtype=np.float32)
        return (np.exp((x - row_max).astype(np.float32)) / total).astype(np.float64)


CHUNKED_SOFTMAX = [
    Switch("tail", "masking", {
        "zero": "the lanes past the row's end were loaded as 0 (other=0.0, or a load without other): each adds "
                "exp(0 - max) to the sum; load them with other=-float('inf'), whose exp is 0",
        "zero_max": "the max pass loads the lanes past the row's end as 0: a row far below 0 then takes 0 as its max, "
                    "every exp(x - 0) underflows to 0 and 0 / 0 is NaN; load them with other=-float('inf')"}),
    Switch("max", "softmax", {
        "none": "the row's max was not subtracted before exp: exp overflows to inf for values above about 88 "
                "(inf / inf is NaN); subtract it, softmax(x) = softmax(x - max(x))",
        "last_chunk": "the running max was not carried across the chunks: the last chunk's max alone was "
                      "subtracted, and exp(x - max) overflows where an earlier chunk holds larger values; keep "
                      "lane_max = tl.maximum(lane_max, x) over every chunk"}),
]


def columns_read(actual, x, block: int):
    """How many leading columns of each row the learner's softmax is right on when it reads only the full chunks
    (range(0, n_cols // BLOCK_SIZE * BLOCK_SIZE, ...)): that number if its rows equal softmax over those columns
    there, else None."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-1]
    cut = n // block * block
    if cut in (0, n):
        return None
    part = x[..., :cut]
    e = np.exp(part - part.max(axis=-1, keepdims=True))
    if np.allclose(np.asarray(actual)[..., :cut], e / e.sum(axis=-1, keepdims=True), rtol=1e-4, atol=1e-6):
        return cut
    return None


# ---------------------------------------------------------------- k02, k03: attention over tiles

def scale_of(d: int, choices: Choices = NONE) -> float:
    return {None: 1 / np.sqrt(d), "none": 1.0, "block_d": 1 / np.sqrt(block_d(d)), "no_sqrt": 1 / d}[
        choices.get("scale")]


def tile_end(pid_m: int, t: int, causal: bool, bm: int, bn: int, choices: Choices = NONE) -> int:
    """Where a causal tile of queries stops its loop over key tiles (hi): right, min((pid_m + 1) * BLOCK_M, T)."""
    if not causal:
        return t
    end = {None: (pid_m + 1) * bm, "diagonal_skipped": pid_m * bm, "block_n": (pid_m + 1) * bn}[
        choices.get("causal_end")]
    return min(end, t)


def allowed_in_tile(rows, keys, t: int, causal: bool, choices: Choices = NONE):
    """(len(rows), len(keys)) booleans: which scores of a tile stay (the others become -inf)."""
    allowed = np.ones((len(rows), len(keys)), bool)
    if choices.get("tail") != "unmasked":
        allowed &= (keys < t)[None, :]
    if causal:
        i, j = rows[:, None], keys[None, :]
        allowed &= {None: j <= i, "none": np.ones_like(allowed), "strict": j < i}[choices.get("tile_mask")]
    return allowed


def forward(q, k, v, causal: bool, bm: int, bn: int, choices: Choices = NONE):
    """FlashAttention-2's forward over tiles (stage k03), as its kernel orders it: one tile of ``bm`` queries after
    another, its key tiles of ``bn`` from 0 to the tile's end, folded into m, l and acc. q, k, v (..., T, d) ->
    (o (..., T, d), lse (..., T)). Keys past T a kernel loads as 0 (a tail not masked scores them 0).
    Choices: scale, causal_end, tile_mask, tail (see above); "rescale" ("acc": acc not rescaled, "sum": l not
    rescaled, "max_first": m_i overwritten before alpha = exp(m_i - m_new), so alpha = 1); "p_max" ("old": p =
    exp(s - the old m_i)); "lse" ("no_max": log(l), "max_only": m); "normalise" ("missing": o = acc)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    t, d = q.shape[-2], q.shape[-1]
    scale = scale_of(d, choices)
    pad = cdiv(t, bn) * bn + bn - t  # keys past T, loaded as zeros
    kp = np.concatenate([k, np.zeros((*k.shape[:-2], pad, d))], axis=-2)
    vp = np.concatenate([v, np.zeros((*v.shape[:-2], pad, d))], axis=-2)
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:-1])
    rescale, p_max = choices.get("rescale"), choices.get("p_max")
    with np.errstate(all="ignore"):
        for pid_m in range(cdiv(t, bm)):
            rows = np.arange(pid_m * bm, min((pid_m + 1) * bm, t))
            qb = q[..., rows, :]
            m = np.full(qb.shape[:-1], -np.inf)
            total, acc = np.zeros(qb.shape[:-1]), np.zeros(qb.shape)
            for start in range(0, tile_end(pid_m, t, causal, bm, bn, choices), bn):
                keys = np.arange(start, start + bn)
                s = qb @ np.swapaxes(kp[..., keys, :], -1, -2) * scale
                s = np.where(allowed_in_tile(rows, keys, t, causal, choices), s, -np.inf)
                m_new = np.maximum(m, s.max(axis=-1))
                alpha = np.ones_like(m) if rescale == "max_first" else np.exp(m - m_new)
                p = np.exp(s - (m if p_max == "old" else m_new)[..., None])
                total = (total if rescale == "sum" else total * alpha) + p.sum(axis=-1)
                acc = (acc if rescale == "acc" else acc * alpha[..., None]) + p @ vp[..., keys, :]
                m = m_new
            o[..., rows, :] = acc if choices.get("normalise") == "missing" else acc / total[..., None]
            lse[..., rows] = {None: m + np.log(total), "no_max": np.log(total), "max_only": m}[choices.get("lse")]
    return o, lse


def weights(q, k, causal: bool, bm: int, bn: int, choices: Choices = NONE):
    """Stage k02's tiled weights (..., T, T): softmax of each row's scores over the key tiles its query tile
    visits, 0 in the tiles it skips (the output starts as zeros). Choices: scale, causal_end, tile_mask, tail."""
    q, k = (np.asarray(a, dtype=np.float64) for a in (q, k))
    t, d = q.shape[-2], q.shape[-1]
    out = np.zeros((*q.shape[:-1], t))
    with np.errstate(all="ignore"):
        for pid_m in range(cdiv(t, bm)):
            rows = np.arange(pid_m * bm, min((pid_m + 1) * bm, t))
            end = tile_end(pid_m, t, causal, bm, bn, choices)
            if end <= 0:
                continue  # no key tile visited: the rows stay 0
            keys = np.arange(0, cdiv(end, bn) * bn)  # every key of the tiles visited (past T: zero keys)
            kp = np.concatenate([k, np.zeros((*k.shape[:-2], max(0, len(keys) - t), d))], axis=-2)[..., keys, :]
            s = q[..., rows, :] @ np.swapaxes(kp, -1, -2) * scale_of(d, choices)
            s = np.where(allowed_in_tile(rows, keys, t, causal, choices), s, -np.inf)
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            w = e / e.sum(axis=-1, keepdims=True)
            shown = keys < t
            out[..., rows, :len(keys[shown])] = w[..., shown]
    return out


def attention(q, k, v, causal: bool):
    """Plain attention in float64 (the expected values): (o, lse), softmax(q k^T / sqrt(d)) v."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    t = q.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones((t, k.shape[-2]), bool)), s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    return (e / total) @ v, (top + np.log(total))[..., 0]


SCALE = Switch("scale", "scaling", {
    "none": not_scaled("d"),
    "block_d": "the scores were scaled by 1 / sqrt(BLOCK_D), the padded head size (a power of 2 >= 16), not by "
               "1 / sqrt(d), the head's real size: pass the scale from the wrapper, 1 / math.sqrt(d)",
    "no_sqrt": "the scores were divided by d; divide by sqrt(d)"})
CAUSAL_END = Switch("causal_end", "causal tiles", {
    "diagonal_skipped": "the causal loop over key tiles stops one tile early, at pid_m * BLOCK_M: the tile on the "
                        "diagonal, which holds each query's own key and the keys just before it, is skipped; "
                        "loop to hi = min((pid_m + 1) * BLOCK_M, T)",
    "block_n": "the causal loop ends at (pid_m + 1) * BLOCK_N, measured in key tiles: it must end after the "
               "tile's last QUERY, (pid_m + 1) * BLOCK_M, and the two differ when BLOCK_M != BLOCK_N"})
TILE_MASK = Switch("tile_mask", "causal tiles", {
    "none": "the tiles on the diagonal were not masked: skipping the tiles above it is not enough, a query sees "
            "the later keys of its own tile; set the scores of keys j > query i to -inf",
    "strict": "the mask inside a tile hides the diagonal too (keys j < i): a query must see its own key, j <= i"})
TAIL = Switch("tail", "masking", {
    "unmasked": "the keys past T in the last tile were not masked: loaded as 0, each scores 0 and takes weight "
                "exp(0 - max); set their scores to -inf (keys < T)"})
RESCALE = Switch("rescale", "online softmax", {
    "acc": "the accumulator acc was not rescaled by alpha = exp(m_i - m_new) when a tile raised the max: "
           "acc = acc * alpha[:, None] + tl.dot(p, v)",
    "sum": "the running sum l_i was not rescaled by alpha = exp(m_i - m_new) when a tile raised the max: "
           "l_i = l_i * alpha + rowsum(p)",
    "max_first": "the running max was updated before it was used: m_i = m_new came before alpha = exp(m_i - m_new), "
                 "so alpha is always 1 and nothing is rescaled; compute alpha from the old m_i first"})
P_MAX = Switch("p_max", "online softmax", {
    "old": "p was computed with the old max, exp(s - m_i) before m_i took the tile's max into account: on the "
           "first tile m_i is -inf and exp(s + inf) is inf; use m_new"})
LSE = Switch("lse", "log-sum-exp", {
    "no_max": "the log-sum-exp was stored without the max: LSE = m_i + log(l_i), since l_i sums exp(s - m_i)",
    "max_only": "the log-sum-exp was stored as the max alone: LSE = m_i + log(l_i)"})
NORMALISE = Switch("normalise", "online softmax", {
    "missing": "the output was not divided by the running sum: O = acc / l_i[:, None]"})

WEIGHTS_SWITCHES = [SCALE, CAUSAL_END, TILE_MASK, TAIL]
FORWARD_SWITCHES = [SCALE, CAUSAL_END, TILE_MASK, TAIL, RESCALE, P_MAX, NORMALISE]
LSE_SWITCHES = [SCALE, CAUSAL_END, TILE_MASK, TAIL, RESCALE, P_MAX, LSE]


def relevant(switches, causal: bool, t: int, bm: int, bn: int):
    """The switches a case can show: the causal ones only with is_causal (and "block_n" only when BLOCK_M !=
    BLOCK_N), the tail only when T is not a multiple of the key tile and the keys are not all causally masked."""
    kept = []
    for switch in switches:
        if switch.name in ("causal_end", "tile_mask") and not causal:
            continue
        if switch.name == "causal_end" and bm == bn:
            switch = switch.without("block_n")
        if switch.name == "tail" and (causal or t % bn == 0):
            continue
        kept.append(switch)
    return kept


# ---------------------------------------------------------------- k04: the backward, recomputed from the lse

def backward(q, k, v, do, causal: bool, bm: int, bn: int, choices: Choices = NONE):
    """The gradients of attention as FlashAttention-2's two kernels compute them (stage k04), given the right lse:
    (dq, dk, dv). dk and dv from the key tiles' loop over query tiles (from the tile holding the key tile's first
    key, with is_causal), dq from the query tiles' loop over key tiles (up to the diagonal). Choices: "scale" ("dk",
    "dq", "both": left without the 1/sqrt(d)), "delta" ("missing": dS = P * dP), "p" ("no_lse": exp(s),
    "unmasked": the causal mask left out inside the tiles the loops visit), "lo" ("diagonal_skipped": the key
    tiles' loop starts one query tile late)."""
    q, k, v, do = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do))
    t, d = q.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(d)
    o, lse = attention(q, k, v, causal)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    tile_i, tile_j = i // bm, j // bn
    # which (query, key) pairs each kernel visits: dq's loop reaches the key tiles that start before its end (hi);
    # dk/dv's loop reaches the query tiles from lo on
    visited_dq = j // bn * bn < np.minimum((tile_i + 1) * bm, t) if causal else np.ones((t, t), bool)
    lo = tile_j * bn // bm * bm + (bm if choices.get("lo") == "diagonal_skipped" else 0)
    visited_dkdv = i >= lo if causal else np.ones((t, t), bool)
    masked = (j <= i) if causal and choices.get("p") != "unmasked" else np.ones((t, t), bool)
    with np.errstate(all="ignore"):
        s = q @ np.swapaxes(k, -1, -2) * scale
        p = np.exp(s) if choices.get("p") == "no_lse" else np.exp(s - lse[..., None])
    dp = do @ np.swapaxes(v, -1, -2)
    delta = 0.0 if choices.get("delta") == "missing" else (do * o).sum(axis=-1, keepdims=True)
    p_dq, p_dkdv = np.where(visited_dq & masked, p, 0.0), np.where(visited_dkdv & masked, p, 0.0)
    ds_dq, ds_dkdv = p_dq * (dp - delta), p_dkdv * (dp - delta)
    which = choices.get("scale")
    dq = ds_dq @ k * (1.0 if which in ("dq", "both") else scale)
    dk = np.swapaxes(ds_dkdv, -1, -2) @ q * (1.0 if which in ("dk", "both") else scale)
    dv = np.swapaxes(p_dkdv, -1, -2) @ do
    return dq, dk, dv


BACKWARD_SWITCHES = [
    Switch("scale", "scaling", {
        "dk": "dK was not multiplied by the scale: S = Q K^T * scale, so dK = dS^T Q * scale",
        "dq": "dQ was not multiplied by the scale: S = Q K^T * scale, so dQ = dS K * scale",
        "both": "the backward left out the scale: S = Q K^T * scale, so dQ = dS K * scale and dK = dS^T Q * scale"}),
    Switch("delta", "softmax backward", {
        "missing": "softmax's backward left out D = rowsum(dO * O): dS = P * (dP - D[:, None]), not P * dP"}),
    Switch("p", "recomputed weights", {
        "no_lse": "the weights were recomputed as exp(s) without the log-sum-exp: p = exp(s - LSE[:, None]) is "
                  "softmax's value",
        "unmasked": "the recomputed weights were not masked causally inside the tiles: a key j > query i must get "
                    "p = 0 in the backward too"}),
    Switch("lo", "causal tiles", {
        "diagonal_skipped": "dK and dV's loop over query tiles starts one tile late: the query tile that holds the "
                            "key tile's first key (start_n // BLOCK_M * BLOCK_M) sees those keys too"}),
]


def backward_switches(causal: bool):
    return [s if causal else s.without("unmasked") for s in BACKWARD_SWITCHES if causal or s.name != "lo"]


# ---------------------------------------------------------------- k05, k06: decoding in splits

def online(scores, values, choices: Choices = NONE):
    """One split's partial result from its scores (..., n) and values (..., n, d): (o, lse), 0 and -inf for a split
    with no key. Choices: "partial_lse" ("no_max": log(l)); "empty" ("nan": 0 / 0 where a split saw no key);
    "partial_o" ("unnormalised": acc, not divided by l)."""
    scores = np.asarray(scores, dtype=np.float64)
    with np.errstate(all="ignore"):
        top = scores.max(axis=-1, initial=-np.inf)
        shift = np.where(np.isfinite(top), top, 0.0)
        e = np.exp(scores - shift[..., None])
        total = e.sum(axis=-1)
        o = (e[..., None] * values).sum(axis=-2)
        o = o if choices.get("partial_o") == "unnormalised" else o / total[..., None]
        lse = {None: np.log(total) + top, "no_max": np.log(total)}[choices.get("partial_lse")]
        if choices.get("empty") != "nan":
            o = np.where(total[..., None] > 0, o, 0.0)
            lse = np.where(total > 0, lse, -np.inf)
    return o, lse


def combine(partial_o, partial_lse, choices: Choices = NONE):
    """The splits' partial results (..., S, d) and (..., S) combined by their log-sum-exps: (o, lse). Choices:
    "combine" ("average": the mean of the partial outputs; "unnormalised": sum_s w_s o_s, not divided by sum_s w_s;
    "no_max": w_s = exp(lse_s), overflowing in float32 above ~88)."""
    po, pl = np.asarray(partial_o, dtype=np.float64), np.asarray(partial_lse, dtype=np.float64)
    how = choices.get("combine")
    with np.errstate(all="ignore"):
        if how == "average":
            return po.mean(axis=-2), np.log(np.exp(pl).sum(axis=-1))
        top = np.zeros(pl.shape[:-1]) if how == "no_max" else pl.max(axis=-1)
        w = _exp32(pl - top[..., None]) if how == "no_max" else np.exp(pl - top[..., None])
        total = w.sum(axis=-1)
        weighted = (w[..., None] * po).sum(axis=-2)
        o = weighted if how == "unnormalised" else weighted / total[..., None]
        return o, top + np.log(total)


COMBINE_SWITCHES = [Switch("combine", "combining splits", {
    "average": "the splits were averaged: each split's output is normalised over its own keys only, so weigh it by "
               "its share of the whole denominator, w_s = exp(lse_s - max lse) (o = sum w_s o_s / sum w_s)",
    "unnormalised": "the weighted outputs were not divided by the sum of the weights: o = sum w_s o_s / sum w_s",
    "no_max": "the splits' weights were exp(lse_s) without subtracting the largest lse first: exp overflows for a "
              "lse above about 88 (inf / inf is NaN); w_s = exp(lse_s - max_s lse_s)"})]


def split_bounds(t: int, num_splits: int, choices: Choices = NONE):
    """[(start, end)] of each split's keys: chunk = cdiv(T, num_splits) ("floor": T // num_splits, which leaves
    the last T % num_splits keys to no split)."""
    chunk = t // num_splits if choices.get("bounds") == "floor" else cdiv(t, num_splits)
    return [(min(s * chunk, t), min((s + 1) * chunk, t)) for s in range(num_splits)]


def decode_partials(q, k, v, num_splits: int, block_n: int, choices: Choices = NONE):
    """Stage k05's split kernel: (partial_o (b, h, S, d), partial_lse (b, h, S)). Choices: "bounds" ("floor";
    "tile_end": keys masked at T instead of at the split's end, so each split's last tile reaches into the next
    split's keys), "scale" ("none"), "partial_lse", "empty", "partial_o" (see ``online``)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    t, d = k.shape[-2], k.shape[-1]
    scores = (k @ q[..., None])[..., 0] * (1.0 if choices.get("scale") == "none" else 1 / np.sqrt(d))  # (b, h, T)
    outs, lses = [], []
    for start, end in split_bounds(t, num_splits, choices):
        if choices.get("bounds") == "tile_end" and end > start:
            end = min(t, start + cdiv(end - start, block_n) * block_n)
        o, lse = online(scores[..., start:end], v[..., start:end, :], choices)
        outs.append(o)
        lses.append(lse)
    return np.stack(outs, axis=-2), np.stack(lses, axis=-1)


def decode(q, k, v, num_splits: int, block_n: int, choices: Choices = NONE):
    """Stage k05's flash_decode: the partials, combined. -> o (b, h, d)."""
    return combine(*decode_partials(q, k, v, num_splits, block_n, choices), choices)[0]


PARTIAL_SWITCHES = [
    Switch("bounds", "splitting the keys", {
        "floor": "the splits hold T // num_splits keys each, so the last T % num_splits keys belong to none: "
                 "chunk = cdiv(T, num_splits)",
        "tile_end": "a split's keys were masked at T, not at the split's own end: its last tile runs into the next "
                    "split's keys, which are counted twice; mask keys >= end"}),
    Switch("partial_lse", "log-sum-exp", {
        "no_max": "the split's log-sum-exp was stored without its max: lse = m_i + log(l_i)"}),
    Switch("empty", "splitting the keys", {
        "nan": "a split with no key stored 0 / 0 = NaN (and poisons the combine, 0 * NaN = NaN): store o = 0 and "
               "lse = -inf when l_i = 0"}),
    Switch("partial_o", "online softmax", {
        "unnormalised": "each split stored its accumulator without dividing it by its running sum: o_s = acc / l_i "
                        "(the combine weighs normalised outputs)"}),
    Switch("scale", "scaling", {"none": not_scaled("d")}),
]
DECODE_SWITCHES = PARTIAL_SWITCHES + COMBINE_SWITCHES


def paged_keys(k_pool, v_pool, tables, lens, r: int, choices: Choices = NONE):
    """The keys and values (h, n, d) sequence ``r`` attends to in a paged cache, and n, as a kernel's choices read
    them. Choices: "table" ("logical": block j read as physical block j; "first_row": every sequence reads row 0 of
    the table), "length" ("whole_blocks": the slots past seq_len of the last block count too; "first": every
    sequence takes seq_lens[0])."""
    k_pool, v_pool = (np.asarray(a, dtype=np.float64) for a in (k_pool, v_pool))
    page = k_pool.shape[2]
    n = int(lens[0] if choices.get("length") == "first" else lens[r])
    held = cdiv(n, page)
    row = np.asarray(tables[0 if choices.get("table") == "first_row" else r])[:held]
    blocks = np.arange(held) if choices.get("table") == "logical" else row.astype(int)
    keys, values = (pool[blocks].transpose(1, 0, 2, 3).reshape(pool.shape[1], -1, pool.shape[3])
                    for pool in (k_pool, v_pool))
    length = held * page if choices.get("length") == "whole_blocks" else n
    return keys[:, :length], values[:, :length], length


def paged_partials(q, k_pool, v_pool, tables, lens, num_splits: int, choices: Choices = NONE):
    """Stage k06's paged kernel: (partial_o (b, h, S, d), partial_lse (b, h, S)), split s of sequence r holding its
    logical blocks [s * per_split, (s + 1) * per_split), per_split = cdiv(cdiv(seq_len, page), S)."""
    q = np.asarray(q, dtype=np.float64)
    page = np.shape(k_pool)[2]
    outs, lses = [], []
    for r in range(q.shape[0]):
        keys, values, n = paged_keys(k_pool, v_pool, tables, lens, r, choices)
        scale = 1.0 if choices.get("scale") == "none" else 1 / np.sqrt(q.shape[-1])
        scores = (keys @ q[r][..., None])[..., 0] * scale  # (h, n)
        per = cdiv(cdiv(int(lens[0] if choices.get("length") == "first" else lens[r]), page), num_splits)
        cut = [slice(s * per * page, (s + 1) * per * page) for s in range(num_splits)]
        parts = [online(scores[:, at], values[:, at], choices) for at in cut]
        outs.append(np.stack([o for o, _ in parts], axis=-2))
        lses.append(np.stack([lse for _, lse in parts], axis=-1))
    return np.stack(outs), np.stack(lses)


def paged(q, k_pool, v_pool, tables, lens, num_splits: int, choices: Choices = NONE):
    """Stage k06's paged_decode: o (b, h, d)."""
    return combine(*paged_partials(q, k_pool, v_pool, tables, lens, num_splits, choices))[0]


PAGED_SWITCHES = [
    Switch("table", "block table", {
        "logical": "logical block j was read as physical block j: look it up, block_tables[r, j], where the "
                   "sequence's j-th block lives in the pool",
        "first_row": "every sequence read the block table's first row: row r of block_tables holds sequence r's "
                     "blocks (TABLES + r * stride)"}),
    Switch("length", "sequence lengths", {
        "whole_blocks": "the slots past the sequence's length in its last block were not masked: they hold "
                        "nothing yet, or a freed sequence's keys; mask positions j * block_size + slot >= seq_len",
        "first": "every sequence took the first sequence's length: load seq_lens[r], each sequence's own"}),
]
