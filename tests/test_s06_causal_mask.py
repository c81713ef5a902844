"""Stage 6: causal masks.

Spec: both functions return weights where token i attends only to tokens
0..i: entries above the diagonal are exactly 0, every row sums to 1, and the
result equals the softmax over the allowed positions alone. The simple form
masks normalised weights and renormalises; the efficient form masks the raw
scores with -inf and takes softmax(masked / sqrt(d_k)). Inputs may carry a
leading batch dimension.
"""
import numpy as np
import pytest

from diagnosis import assert_close, causal, softmax
from suite_runtime.cases import normal

pytestmark = pytest.mark.causal_mask
STAGE = "s06_causal_mask"


def mask_mistakes(scores, d_k):
    t = scores.shape[-1]
    scaled = scores / np.sqrt(d_k)
    lower = np.tril(np.ones((t, t), np.float32))
    wrong_dim = "softmax over the wrong dimension (dim=1 of a batch is the query axis; use dim=-1)"
    wrong_scale = {"the scores were not scaled by 1 / sqrt(d_k) before the softmax": scores,
                   "the scores were multiplied by sqrt(d_k); divide by it": scores * np.sqrt(d_k)}
    return {
        "the mask hides the past instead of the future (tril and triu swapped)":
            softmax(np.where(np.tril(np.ones((t, t), bool), -1), -np.inf, scaled)),
        "masked with 0 instead of -inf: a 0 score still gets weight exp(0) > 0":
            softmax(causal(scaled, fill=0.0)),
        "masked after the softmax without renormalising: rows no longer sum to 1":
            softmax(scaled) * lower,
        wrong_dim: softmax(causal(scaled), axis=-2),
        **{why: softmax(causal(s)) for why, s in wrong_scale.items()},
        # Published code makes both in one line: each named, or the student fixes one and is told nothing more.
        **{f"two mistakes at once: {wrong_dim}; and {why}": softmax(causal(s), axis=-2)
           for why, s in wrong_scale.items()},
    }


def simple_mistakes(weights):
    """What typical mistakes make of the simple mask on already-normalised weights (..., T, T)."""
    t = weights.shape[-1]
    lower = np.tril(np.ones((t, t), np.float32))
    again = "softmax was applied to weights that are already normalised: mask them, then divide each row by its sum"

    def renormalised(w):
        return w / w.sum(axis=-1, keepdims=True)

    return {
        "the rows were not renormalised after masking": weights * lower,
        again: renormalised(softmax(weights) * lower),
        again + " (a softmax of the masked weights gives their zeros weight exp(0) > 0)": softmax(weights * lower),
        again + " (a softmax of the weights masked with -inf)": softmax(np.where(lower > 0, weights, -np.inf)),
    }


@pytest.mark.public
def test_simple_mask_on_the_journey_weights(stage, public_fx):
    out = stage.causal_weights_simple(public_fx.attn_weights)
    assert_close("masked_simple_norm", out, public_fx.masked_weights, mistakes=simple_mistakes(public_fx.attn_weights))


@pytest.mark.public
def test_efficient_mask_on_the_journey_scores(stage, public_fx):
    out = stage.causal_weights_efficient(public_fx.attn_scores, int(public_fx.d_k))
    assert_close("attn_weights (efficient mask)", out, public_fx.masked_weights,
                 mistakes=mask_mistakes(public_fx.attn_scores, int(public_fx.d_k)))


@pytest.mark.public
def test_simple_and_efficient_masks_agree(stage, public_fx):
    simple = stage.causal_weights_simple(public_fx.attn_weights)
    efficient = stage.causal_weights_efficient(public_fx.attn_scores, int(public_fx.d_k))
    assert_close("simple vs efficient masked weights", simple, efficient)


def test_efficient_mask_on_a_batch(stage, hidden_fx):
    d_k = int(hidden_fx.d_k)
    out = stage.causal_weights_efficient(hidden_fx.attn_scores, d_k)
    assert_close("masked weights (batch of 3)", out, hidden_fx.masked_weights,
                 mistakes=mask_mistakes(hidden_fx.attn_scores, d_k))


def test_simple_mask_on_a_batch(stage, hidden_fx):
    out = stage.causal_weights_simple(hidden_fx.attn_weights)
    assert_close("masked weights (batch of 3)", out, hidden_fx.masked_weights,
                 mistakes=simple_mistakes(hidden_fx.attn_weights))


@pytest.mark.parametrize("form", ["simple", "efficient"])
def test_future_is_exactly_zero_and_rows_sum_to_one(stage, hidden_fx, form):
    if form == "simple":
        out = stage.causal_weights_simple(hidden_fx.attn_weights)
    else:
        out = stage.causal_weights_efficient(hidden_fx.attn_scores, int(hidden_fx.d_k))
    t = out.shape[-1]
    future = out[..., np.triu(np.ones((t, t), bool), 1)]
    assert np.all(future == 0), (
        f"weights above the diagonal must be exactly 0 (future tokens); got max {future.max():.4g}")
    assert_close("row sums", out.sum(axis=-1), np.ones(out.shape[:-1], np.float32))


def test_changing_future_scores_changes_nothing(stage, hidden_fx):
    scores = hidden_fx.attn_scores.copy()
    t = scores.shape[-1]
    tampered = scores + 50.0 * np.triu(np.ones((t, t), np.float32), 1)
    d_k = int(hidden_fx.d_k)
    assert_close("weights with altered future scores", stage.causal_weights_efficient(tampered, d_k),
                 stage.causal_weights_efficient(scores, d_k),
                 hint="Scores above the diagonal belong to future tokens and must not influence any weight.")


def test_random_cases(stage, reference, rng):
    ref = reference.stage(STAGE)
    t, d_k = int(rng.integers(1, 10)), int(rng.integers(1, 65))
    scores = normal(rng, rng.integers(1, 4), t, t, scale=float(rng.choice([0.5, 3.0, 20.0])))
    expected = ref.causal_weights_efficient(scores, d_k)
    assert_close(f"efficient mask ({t} tokens, d_k={d_k})", stage.causal_weights_efficient(scores, d_k), expected,
                 mistakes=mask_mistakes(scores, d_k))
    weights = softmax(scores / np.sqrt(d_k))
    assert_close(f"simple mask ({t} tokens)", stage.causal_weights_simple(weights), expected, rtol=1e-4, atol=1e-5,
                 mistakes=simple_mistakes(weights))
