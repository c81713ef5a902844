"""Dropout, judged by its properties: torch's random stream differs across platforms and devices, so a
dropout is compared with the same computation without it, never with stored masks."""
from __future__ import annotations

import numpy as np

from .compare import assert_close
from .explain import Said
from .findings import Finding, diagnosed

__tracebackhide__ = True

# Two float32 computations of the same values (with and without dropout, or a ratio of them) agree to float32's
# rounding, a few ulps of values of order 1: these bound "the same" and "scaled by exactly this factor".
SAME = {"rtol": 1e-4, "atol": 1e-5}
# A value below this is a zero that dropout made (or an attention weight of a masked key): float32 noise is far
# below it, and a kept weight of these cases far above.
ZERO = 1e-6

def kept_fraction_tolerance(p, n):
    """How far the kept fraction of n draws may stray from 1 - p: 5 standard deviations (a fixed seed
    makes each check deterministic; this keeps it true for any seed), at least 0.02."""
    return max(0.02, 5 * np.sqrt(p * (1 - p) / n))


def check_dropout(trained, plain, p, name, *, atol=ZERO, second=None):
    """Training-mode dropout of rate p: ``trained`` is ``plain`` (the same values without dropout) with
    each nonzero value either dropped (|value| <= atol) or kept and scaled by exactly 1 / (1 - p), about
    a fraction 1 - p of them kept; the zeros of ``plain`` (e.g. the masked future) stay 0. second: rate ->
    the learner's (trained, plain) at that rate, run only to tell apart mistakes this rate cannot."""
    trained, plain = np.asarray(trained), np.asarray(plain)
    assert trained.shape == plain.shape, f"{name}: shape {trained.shape}, expected {plain.shape}"
    live = plain != 0
    if not np.all(np.abs(trained[~live]) <= atol):
        message = (f"{name}: values that are 0 without dropout (the masked future) are not 0 in training mode: "
                   "dropout may only zero some weights and scale the others, never give weight to a masked key.")
        # Dropout on the scores, before the softmax, puts weight on masked scores it zeroed, and every row of
        # weights still sums to what it sums to without dropout (dropout after the softmax changes the sums).
        found = []
        if np.allclose(trained.sum(axis=-1), plain.sum(axis=-1), **SAME):
            found.append(Finding("each row of the output still sums to what it sums to without dropout, and masked "
                                 "weights became nonzero.",
                                 ("dropout acted on the scores before the softmax: apply it to the attention weights, "
                                  "after the softmax",), "dropout", "probe"))
        raise diagnosed("\n".join([message, *(line for f in found for line in f.lines())]), found)
    kept = live & (np.abs(trained) > atol)
    fraction, tolerance = kept.sum() / live.sum(), kept_fraction_tolerance(p, live.sum())
    if fraction >= 1:
        found = nothing_zeroed(trained, plain, p, atol)
        said = ("dropped nothing" if np.allclose(trained, plain, **SAME) else
                f"zeroed no value (dropout zeroes about {p:.2g} of them)")
        raise diagnosed(f"{name}: training mode with dropout p={p} {said}.\n"
                        + "\n".join(line for f in found for line in f.lines()), found)
    if abs(fraction - (1 - p)) >= tolerance:
        found = rate_mistakes(trained, plain, kept, p)
        raise diagnosed(
            f"{name}: {fraction:.3f} of the values were kept, expected {1 - p:.2f} +- {tolerance:.3f} for p={p:.3g} "
            "(dropout keeps each value with probability 1 - p)."
            + "".join(f"\n{line}" for f in found for line in f.lines()), found)
    ratio = trained[kept] / plain[kept]
    assert_close(f"{name}: kept values / values without dropout", ratio,
                 np.full(ratio.shape, 1 / (1 - p), np.float32), **SAME,
                 diagnosis=[Said(lambda values: scale_findings(values, p, second, atol))])


