"""Behavioural probes: properties of the learner's own code, measured by running it again on inputs of the
diagnoser's choosing, each stated in a sentence a student can act on whatever their code looks like.

Probes belong to mechanisms, not stages, so that every stage that uses a mechanism gets them:

- ``weight_findings`` reads a learner's attention weights (exposed: the module run on one-hot tokens whose values
  are those one-hot vectors, or a function given the identity as values) against what they must be: which keys
  each query sees (the future, its own token, a window's true width, keys that must be hidden), rows that sum to
  1 along the right axis, NaN rows, and the temperature the scores were divided by, fitted from the weights.
- ``dependency_findings`` perturbs one token at a time and sees which outputs move: outputs that depend on later
  tokens, on tokens outside a window, or that ignore tokens they must see.
- ``batch_findings``: a batch row that changes another batch row's output.
- ``heads_findings``: permuting the heads' weights must permute nothing in the output (heads are independent).
- ``dtype_findings``: a float64 computation that comes back in float32 (a tensor made with the default dtype).

Each returns findings (``diagnosis.findings``), empty when the evidence says nothing: no hint beats a wrong one.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .attention import WINDOW
from .findings import Finding

TINY = 1e-12  # a weight at or below this is none (float32 keeps weights down to 1e-38; masked ones are exactly 0)


def _tokens(indices) -> str:
    indices = [int(i) for i in indices]
    if len(indices) == 1:
        return f"token {indices[0]}"
    return "tokens " + ", ".join(map(str, indices[:-1])) + f" and {indices[-1]}"


# ---------------------------------------------------------------- attention weights

@dataclass(frozen=True)
class ExposedWeights:
    """A learner's attention weights next to what they must be.

    observed: (..., n_queries, n_keys) the learner's weights; scores: the raw scores q.k the weights come from
    (float64, same shape); allowed: (n_queries, n_keys) which keys each query must see; scale: what the scores
    are multiplied by before the softmax; divisors: {name: value} the divisors a learner could have used
    (``sqrt(head_dim)``, ``sqrt(d_out)`` ...), for naming the one the weights show; query/key positions: the
    tokens' positions (a cached step's queries come after the cached keys); window: the window's width, if any;
    scale_words: {divisor name: the mistake it stands for} (``attention.scaling_switch``'s words); empty_rows:
    what a query with no key must get ("nan" or "zero")."""

    observed: np.ndarray
    scores: np.ndarray
    allowed: np.ndarray
    scale: float
    divisors: Mapping[str, float] = field(default_factory=dict)
    scale_words: Mapping[str, str] = field(default_factory=dict)
    query_positions: np.ndarray | None = None
    key_positions: np.ndarray | None = None
    window: int | None = None
    what: str = "your attention weights"
    empty_rows: str = "nan"
    sink_tokens: int = 0  # keys 0 .. sink_tokens - 1 take part beside a window (StreamingLLM): not part of its width
    causal: bool = True  # False: keys after a query may take part (cross-attention, padding alone): no "future" reading
    # The words of rows that do not sum to 1 where the stage has its own reading of that (an online softmax's):
    # (mechanism, cause); None: a softmax changed after the fact.
    unnormalised: tuple[str, str] | None = None


def weight_findings(w: ExposedWeights) -> list[Finding]:
    observed = np.asarray(w.observed, dtype=np.float64)
    if observed.shape != np.shape(w.scores) or observed.ndim < 2:
        return []
    finite = np.all(np.isfinite(observed), axis=-1)
    negative = np.nan_to_num(observed) < -1e-6
    if np.any(negative) or np.any(np.nan_to_num(observed) > 1 + 1e-4):
        return []  # not attention weights at all: what exposed them is broken, so they say nothing
    allowed = np.broadcast_to(np.asarray(w.allowed, bool), observed.shape)
    nq, nk = observed.shape[-2:]
    qpos = np.arange(nq) + (nk - nq) if w.query_positions is None else np.asarray(w.query_positions)
    kpos = np.arange(nk) if w.key_positions is None else np.asarray(w.key_positions)
    found = _nan_rows(w, observed, finite, allowed, qpos, kpos)
    rows = finite & np.any(allowed, axis=-1)  # rows that can be read
    if not np.any(rows):
        return found
    said = {cause for f in found for cause in f.causes}
    found += [f for f in _support(w, observed, rows, allowed, qpos, kpos)
              if not (f.mechanism == "masking" and any("own position" in c for c in said))]
    found += _sums(w, observed, rows, allowed)
    found += _temperature(w, observed, rows, allowed)
    return found


def _nan_rows(w, observed, finite, allowed, qpos, kpos):
    bad = ~finite & np.any(allowed, axis=-1)
    if not np.any(bad):
        return []
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    shows = f"{w.what} of query {qpos[index[-1]]} are NaN, although it must see {_tokens(kpos[allowed[index]])}."
    cause = ("a softmax gives NaN where every score of its row is -inf (every key masked: 0 / 0), or where a score "
             "is inf or NaN (an overflow, or a NaN made earlier); and a -inf put into the weights after the softmax "
             "(masked_fill(..., -inf) on the weights) gives NaN when the weights meet the values (-inf and +inf "
             "summed): mask the scores before the softmax, or fill masked weights with 0")
    own = allowed & (qpos[:, None] == kpos[None, :]) & finite[..., None]  # readable rows' own tokens
    later = finite[..., None] & (np.nan_to_num(observed) > TINY) & (kpos[None, :] > qpos[:, None])
    if np.any(own) and np.all(observed[own] <= TINY) and not (w.causal and np.any(later)):
        cause = ("the mask hides each token's own position too (torch.triu(..., diagonal=0), or j < i): the first "
                 "query is left with no key at all, so its softmax gives NaN, and every other query ignores its own "
                 "token; mask the strict upper triangle, torch.triu(..., diagonal=1)")
    return [Finding(shows, (cause,), "masking", "probe", weight=5)]


def _support(w, observed, rows, allowed, qpos, kpos):
    seen = (observed > TINY) & rows[..., None]
    extra = seen & ~allowed
    missing = ~seen & allowed & rows[..., None]
    found = []
    later = extra & (kpos[None, :] > qpos[:, None]) & w.causal
    if np.any(later):
        index = tuple(int(i) for i in np.argwhere(later)[0])
        i, j = index[-2], index[-1]
        found.append(Finding(
            f"query {qpos[i]} puts weight {observed[index]:.3g} on key {kpos[j]}, a later token: the output depends "
            "on future tokens.",
            ("the causal mask lets a query see keys after it: it is missing, hides the wrong side, or starts too high "
             "(only keys j <= i may take part: mask the strict upper triangle, torch.triu(..., diagonal=1))",),
            "masking", "probe", weight=1))
    own = allowed & rows[..., None] & (kpos[None, :] == qpos[:, None]) & w.causal  # each readable row's own key
    diagonal = missing & own
    # A weight can underflow to 0 when scores are extreme: a key is said to be hidden only when every row hides it
    # the same way (its own token in every row).
    if np.any(own) and np.array_equal(diagonal, own) and not np.any(later):
        index = tuple(int(i) for i in np.argwhere(diagonal)[0])
        found.append(Finding(
            f"query {qpos[index[-2]]} puts no weight on its own token (key {qpos[index[-2]]}): each token must "
            "attend to itself and the tokens before it.",
            ("the mask hides each token's own position too (torch.triu(..., diagonal=0), or j < i); mask the strict "
             "upper triangle, torch.triu(..., diagonal=1)",),
            "masking", "probe", weight=2))
    back = (qpos[:, None] - kpos[None, :])
    if w.window is not None and not np.any(later):  # (a width is read where no query sees the future)
        banded = seen & (back >= 0) & (kpos[None, :] >= w.sink_tokens)  # (sink tokens are not the window's)
        reach = np.where(banded, back + 1, 0).max(axis=-1)  # tokens each query sees, itself included
        full = rows & (qpos >= w.window + w.sink_tokens)  # queries with at least window tokens up to them
        if np.any(full):
            measured = sorted({int(r) for r in reach[full]})
            if measured != [w.window]:
                found.append(Finding(
                    f"the queries that have at least window={w.window} tokens up to them see the last "
                    f"{' or '.join(map(str, measured))} tokens (themselves included), not window={w.window}.",
                    ({w.window + 1: WINDOW.wrong["plus_one"], w.window - 1: WINDOW.wrong["minus_one"]}[measured[0]]
                     if measured in ([w.window + 1], [w.window - 1]) else
                     "the window's width is not the window argument: key j takes part when 0 <= i - j < window",),
                    "masking", "probe", weight=3))
    elif _every_row_misses(missing & (back > 0), allowed & rows[..., None] & (back > 0)) and not np.any(diagonal):
        index = tuple(int(i) for i in np.argwhere(missing & (back > 0))[0])
        found.append(Finding(
            f"query {qpos[index[-2]]} puts no weight on key {kpos[index[-1]]}, an earlier token it must see.",
            ("the mask hides keys that must take part: check which side of the diagonal it covers and its offset",),
            "masking", "probe", weight=3))
    earlier_extra = extra & (back >= 0)
    if np.any(earlier_extra) and w.window is None:
        index = tuple(int(i) for i in np.argwhere(earlier_extra)[0])
        found.append(Finding(
            f"query {qpos[index[-2]]} puts weight {observed[index]:.3g} on key {kpos[index[-1]]}, which the mask "
            "must hide.",
            ("a key that must not take part was left unmasked",), "masking", "probe", weight=3))
    return found


def _every_row_misses(missing, could):
    """Whether every row that has keys of this kind (``could``) misses at least one of them."""
    has = np.any(could, axis=-1)
    return bool(np.any(has)) and bool(np.all(np.any(missing, axis=-1)[has]))


def _sums(w, observed, rows, allowed):
    if w.empty_rows == "sinks":
        return []
    sums = observed.sum(axis=-1)
    off = rows & (np.abs(sums - 1) > 1e-3)
    empty = off & (np.abs(sums) <= TINY)  # rows with no weight at all: every key of theirs masked
    if np.any(empty):
        index = tuple(int(i) for i in np.argwhere(empty)[0])
        qpos = np.arange(observed.shape[-2])
        return [Finding(f"query {qpos[index[-1]]} puts no weight on any key, though it must see some: all of its "
                        "row is masked.", ("the mask hides keys that must take part: check its convention (which of "
                                           "True and False means masked out) and its side of the diagonal",),
                        "masking", "probe", weight=4)]
    if not np.any(off):
        return []
    index = tuple(int(i) for i in np.argwhere(off)[0])
    finite = np.where(np.isfinite(observed), observed, 0)
    nq, nk = observed.shape[-2:]
    if nq == nk and np.allclose(finite.sum(axis=-2), 1, atol=1e-3):
        return [Finding(f"{w.what} sum to 1 down each column (over the queries), not along each row: row "
                        f"{index[-1]} sums to {sums[index]:.4g}.",
                        ("softmax over the wrong dimension, the query axis (dim=-2: dim 0 of one table of scores, dim "
                         "1 of a batch); each query's weights over the keys must sum to 1, so use dim=-1",), "softmax",
                        "probe", weight=4)]
    for axis in range(observed.ndim - 2):  # a batch's (or heads') axis
        if observed.shape[axis] > 1 and np.allclose(finite.sum(axis=axis), 1, atol=1e-3):
            return [Finding(f"{w.what} sum to 1 across axis {axis} (over the {observed.shape[axis]} tables of a "
                            f"batch), not along each row: row {index[-1]} sums to {sums[index]:.4g}.",
                            (f"the softmax (or its sum) ran over dim {axis}, a batch axis: take it over the keys, "
                             "dim=-1",), "softmax", "probe", weight=4)]
    mechanism, cause = w.unnormalised or ("softmax", "the weights were changed after the softmax without being "
                                          "renormalised (masked after the softmax, say), or they are not a softmax "
                                          "over the keys")
    return [Finding(f"{w.what} of a query do not sum to 1: row {index[-1]} sums to {sums[index]:.4g}.",
                    (cause,), mechanism, "probe", weight=6)]


def _fit(scores, observed, use):
    """The factor f and the residual of log w = f * scores + a constant per row, over the entries ``use``."""
    xs, ys = [], []
    for index in np.argwhere(np.any(use, axis=-1)):
        index = tuple(index)
        keep = use[index]
        if keep.sum() < 2:
            continue
        x, y = scores[index][keep], np.log(observed[index][keep])
        xs.append(x - x.mean())
        ys.append(y - y.mean())
    if not xs:
        return None
    x, y = np.concatenate(xs), np.concatenate(ys)
    if np.sum(x * x) < 1e-12:
        return None
    factor = float(np.sum(x * y) / np.sum(x * x))
    residual = np.sqrt(np.mean((y - factor * x) ** 2))
    good = residual <= 1e-3 * max(1.0, np.sqrt(np.mean(y ** 2))) and factor > 0
    return factor if good else None


def _temperature(w, observed, rows, allowed):
    """The factor the learner's weights show the scores were multiplied by: for each readable row, log w is that
    factor times the scores plus a constant, over the keys the row gives weight to."""
    scores = np.asarray(w.scores, dtype=np.float64)
    use = rows[..., None] & allowed & (observed > 1e-30)
    if _fit(scores, observed, use) is None and scores.shape[-1] == scores.shape[-2]:
        transposed = _fit(np.swapaxes(scores, -1, -2), observed, use)
        if (transposed is not None and abs(transposed / w.scale - 1) < 1e-3
                and _reproduces(np.swapaxes(scores, -1, -2) * w.scale, observed, rows, allowed)):
            # (the weights are those of the transposed scores; said as the effect: queries and keys swapped anywhere
            # before the product, their projections' weights included, give the same numbers)
            return [Finding(f"{w.what} are the softmax of the transposed scores: row i holds every query's score "
                            "against key i, not query i's scores against every key.",
                            ("keys @ queries^T: the scores are transposed (row i must hold query i's scores, "
                             "queries @ keys.transpose(...))",), "scores", "probe", weight=4)]
    factor = _fit(scores, observed, use)
    if factor is None:
        return []  # not a softmax of these scores at one temperature: another probe or the search says why
    if abs(factor / w.scale - 1) < 1e-3:
        return []  # the right temperature
    if not _reproduces(scores * factor, observed, rows, allowed):
        # A value fitted from the outputs is a cause only where the reference with it gives the outputs back: here
        # no single divisor does (a scale that compounds from tile to tile, weights rounded on the way, ...).
        return [Finding(f"{w.what} are close to a softmax of the scores at some temperature, but no single divisor "
                        f"of the scores gives them (the nearest, {1 / factor:.4g}, does not reproduce them within the "
                        "check's tolerance): they are not the softmax of the scores at any single temperature.", (),
                        "scaling", "probe", weight=4)]
    divisor = 1 / factor
    names = [name for name, value in w.divisors.items() if abs(value / divisor - 1) < 2e-3]
    expected = next((name for name, value in w.divisors.items() if abs(value * w.scale - 1) < 1e-9), None)
    shows = (f"{w.what} are softmax(scores / {divisor:.4g}) over the keys each query sees"
             + (f", and {divisor:.4g} = {' = '.join(names)}" if names else "")
             + f"; the scores must be divided by {expected or f'{1 / w.scale:.4g}'}"
             + (f" = {1 / w.scale:.4g}" if expected else "") + ".")
    # (a divisor's words: one mistake, or several that give the same divisor)
    causes = tuple(dict.fromkeys(c for name in names if name in w.scale_words for c in (
        (w.scale_words[name],) if isinstance(w.scale_words[name], str) else w.scale_words[name])))
    if not causes:
        causes = _related_scale(divisor, 1 / w.scale, expected or f"{1 / w.scale:.4g}")
    # The reference with this divisor gives the learner's weights (checked above): the divisor is reproduced, and so
    # is the mistake that makes it where one is named.
    return [Finding(shows, causes, "scaling", "listed", weight=4)]


def _reproduces(scaled, observed, rows, allowed, rtol=1e-4, atol=1e-6) -> bool:
    """Whether the softmax of ``scaled`` scores over the allowed keys gives the ``observed`` weights on every readable
    row (what makes a fitted temperature the learner's, not a near one)."""
    masked = np.where(allowed, scaled, -np.inf)
    masked = masked - np.max(masked, axis=-1, keepdims=True)
    weights = np.exp(masked)
    weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return bool(np.allclose(np.where(rows[..., None], weights, 0), np.where(rows[..., None], observed, 0),
                            rtol=rtol, atol=atol))


def _related_scale(divisor: float, right: float, name: str) -> tuple[str, ...]:
    """What a divisor the weights show is, by how it relates to the right one (``right``, called ``name``) when no
    size of the stage's names it: 1, the right one's inverse or its square."""
    def near(a, b):
        return abs(a / b - 1) < 2e-3

    if near(divisor, 1.0):
        return (f"the scores were not scaled: divide them by {name} before the softmax",)
    if near(divisor, 1 / right):
        return (f"the scores were multiplied by {name} instead of divided by it (x ** -0.5 is already the inverse "
                "square root: multiply by it, or divide by x ** 0.5)",)
    if near(divisor, right ** 2):
        return (f"the scores were divided by {name} squared: divide by the square root ({name} = {right:.4g})",)
    return (f"the scores were divided by {divisor:.4g} where the stage divides them by {name}: check which width the "
            "scale is taken from",)


# ---------------------------------------------------------------- outputs that depend on inputs

Run = Callable[[np.ndarray], np.ndarray]


def _moved(a, b, rtol=1e-4, atol=1e-5):
    """Per row (axis -2 after the leading ones): whether ``b`` differs from ``a``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = ~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return diff.reshape(diff.shape[0], diff.shape[1], -1).any(axis=-1)  # (b, tokens)


# What lets a token's output depend on later tokens, in attention (a mechanism may say it in its own words).
FUTURE = ("the causal mask lets a query see keys after it: it is missing, hides the wrong side, or starts too high "
          "(only keys j <= i may take part: mask the strict upper triangle, torch.triu(..., diagonal=1))",
          "tokens are mixed after the attention: a view or reshape that interleaves the token axis with another "
          "(merging the heads without transpose(1, 2) first, say)")


def dependency_findings(run: Run, x, may_see: np.ndarray, *, what="your output", token_axis=1) -> list[Finding]:
    """Perturb each token of ``x`` (b, T, ...) in turn and see which tokens' outputs move. ``may_see``: (T, T)
    bool, which tokens each token's output may depend on (a token always depends on itself)."""
    x = np.asarray(x)
    t = x.shape[token_axis]
    try:
        base = np.asarray(run(x))
    except Exception:
        return []
    if base.ndim < 2 or base.shape[:2] != x.shape[:2]:
        return []
    depends, exact = np.zeros((t, t), bool), np.zeros((t, t), bool)
    rng = np.random.default_rng(1234)
    for j in range(t):
        changed = x.copy()
        changed[:, j] = changed[:, j] + rng.normal(size=changed[:, j].shape).astype(x.dtype)
        try:
            after = np.asarray(run(changed))
        except Exception:
            return []
        depends[:, j] = _moved(base, after).any(axis=0)
        exact[:, j] = _moved(base, after, rtol=0, atol=0).any(axis=0)
    return dependency_words(depends, may_see, what=what, exact=exact)


def one_call_dependency_findings(run: Run, x, may_see: np.ndarray, *, what="your output", must_see: bool = True,
                                 future: str | tuple[str, ...] = FUTURE, mechanism: str = "masking") -> list[Finding]:
    """``dependency_findings`` in one call of the learner's code: batch row 0 of ``x`` (1, T, ...) as given, and one
    more row per token with that token perturbed (the rows of a batch are independent: ``batch_findings`` says
    where they are not). ``must_see``: whether every token ``may_see`` allows must move the output (False where a
    module chooses among them, as a top-k selection does)."""
    x = np.asarray(x)[:1]
    t = x.shape[1]
    rng = np.random.default_rng(1234)
    rows = [x[0]]
    for j in range(t):
        changed = x[0].copy()
        changed[j] = changed[j] + rng.normal(size=changed[j].shape).astype(x.dtype)
        rows.append(changed)
    try:
        out = np.asarray(run(np.stack(rows)))
    except Exception:
        return []
    if out.ndim < 2 or out.shape[:2] != (t + 1, t):
        return []
    depends, exact = np.zeros((t, t), bool), np.zeros((t, t), bool)
    for j in range(t):
        depends[:, j] = _moved(out[:1], out[j + 1:j + 2]).any(axis=0)
        exact[:, j] = _moved(out[:1], out[j + 1:j + 2], rtol=0, atol=0).any(axis=0)
    return dependency_words(depends, may_see, what=what, must_see=must_see, future=future, mechanism=mechanism,
                            exact=exact)


def dependency_words(depends: np.ndarray, may_see: np.ndarray, *, what="your output", must_see: bool = True,
                     future: str | tuple[str, ...] = FUTURE, mechanism: str = "masking",
                     exact: np.ndarray | None = None) -> list[Finding]:
    """What a (T, T) matrix of dependencies shows (``depends[i, j]``: token i's output moved when token j changed,
    beyond float noise; ``exact``: it changed at all, default ``depends``), against ``may_see`` (which tokens each
    token's output may depend on); ``future``: what lets a token's output depend on later tokens in the mechanism at
    hand (a causal mask's mistakes by default), ``mechanism`` its name (a searched cause of that mechanism takes the
    place of these generic ones: ``explain.reconcile``)."""
    t = depends.shape[0]
    exact = depends if exact is None else exact
    found = []
    may = np.asarray(may_see, bool) | np.eye(t, dtype=bool)
    later = depends & ~may & np.triu(np.ones((t, t), bool), 1)
    if np.any(later):
        i, j = (int(v) for v in np.argwhere(later)[0])
        found.append(Finding(
            f"the output of token {i} changes when token {j} changes, a later token: {what} depends on future "
            "tokens.", (future,) if isinstance(future, str) else tuple(future), mechanism, "probe", weight=1))
    other = depends & ~may & ~np.triu(np.ones((t, t), bool), 1)
    if np.any(other):
        i, j = (int(v) for v in np.argwhere(other)[0])
        found.append(Finding(f"the output of token {i} changes when token {j} changes, a token it must not see.",
                             ("a key that must be masked for this query takes part",), mechanism, "probe", weight=2))
    # (a key left out of a softmax gives exactly the same output; one whose weight is merely tiny may move it below
    # the tolerance: only outputs that did not move at all count as ignoring a token)
    ignored = ~exact & may & ~np.eye(t, dtype=bool)
    if must_see and np.any(ignored):
        i, j = (int(v) for v in np.argwhere(ignored)[0])
        found.append(Finding(f"the output of token {i} does not change when token {j} changes, though token {i} "
                             f"must see token {j}.",
                             ("a key that must take part was masked (or its weight is lost)",
                              "tokens are mixed after the attention: a view or reshape that interleaves the token axis "
                              "with another"), mechanism, "probe", weight=3))
    return found


def batch_findings(run: Run, x, *, what="your output") -> list[Finding]:
    """Change batch row 0 only: no other row's output may move."""
    x = np.asarray(x)
    if x.shape[0] < 2:
        return []
    changed = x.copy()
    changed[0] = changed[0] + np.random.default_rng(4321).normal(size=changed[0].shape).astype(x.dtype)
    try:
        before, after = np.asarray(run(x)), np.asarray(run(changed))
    except Exception:
        return []
    if before.shape != after.shape or before.shape[0] != x.shape[0]:
        return []
    moved = _moved(before, after).any(axis=-1)
    if not moved[1:].any():
        return []
    row = 1 + int(np.argmax(moved[1:]))
    return [Finding(f"{what} for batch row {row} changed when only batch row 0's inputs changed: the rows of a batch "
                    "are mixed.",
                    ("an operation runs across the batch axis: a softmax or sum over dim=0 (or over every entry), or "
                     "a view/reshape that mixes the batch axis with another; keep b as the first axis throughout",),
                    "batching", "probe", weight=1)]


# (What makes heads depend on each other: the effect the probe measures has several causes, none of which it sees.)
SPLIT_HEADS = ("swapping two heads' weights (their rows of W_query, W_key and W_value, and their columns of out_proj) "
               "changed {what}: the heads are not computed each from its own features.",
               ("the split into heads takes a head's features from several heads (a view straight to (b, num_heads, "
                "num_tokens, head_dim) without transpose), or the heads are merged back in another order than they "
                "were split (a view without transpose(1, 2) first)",
                "a fused projection (one layer for queries, keys and values) is split in another layout than its "
                "weight was made in: per head [q | k | v] where it holds [all q | all k | all v], or the other way",
                "a tensor of one row per batch row or per token (a padding mask, a table of positions, a gate) "
                "broadcast onto the heads axis: (b, 1, n) against (b, num_heads, n_q, n_kv) puts b on the heads "
                "axis; give it the axes it means, mask[:, None, None, :]"))
HEAD_MODULES = ("swapping the weights of heads 0 and 1 did not just swap their blocks of {what}: the output is not "
                "the heads' outputs side by side, in the order of self.heads.",
                ("the heads' outputs were joined in another order or along another axis: torch.cat([head(x) for head "
                 "in self.heads], dim=-1)",))


def heads_findings(run_permuted: Callable[[], tuple[np.ndarray, np.ndarray]], *, what="your output",
                   words: tuple[str, tuple[str, ...]] = SPLIT_HEADS) -> list[Finding]:
    """``run_permuted()``: the output with the heads' weights as given, and what independent heads give with two
    heads swapped (the same output, or its blocks swapped back): they must be equal. ``words``: what the evidence
    and its cause are called for this kind of module."""
    try:
        before, after = run_permuted()
    except Exception:
        return []
    before, after = np.asarray(before), np.asarray(after)
    if before.shape != after.shape or np.allclose(before, after, rtol=1e-4, atol=1e-5, equal_nan=True):
        return []
    return [Finding(words[0].format(what=what), tuple(words[1]), "heads", "probe", weight=2)]


def dtype_findings(run64: Callable[[], np.ndarray], *, what="your output") -> list[Finding]:
    """Run in float64: a result in float32 means some tensor was made with the default dtype on the way."""
    try:
        out = run64()
    except Exception as exc:
        text = str(exc)
        if "dtype" in text or "Double" in text or "Float" in text:
            first = text.splitlines()[0][:160]
            return [Finding(f"given float64 inputs and parameters, the computation raised: {first}",
                            ("a tensor made inside the computation has a fixed dtype (the default float32): create "
                             "new tensors with dtype=x.dtype and device=x.device, or derive them from x",),
                            "dtypes", "probe", weight=8)]
        return []
    out = np.asarray(out)
    if out.dtype.kind == "f" and out.dtype != np.float64:
        return [Finding(f"given float64 inputs and parameters, {what} came back as {out.dtype}: the computation "
                        "changed dtype on the way.",
                        ("a tensor made inside the computation has a fixed dtype (the default float32) and the "
                         "result followed it: create new tensors with dtype=x.dtype, or derive them from x",),
                        "dtypes", "probe", weight=8)]
    return []


def argument_findings(call: Callable[..., np.ndarray], args: list, names: list[str], *,
                      what="your output") -> list[Finding]:
    """Perturb each argument of ``call`` in turn (the arrays among ``args``, named by ``names``): an argument the
    output does not change with is not used."""
    try:
        base = np.asarray(call(*args))
    except Exception:
        return []
    rng = np.random.default_rng(2718)
    found = []
    for index, (value, name) in enumerate(zip(args, names)):
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            continue
        changed = list(args)
        changed[index] = (value + rng.normal(0.5, 1.0, size=value.shape)).astype(value.dtype)
        try:
            after = np.asarray(call(*changed))
        except Exception:
            continue
        if after.shape == base.shape and np.allclose(after, base, rtol=1e-6, atol=1e-8, equal_nan=True):
            found.append(Finding(f"{what} stayed the same when {name} changed.",
                                 (f"{name} is not used: something else (a global, a fixed value such as inputs[1], "
                                  "another argument) stands in its place",), "arguments", "probe", weight=1))
    return found
