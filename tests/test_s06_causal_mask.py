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

from diagnosis import About, Attention, Listed, WeightsFunction, assert_close, softmax
from suite_runtime.cases import normal

pytestmark = pytest.mark.causal_mask
STAGE = "s06_causal_mask"


# What both functions compute: causal attention weights (the efficient form from scores scaled by 1/sqrt(d_k), the
# simple form from weights already normalised, i.e. from their logarithms at scale 1).
CAUSAL = Attention(causal=True, head_name="d_k")


def efficient(stage, scores, d_k):
    """What a failed check of causal_weights_efficient is diagnosed with (diagnosis.WeightsFunction)."""
    return WeightsFunction(CAUSAL, d_k, rerun=stage.causal_weights_efficient).evidence(scores)


def simple(stage, weights):
    """What a failed check of causal_weights_simple is diagnosed with: the searched and probed weights function of
    the weights' logarithms, and the simple form's own mistakes."""
    with np.errstate(divide="ignore"):
        logs = np.log(np.asarray(weights, dtype=np.float64))
    return [*WeightsFunction(CAUSAL).evidence(logs), Listed(simple_mistakes(weights))]


def simple_mistakes(weights):
    """What typical mistakes make of the simple mask on already-normalised weights (..., T, T)."""
    t = weights.shape[-1]
    lower = np.tril(np.ones((t, t), np.float32))
    again = "softmax was applied to weights that are already normalised: mask them, then divide each row by its sum"

    def renormalised(w):
        return w / w.sum(axis=-1, keepdims=True)

    mistakes = {
        "the rows were not renormalised after masking": weights * lower,
        again: renormalised(softmax(weights) * lower),
        again + " (a softmax of the masked weights gives their zeros weight exp(0) > 0)": softmax(weights * lower),
        again + " (a softmax of the weights masked with -inf)": softmax(np.where(lower > 0, weights, -np.inf)),
    }
    masked = weights * lower
    if masked.shape[-1] == masked.shape[-2] and masked.ndim == 2:  # (a batch's sums of another length do not broadcast)
        # The sums taken without keepdim=True: a (T,) that broadcasts along the last axis, column j over row j's sum.
        mistakes[("the row sums were taken without keepdim=True: masked.sum(dim=-1) has shape (num_tokens,), which "
                  "broadcasts along the last axis, so column j is divided by row j's sum; keep the axis, "
                  "masked.sum(dim=-1, keepdim=True)")] = masked / masked.sum(axis=-1)
    return mistakes


@pytest.mark.public
def test_simple_mask_on_the_journey_weights(stage, public_fx):
    out = stage.causal_weights_simple(public_fx.attn_weights)
    assert_close("masked_simple_norm", out, public_fx.masked_weights, diagnosis=simple(stage, public_fx.attn_weights))


@pytest.mark.public
def test_efficient_mask_on_the_journey_scores(stage, public_fx):
    out = stage.causal_weights_efficient(public_fx.attn_scores, int(public_fx.d_k))
    assert_close("attn_weights (efficient mask)", out, public_fx.masked_weights,
                 diagnosis=efficient(stage, public_fx.attn_scores, int(public_fx.d_k)))


def test_efficient_mask_on_a_batch(stage, hidden_fx):
    d_k = int(hidden_fx.d_k)
    out = stage.causal_weights_efficient(hidden_fx.attn_scores, d_k)
    assert_close("masked weights (batch of 3)", out, hidden_fx.masked_weights,
                 diagnosis=efficient(stage, hidden_fx.attn_scores, d_k))


def test_simple_mask_on_a_batch(stage, hidden_fx):
    out = stage.causal_weights_simple(hidden_fx.attn_weights)
    assert_close("masked weights (batch of 3)", out, hidden_fx.masked_weights,
                 diagnosis=simple(stage, hidden_fx.attn_weights))


@pytest.mark.parametrize("form", ["simple", "efficient"])
def test_future_is_exactly_zero_and_rows_sum_to_one(stage, hidden_fx, form):
    if form == "simple":
        out = stage.causal_weights_simple(hidden_fx.attn_weights)
        evidence = [About(out, simple(stage, hidden_fx.attn_weights))]
    else:
        out = stage.causal_weights_efficient(hidden_fx.attn_scores, int(hidden_fx.d_k))
        evidence = [About(out, efficient(stage, hidden_fx.attn_scores, int(hidden_fx.d_k)))]
    t = out.shape[-1]
    future = out[..., np.triu(np.ones((t, t), bool), 1)]
    # exactly 0: a masked weight is exp(-inf) = 0, not merely small
    assert_close("weights above the diagonal (future tokens)", future, np.zeros_like(future), rtol=0, atol=0,
                 diagnosis=evidence)
    assert_close("row sums", out.sum(axis=-1), np.ones(out.shape[:-1], np.float32), diagnosis=evidence)


def test_changing_future_scores_changes_nothing(stage, hidden_fx):
    scores = hidden_fx.attn_scores.copy()
    t = scores.shape[-1]
    tampered = scores + 50.0 * np.triu(np.ones((t, t), np.float32), 1)
    d_k = int(hidden_fx.d_k)
    assert_close("weights", stage.causal_weights_efficient(tampered, d_k), stage.causal_weights_efficient(scores, d_k),
                 labels=("with the future scores as given", "with them raised by 50"),
                 diagnosis=efficient(stage, tampered, d_k),
                 hint="Scores above the diagonal belong to future tokens and must not influence any weight.")


def test_random_cases(stage, reference, rng):
    ref = reference.stage(STAGE)
    t, d_k = int(rng.integers(2, 10)), int(rng.integers(1, 65))  # (one token has no future: it cannot show a mask)
    scores = normal(rng, rng.integers(1, 4), t, t, scale=float(rng.choice([0.5, 3.0, 20.0])))
    expected = ref.causal_weights_efficient(scores, d_k)
    assert_close(f"efficient mask ({t} tokens, d_k={d_k})", stage.causal_weights_efficient(scores, d_k), expected,
                 diagnosis=efficient(stage, scores, d_k))
    # The simple form masks weights already normalised: drawn from moderate scores, so that no allowed weight of a
    # row underflows to 0 in float32 (a row of such zeros is 0 / 0 for any correct implementation too).
    weights = softmax(normal(rng, *scores.shape, scale=2.0))
    assert_close(f"simple mask ({t} tokens)", stage.causal_weights_simple(weights), ref.causal_weights_simple(weights),
                 rtol=1e-4, atol=1e-5, diagnosis=simple(stage, weights))