def nothing_zeroed(trained, plain, p, atol=ZERO) -> list[Finding]:
    """What a training-mode output in which no value became 0 shows (``plain``: the output without dropout, of a case
    whose output is the attention weights): unchanged, dropout did nothing; changed, with every row still summing to
    what it sums to without dropout and no weight negative, the weights went through a softmax after dropout acted
    (dropout after the softmax zeroes weights and scales the others, so rows no longer sum to 1)."""
    trained, plain = np.asarray(trained, np.float64), np.asarray(plain, np.float64)
    changed = ~np.isclose(trained, plain, **SAME)
    if not changed.any():
        return [Finding(f"in training mode with dropout p={p}, every value was kept unchanged: nothing was dropped.",
                        ("the dropout is never applied (a module's self.dropout, created but not called), or it runs "
                         "in eval mode",), "dropout", "probe")]
    share = f"{int(changed.sum())} of the {changed.size} values"
    if (np.allclose(trained.sum(axis=-1), plain.sum(axis=-1), **SAME)
            and np.all(trained >= -atol)):
        return [Finding(f"in training mode with dropout p={p}, no weight became 0, yet {share} differ from "
                        "the weights without dropout, and every row still sums to what it sums to without dropout: a "
                        "softmax came after what changed them. That is what dropout acting before the softmax gives "
                        "(on the scores, or on the queries or keys they are made of); dropout after the softmax "
                        "zeroes weights and scales the others by 1 / (1 - p), so its rows no longer sum to 1.",
                        ("dropout acts before the softmax: apply it to the attention weights, after the softmax",),
                        "dropout", "probe")]
    return [Finding(f"in training mode with dropout p={p}, no value became 0, yet {share} differ from the "
                    "output without dropout.", (), "dropout", "probe")]


# The factors a kept value can be scaled by, as functions of the rate: the right one is 1 / (1 - p). At p = 0.5 the
# factors (1 - p) and p coincide (and 1 / p is the right one): only a case at another rate tells them apart.
SCALES = {
    "the kept values were not rescaled by 1 / (1 - p)": lambda p: 1.0,
    "the kept values were multiplied by (1 - p) instead of divided by it": lambda p: 1 - p,
    "the kept values were multiplied by p instead of divided by (1 - p)": lambda p: p,
    "the kept values were divided by p instead of by (1 - p)": lambda p: 1 / p,
}
SEPARATING = (0.2, 0.3)  # rates at which no two factors of SCALES (nor the right one) coincide


def _scale_matches(ratio, p) -> list[str]:
    ratio = np.asarray(ratio, np.float64)
    right = 1 / (1 - p)
    return [words for words, factor in SCALES.items()
            if not np.isclose(factor(p), right, rtol=1e-4) and np.allclose(ratio, factor(p), **SAME)]


def scale_findings(ratio, p, second=None, atol=ZERO) -> list[Finding]:
    """The scale mistakes that give the learner's ``ratio`` (kept values / values without dropout) at rate ``p``,
    each held to a second rate (``second(rate)``: the learner's (trained, plain) there) where this one cannot tell
    them apart: a cause counts only where it gives the learner's numbers on both."""
    named = _scale_matches(ratio, p)
    if not named:
        return []
    rate = next(r for r in SEPARATING if not np.isclose(r, p))
    if len(named) > 1 and second is not None:
        try:
            trained, plain = (np.asarray(v, np.float64) for v in second(rate))
            kept = (plain != 0) & (np.abs(trained) > atol)
            held = _scale_matches(trained[kept] / plain[kept], rate)
        except Exception:  # the learner's code fails at the other rate: it tells nothing apart
            held = named
        both = [words for words in named if words in held]
        if both:
            also = f" and at p = {rate}"
            if len(both) == 1:
                return [Finding(f"the kept values were scaled by {np.median(ratio):.4g} at p = {p}{also}: this "
                                "mistake gives that at both rates.", (both[0],), "dropout", "listed", weight=30)]
            named = both
        else:
            return []  # none holds at the other rate: no cause is claimed
    if len(named) == 1:
        return [Finding(f"the kept values were scaled by {np.median(ratio):.4g}, not 1 / (1 - p) = {1 / (1 - p):.4g}: "
                        "this mistake gives that.", (named[0],), "dropout", "listed", weight=30)]
    return [Finding(f"the kept values were scaled by {np.median(ratio):.4g}, not 1 / (1 - p) = {1 / (1 - p):.4g}: at "
                    f"p = {p} each of these gives that, and this check has no case at another rate to tell them "
                    "apart.", tuple(named), "dropout", "listed", weight=30)]


