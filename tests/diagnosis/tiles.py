"""Tiled attention with an online softmax (FlashAttention's algorithm): tiles of block_size queries x block_size keys,
a running max per query row, a running sum and an accumulator rescaled by exp(old max - new max) whenever the max
grows, acc / row_sum at the end.

``tiled`` is the algorithm in NumPy with its switches (the running max carried or not, the sum and the accumulator
rescaled or not, the scale, where the causal diagonal lies in a tile, a row with every score masked so far); the
diagnoser searches them on a failed check of a learner's tiled function (``TiledFunction``) and probes the function:
which keys each query takes (its weights exposed: the values the identity), whether its weights sum to 1 (every
value 1: the output must be 1, and which side it errs on says whether row_sum or acc missed its rescaling), what a
single tile gives (right with one tile, wrong with several: the mistake is in how tiles are combined), and what
very large scores give (an exp that overflows).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from . import attention as A
from .explain import Evidence, Probed, Said, Searched
from .findings import Finding
from .probes import ExposedWeights, weight_findings
from .search import Switch

MECHANISM = "online softmax"
MAX_NOT_CARRIED = ("the running max was not carried across tiles: the new max must be the larger of row_max and the "
                   "tile's max; with the tile's max alone, exp(old max - new max) overflows when a later tile's "
                   "scores are much smaller (very large logits)")
SUM_STALE = ("the running sum row_sum was not rescaled by exp(old max - new max) when the max changed: "
             "row_sum * correction + the tile's sum")
ACC_STALE = ("the accumulator acc was not rescaled by exp(old max - new max) when the max changed: "
             "acc * correction + p @ v")
INVERTED_CORRECTION = ("the {what} was divided by the correction exp(old max - new max) where it must be multiplied "
                       "by it ({name} * correction + the tile's part)")
NAN_GUARD = ("a row whose scores are all masked so far (a tile of keys after it, visited before any key it sees) has "
             "running max -inf, and exp(-inf - (-inf)) is NaN: subtract 0 there instead")
TOP_LEFT = ("with is_causal key j takes part for query i exactly when j <= i, both counted from 0 whatever n_q and "
            "n_kv are (top-left, as F.scaled_dot_product_attention(is_causal=True) aligns it): in every tile compare "
            "the global positions, q_start + row against k_start + column")
NAN = ("NaN where standard attention has none, though the queries that give numbers take the right keys: a row "
       "whose scores are all masked so far has running max -inf, and exp(-inf - (-inf)) is NaN (subtract 0 there "
       "instead); inf / inf is NaN too, after an exp overflowed")
# NaN with nothing masked: an inf or a 0 made on the way, which more than one step of the online softmax can make.
OVERFLOW = ("NaN where standard attention has none, with nothing masked: an inf or a 0 / 0 was made on the way",
            ("if no max was subtracted before the exp: exp of a large score is inf, and inf / inf is NaN; take every "
             "exp relative to the running max",
             "if a correction is applied the wrong way round: the old sum and accumulator are multiplied by "
             "exp(old max - new max) (at most 1), never divided by it nor multiplied by exp(new max - old max), "
             "which grows without bound"))

MAX_FROM_ZERO = ("the running max started at 0 instead of -inf: a row whose scores are all far below 0 keeps 0 as its "
                 "shift, so its exps underflow (to 0, and the row to 0 / 0 = NaN, when every score is below about "
                 "-100); start the running max at -inf")
ONLINE = [Switch("max", MECHANISM, {"tile_only": MAX_NOT_CARRIED, "starts_zero": MAX_FROM_ZERO}),
          Switch("sum", MECHANISM, {"stale": SUM_STALE,
                                    "divided": INVERTED_CORRECTION.format(what="running sum", name="row_sum")}),
          Switch("acc", MECHANISM, {"stale": ACC_STALE,
                                    "divided": INVERTED_CORRECTION.format(what="accumulator", name="acc")}),
          Switch("guard", MECHANISM, {"missing_first": NAN_GUARD})]
SCALE = Switch("scale", "scaling", {"none": A.not_scaled("d"),
                                    "no_sqrt": "the scores were divided by d: divide by sqrt(d)",
                                    "times": "the scores were multiplied by sqrt(d): divide by it"})


def tile_switches(n_q: int, n_kv: int, is_causal: bool) -> list[Switch]:
    """The choices of a tiled computation that a case of these sizes can show."""
    if not is_causal:
        return [*ONLINE, SCALE, A.CAUSAL_ADDED.plus({"added": "a causal mask was applied although is_causal=False"})]
    mask = A.CAUSAL.only("none", "diagonal", "next").plus({"none": "is_causal was ignored: mask the keys after each "
                                                                   "query"})
    if n_q != n_kv:
        mask = mask.plus({"bottom_right": "the causal mask is aligned bottom-right (query i sees keys j <= i + n_kv - "
                                          "n_q); is_causal aligns it top-left, as F.scaled_dot_product_attention "
                                          "does: j <= i"})
    return [*ONLINE, SCALE, mask]


def standard(q, k, v, is_causal, offset=0):
    """Standard attention in float64: the whole score matrix, a stable softmax per row; with is_causal key j takes
    part for query i when j <= i + offset (0: top-left, as F.scaled_dot_product_attention)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if is_causal:
        s = np.where(np.arange(k.shape[-2])[None, :] <= np.arange(q.shape[-2])[:, None] + offset, s, -np.inf)
    with np.errstate(invalid="ignore"):  # (a row with no key: NaN, as a softmax of -inf everywhere gives)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)) @ v