def rate_mistakes(trained, plain, kept, p) -> list[Finding]:
    """The mistakes that a kept fraction away from 1 - p bears out: each predicts both the fraction kept and
    the factor the kept values were scaled by, and is named only when both are what it predicts."""
    live = plain != 0
    n, fraction = live.sum(), kept.sum() / live.sum()
    ratio = trained[kept] / plain[kept]
    found = []
    twice = (1 - p) ** 2  # two independent draws must both keep a value, and each scales it by 1 / (1 - p)
    if (abs(fraction - twice) < kept_fraction_tolerance(1 - twice, n)
            and np.allclose(ratio, 1 / twice, **SAME)):
        found.append(Finding(
            f"{fraction:.3f} of the values were kept, about (1 - p)^2 = {twice:.3g}, each scaled by 1 / (1 - p)^2 = "
            f"{1 / twice:.3g}: what two dropouts in a row give, in both statistics.",
            ("dropout was applied twice. The chapter's attention drops its weights once, after the softmax: remove "
             "the second dropout (nanoGPT's resid_dropout after the output projection, for one; in the book's GPT "
             "model the transformer block applies that dropout around the attention module)",), "dropout", "listed"))
    if p != 0.5 and abs(fraction - p) < kept_fraction_tolerance(p, n):
        # Reproduced only where the scale is also what that mistake gives (1 / (1 - p) or 1 / p with keep < p):
        # the fraction alone is an effect.
        scaled = any(np.allclose(ratio, f, **SAME) for f in (1 / (1 - p), 1 / p))
        found.append(Finding(f"{fraction:.3f} of the values were kept, about p = {p:.3g} rather than 1 - p"
                             + (", each scaled by 1 / (1 - p) or 1 / p." if scaled else "."),
                             ("p was used as the probability of keeping a value: p is the probability of DROPPING an "
                              "element (keep where torch.rand_like(x) >= p)",), "dropout",
                             "listed" if scaled else "probe"))
    return found


def check_module_dropout(stage, cls, init, x, weights, p, exposed, device="cpu", explained=False):
    """A module's dropout, by its properties. Give a case whose output exposes the attention weights
    (cases.exposing_case) and those weights (``exposed``: ``multihead`` on that case): in training mode with
    dropout=p each output value is dropped or scaled by 1 / (1 - p) (check_dropout); in eval mode the
    output is the dropout=0 module's, whatever the seed. explained: the eval-mode check says that dropout acted
    only where the output shows it (``eval_dropout_findings``), instead of a hint shown on any failure."""
    plain = stage.forward(cls, dict(init, dropout=0.0), x, weights, device=device)
    # Dropout can only be judged on a module that is right without it: otherwise this check would
    # blame dropout for another mistake of the stage (which its own checks name).
    if plain.shape != exposed.shape or not np.allclose(plain, exposed, **SAME):
        raise AssertionError(
            f"{cls} with dropout=0 does not compute the expected output on this test's case (one-hot "
            "tokens whose output is the attention weights), so its dropout cannot be checked yet: fix this "
            "stage's other failures first."
        )
    init = dict(init, dropout=p)
    for seed in (1, 2):
        if explained:
            assert_close(f"{cls} output in eval mode with dropout={p} (seed {seed})",
                         stage.forward(cls, init, x, weights, seed=seed, device=device), plain,
                         diagnosis=[Said(lambda out: eval_dropout_findings(out, plain, p))])
            continue
        assert_close(f"{cls} output in eval mode with dropout={p} (seed {seed})",
                     stage.forward(cls, init, x, weights, seed=seed, device=device), plain,
                     hint="In eval mode dropout must do nothing: use nn.Dropout, which follows the module's "
                     "train()/eval(), or pass training=self.training to F.dropout.")
    trained = stage.forward(cls, init, x, weights, train=True, seed=0, device=device)
    check_dropout(trained, plain, p, f"{cls} output in training mode with dropout={p}",
                  second=lambda rate: (stage.forward(cls, dict(init, dropout=rate), x, weights, train=True, seed=0,
                                                     device=device), plain))
    check_weights_dropped_whole(stage.forward(cls, init, dense_tokens(x), weights, train=True, seed=0,
                                              device=device), x.shape[-1], f"{cls} output in training mode with "
                                f"dropout={p}, on inputs whose values have no zero entry")


def dense_tokens(x):
    """Inputs of an exposing case's shape whose values (the identity W_value of each head maps a token to itself)
    have no zero entry: every key's value vector is dense."""
    rng = np.random.default_rng(3)
    return (rng.uniform(0.5, 1.5, size=x.shape) * rng.choice([-1, 1], size=x.shape)).astype(np.float32)


def check_weights_dropped_whole(out, head_dim, name):
    """Dropout on the attention weights takes a key's whole value vector out of a head's sum: a head's output for a
    token is then zero in every feature (every key dropped) or, with dense values, in none. Some features zero and
    others not is what dropout on anything after the weights gives (the values, the context vectors, the output),
    which the one-hot case of check_module_dropout cannot tell apart (its values are one-hot, so its outputs ARE the
    weights). ``out`` (b, T, num_heads * head_dim), heads side by side as in every form of the exposing case."""
    out = np.asarray(out, dtype=np.float64)
    if out.ndim != 3 or out.shape[-1] % head_dim:
        return
    # (exactly 0: what dropout writes; a sum of kept weights times dense values is never exactly 0 unless every
    # kept weight is, and then every feature is. Tiny sums, where the one heavy key was dropped, are not zeros.)
    zero = out.reshape(*out.shape[:-1], -1, head_dim) == 0  # (b, T, num_heads, head_dim)
    partial = zero.any(-1) & ~zero.all(-1)
    if partial.any():
        b, i, h = (int(v) for v in np.argwhere(partial)[0])
        row = out[b, i, h * head_dim:(h + 1) * head_dim]
        raise AssertionError(
            f"{name}: {int(partial.sum())} of {partial.size} head outputs (token, head) have some features exactly 0 "
            f"and others not; e.g. batch {b}, token {i}, head {h}: {np.array2string(row, precision=3)}.\n"
            "Evidence: dropout zeroed single features. Dropout on the attention weights cannot do that: a dropped "
            "weight takes a key's whole value vector out of the sum, so a head's output for a token is zero in every "
            "feature or, with these values, in none. Dropout acted on something else (the values, the context "
            "vectors or the output); in this stage it drops attention weights, "
            "attn_weights = self.dropout(attn_weights), before attn_weights @ values.")



EVAL_DROPOUT = ("In eval mode dropout must do nothing: use nn.Dropout (it follows the module's train()/eval()), or "
                "pass the rate only in training mode (dropout_p=p if self.training else 0.0 for "
                "F.scaled_dot_product_attention, F.dropout(..., training=self.training))")


def eval_dropout_findings(out, plain, p) -> list[Finding]:
    """An eval-mode output (``out``) of a case whose output is the attention weights, read against the weights
    without dropout (``plain``): dropout acting in eval mode drops about p of them and scales the others by
    1 / (1 - p). Said only when both show."""
    out, plain = np.asarray(out, dtype=np.float64), np.asarray(plain, dtype=np.float64)
    if out.shape != plain.shape:
        return []
    live = np.abs(plain) > ZERO
    dropped = live & (np.abs(out) <= ZERO)
    kept = live & ~dropped
    if not np.any(dropped) or not np.any(kept):
        return []
    fraction = kept.sum() / live.sum()
    # (a ratio of two weights each rounded in float32, some small: ten times SAME's bounds)
    scaled = np.allclose(out[kept] / plain[kept], 1 / (1 - p), rtol=1e-3, atol=1e-4)
    if not scaled or abs(fraction - (1 - p)) >= kept_fraction_tolerance(p, live.sum()):
        return []
    return [Finding(f"in eval mode {1 - fraction:.2f} of the weights were dropped and the others scaled by "
                    f"1 / (1 - p) = {1 / (1 - p):.3g}: dropout acted in eval mode, in both statistics.",
                    (EVAL_DROPOUT,), "dropout", "listed", weight=1)]