def carried(running, correction, choice):
    """A running sum or accumulator brought to the new max: times the correction, or as a mistake carries it."""
    return {"stale": running, "divided": running / correction}.get(choice, running * correction)


def tiled(q, k, v, is_causal, block_size, choices: A.Choices = A.NONE):
    """The tiled algorithm in NumPy float32 (query blocks; key blocks left to right, those past the diagonal
    skipped), as ``choices`` make it."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    n_q, n_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = {None: 1 / np.sqrt(d), "none": 1.0, "no_sqrt": 1 / d, "times": np.sqrt(d)}[choices.get("scale")]
    causal = choices.get("causal")
    masked = is_causal and causal != "none" or causal == "added"
    offset = {None: 0, "added": 0, "diagonal": -1, "next": 1, "bottom_right": n_kv - n_q}.get(causal, 0)
    reverse = choices.get("guard") == "missing_first"  # masked tiles visited first, no guard against -inf - -inf
    out = np.empty(q.shape, np.float32)
    with np.errstate(all="ignore"):  # the mistakes overflow on purpose
        for q0 in range(0, n_q, block_size):
            q1 = min(q0 + block_size, n_q)
            qb = q[..., q0:q1, :] * np.float32(scale)
            m = np.full((*qb.shape[:-1], 1), 0.0 if choices.get("max") == "starts_zero" else -np.inf, np.float32)
            total, acc = np.zeros_like(m), np.zeros_like(qb)
            kv_end = min(n_kv, q1) if is_causal and not reverse else n_kv
            starts = range(0, kv_end, block_size)
            for k0 in (reversed(starts) if reverse else starts):
                k1 = min(k0 + block_size, kv_end)
                s = qb @ k[..., k0:k1, :].swapaxes(-1, -2)
                if masked:
                    s = np.where(np.arange(k0, k1)[None, :] > np.arange(q0, q1)[:, None] + offset, -np.inf, s)
                tile_max = s.max(axis=-1, keepdims=True)
                m_new = tile_max if choices.get("max") == "tile_only" else np.maximum(m, tile_max)
                shift = m_new if reverse else np.where(m_new == -np.inf, np.float32(0), m_new)
                p, correction = np.exp(s - shift), np.exp(m - shift)
                total = carried(total, correction, choices.get("sum")) + p.sum(-1, keepdims=True)
                acc = carried(acc, correction, choices.get("acc")) + p @ v[..., k0:k1, :]
                m = m_new
            out[..., q0:q1, :] = acc / total
    return out


# ---------------------------------------------------------------- probes of the learner's function

Tiled = Callable[..., np.ndarray]  # tiled_attention(q, k, v, is_causal=..., block_size=...) -> array


def spans_of(keys) -> str:
    """Key positions (a boolean row) in words: "keys 0..3, 7..9", "no key"."""
    found = np.flatnonzero(keys)
    if found.size == 0:
        return "no key"
    runs = np.split(found, np.flatnonzero(np.diff(found) > 1) + 1)
    return "keys " + ", ".join(f"{r[0]}..{r[-1]}" if r.size > 1 else f"{r[0]}" for r in runs)


def causal_keep(n_q, n_kv, offset=0):
    """True where key j takes part for query i: j <= i + offset (offset 0: top-left aligned, as SDPA)."""
    return np.arange(n_kv)[None, :] <= np.arange(n_q)[:, None] + offset


@dataclass
class TiledFunction:
    """A learner's tiled attention function, ``run(q, k, v, is_causal, block_size)`` giving its output."""

    run: Tiled
    what: str = "your output"

    def evidence(self, q, k, v, is_causal, block_size) -> list[Evidence]:
        n_q, n_kv = np.shape(q)[-2], np.shape(k)[-2]
        weights = cache(lambda: self.exposed(n_q, n_kv, block_size))
        return [Searched(lambda choices: tiled(q, k, v, is_causal, block_size, choices),
                         tile_switches(n_q, n_kv, is_causal), self.what),
                Said(lambda actual: self.misaligned(weights(), n_q, n_kv, block_size, actual) if is_causal else []),
                Said(lambda actual: self.nan(weights(), n_q, n_kv, is_causal, actual)),
                Probed([lambda: self.weights_findings(weights(), n_q, n_kv, is_causal),
                        lambda: self.ones_findings(n_q, n_kv, is_causal, block_size),
                        lambda: self.single_tile_findings(q, k, v, is_causal, block_size),
                        lambda: self.overflow_findings(is_causal, block_size)])]

    def exposed(self, n_q, n_kv, block_size):
        """The learner's causal weights on inputs of ours (the values the identity over the keys: the output IS the
        weights; small random queries and keys, so that every key that takes part gets a weight of about
        1 / (keys taken)), or None when it cannot run or the shape is off."""
        if max(n_q, n_kv) > 256:
            return None
        rng = np.random.default_rng(0)
        q = (rng.normal(size=(1, 1, n_q, n_kv)) * 0.1).astype(np.float32)
        k = (rng.normal(size=(1, 1, n_kv, n_kv)) * 0.1).astype(np.float32)
        v = np.eye(n_kv, dtype=np.float32)[None, None]
        try:
            out = np.asarray(self.run(q, k, v, True, block_size))
        except Exception:  # (the checks of these sizes say what went wrong)
            return None
        return (out[0, 0], q, k) if out.shape == (1, 1, n_q, n_kv) else None

    def misaligned(self, exposed, n_q, n_kv, block_size, actual):
        """The readable rows (no NaN) whose keys are not is_causal's, read as one diagonal in another place."""
        if exposed is None:
            return []
        weights = exposed[0]
        readable = ~np.isnan(weights).any(axis=-1)
        taken, right = np.abs(weights) > 1e-6, causal_keep(n_q, n_kv)
        rows = [i for i in np.flatnonzero(readable) if not np.array_equal(taken[i], right[i])]
        if not rows:
            return []
        said = "; ".join(f"query {i} took {spans_of(taken[i])}, not {spans_of(right[i])}" for i in rows[:2])
        prefixes = all(np.array_equal(taken[i], np.arange(n_kv) < taken[i].sum()) for i in np.flatnonzero(readable))
        if not prefixes:  # (keys missing from the start of a row: no diagonal in the wrong place does that)
            last = np.zeros_like(right)
            for q0 in range(0, n_q, block_size):
                q1 = min(q0 + block_size, n_q)
                end = min(n_kv, q1)
                last[q0:q1, (end - 1) // block_size * block_size:end] = True  # the last key tile those rows visit
            if all(np.array_equal(taken[i], right[i] & last[i]) for i in np.flatnonzero(readable)):
                return [Finding(f"each query's weights come from the last tile of keys it visits only ({said}): what "
                                "the earlier tiles added to row_sum and acc was lost.",
                                ("the correction exp(row_max - new max) was 0 for them: row_max stayed -inf (set "
                                 "row_max = new max after each tile)", "row_sum and acc were restarted for each key "
                                 "tile instead of rescaled and added to"), MECHANISM, "probe", weight=2)]
            return [Finding(f"your causal weights take other keys than is_causal's ({n_q} queries, {n_kv} keys, tiles "
                            f"of {block_size}): {said}.", (), "masking", "probe", weight=2)]
        shift = next((s for s in range(-n_q, n_kv)
                      if s and all(np.array_equal(taken[i], causal_keep(n_q, n_kv, s)[i])
                                   for i in np.flatnonzero(readable))), None)
        if shift is not None:  # one diagonal, in another place
            said = f"query i took the keys j <= i {'+' if shift > 0 else '-'} {abs(shift)} ({said})"
        return [Finding(f"the causal mask is misaligned ({n_q} queries, {n_kv} keys, tiles of {block_size}): {said}.",
                        (TOP_LEFT,), "masking", "probe", weight=2)]

    def nan(self, exposed, n_q, n_kv, is_causal, actual):
        """NaN in the output: the kernel's own (the exposed weights' readable rows take the right keys), or an
        overflow where nothing is masked."""
        if not np.isnan(np.asarray(actual, np.float64)).any():
            return []
        if not is_causal:
            return [Finding(OVERFLOW[0] + ".", OVERFLOW[1], MECHANISM, "probe", weight=3)]
        if exposed is None:
            return []
        weights = exposed[0]
        readable = ~np.isnan(weights).any(axis=-1)
        right = causal_keep(n_q, n_kv)
        rows = np.flatnonzero(readable)
        if rows.size and all(np.array_equal(np.abs(weights[i]) > 1e-6, right[i]) for i in rows):
            return [Finding("", (NAN,), MECHANISM, "probe", weight=3)]
        return []

    def weights_findings(self, exposed, n_q, n_kv, is_causal):
        """The exposed weights' sums and temperature (the keys they take: ``misaligned``)."""
        if exposed is None or not is_causal:
            return []
        weights, q, k = exposed
        scores = (np.asarray(q, np.float64) @ np.asarray(k, np.float64).swapaxes(-1, -2))[0, 0]
        d = q.shape[-1]
        found = weight_findings(ExposedWeights(
            weights, scores, causal_keep(n_q, n_kv), 1 / np.sqrt(d), {"sqrt(d)": np.sqrt(d), "1": 1.0, "d": float(d)},
            {"1": SCALE.wrong["none"], "d": SCALE.wrong["no_sqrt"]}, np.arange(n_q), np.arange(n_kv),
            what="your attention weights",
            unnormalised=(MECHANISM, "the running sum row_sum and the accumulator acc are not kept relative to the "
                                     "same max: rescale both by exp(old max - new max) whenever the max grows")))
        return [f for f in found if f.mechanism != "masking"]  # (which keys: ``misaligned`` reads them)

    def ones_findings(self, n_q, n_kv, is_causal, block_size):
        """Every value 1: the output must be 1 everywhere (the weights sum to 1). Scores that grow along the keys make
        every tile raise the max, so each needs the rescaling: an output below 1 means the sum kept stale terms (it
        missed a rescaling by exp(old max - new max) <= 1), above 1 the accumulator did."""
        if block_size >= n_kv or max(n_q, n_kv) > 4096:
            return []
        d = 4
        u = np.ones(d, np.float32) / np.sqrt(d)
        q = np.broadcast_to(u * 2.0, (1, 1, n_q, d)).astype(np.float32)
        k = (np.linspace(0.0, 3.0, n_kv, dtype=np.float32)[:, None] * u)[None, None].astype(np.float32)
        out = np.asarray(self.run(q, k, np.ones((1, 1, n_kv, d), np.float32), is_causal, block_size), np.float64)
        if out.shape != (1, 1, n_q, d) or not np.all(np.isfinite(out)) or np.allclose(out, 1.0, rtol=1e-4, atol=1e-5):
            return []
        low, high = float(out.min()), float(out.max())
        shows = (f"with every value 1 your output must be 1 (the weights sum to 1); it ranges over "
                 f"{low:.4g}..{high:.4g} when the scores grow from tile to tile (tiles of {block_size}).")
        if high <= 1 + 1e-5:
            return [Finding(shows, (SUM_STALE,), MECHANISM, "probe", weight=2)]
        if low >= 1 - 1e-5:
            return [Finding(shows, (ACC_STALE,), MECHANISM, "probe", weight=2)]
        return [Finding(shows, (), MECHANISM, "probe", weight=2)]

    def single_tile_findings(self, q, k, v, is_causal, block_size):
        """The check's own inputs in a single tile (block_size >= n_q, n_kv): right there and wrong with tiles of
        block_size says the mistake is in how tiles are combined."""
        n = max(np.shape(q)[-2], np.shape(k)[-2])
        if block_size >= n:
            return []
        one = np.asarray(self.run(q, k, v, is_causal, n), np.float64)
        right = standard(q, k, v, is_causal)
        if one.shape != right.shape:
            return []
        if np.allclose(one, right, rtol=1e-4, atol=1e-5):
            return [Finding(f"with a single tile (block_size={n}) your output is right; with tiles of {block_size} it "
                            "is not: the mistake is in how the tiles are combined.",
                            ("the running max is not the larger of row_max and the tile's max",
                             "row_sum or acc is not rescaled by exp(old max - new max) before the tile is added",
                             "a query row visits other tiles than it must, or the diagonal falls elsewhere in them"),
                            MECHANISM, "probe", weight=5)]
        return [Finding(f"even with a single tile (block_size={n}) your output is wrong: the mistake is in what one "
                        "tile computes (its scale, its mask, its softmax), not only in how tiles are combined.", (),
                        MECHANISM, "probe", weight=5)]

    def overflow_findings(self, is_causal, block_size):
        """Scores in the thousands, the largest in the first key tile: every exp must be taken relative to the running
        max, or it overflows."""
        n, d = 3 * block_size if block_size <= 16 else 48, 4
        if block_size >= n:
            return []
        rng = np.random.default_rng(11)
        q = (rng.normal(size=(1, 1, n, d)) * 1e3).astype(np.float32)
        k = (rng.normal(size=(1, 1, n, d)) * np.linspace(1.0, 0.1, n)[:, None]).astype(np.float32)
        v = rng.normal(size=(1, 1, n, d)).astype(np.float32)
        out = np.asarray(self.run(q, k, v, is_causal, block_size), np.float64)
        if out.shape != q.shape or np.all(np.isfinite(out)):
            return []
        moderate = np.asarray(self.run(q / np.float32(1e3), k, v, is_causal, block_size), np.float64)
        if not np.all(np.isfinite(moderate)):
            return []  # (NaN whatever the scores' size: no overflow; the other readings say why)
        return [Finding(f"with scores in the thousands, the largest in the first tile, your output has NaN or inf "
                        f"(tiles of {block_size}), and none with the same queries a thousand times smaller: an exp "
                        "overflowed.",
                        (MAX_NOT_CARRIED, "no max was subtracted before the exp: exp(score) of a score in the "
                                          "thousands is inf; take every exp relative to the running max"),
                        MECHANISM, "probe", weight=3)]
