"""Stage 2: normalising scores into attention weights.

Spec: normalize_by_sum divides by the sum; softmax_by_hand and softmax_torch
compute softmax over the last dimension (softmax_by_hand also over a given
dim) and stay finite for huge scores; all_pairs_scores is inputs @ inputs.T
and all_pairs_weights its row-wise softmax: every row sums to 1.
"""
import numpy as np
import pytest

from diagnosis import Attention, WeightsFunction, assert_close, softmax
from suite_runtime.cases import normal

pytestmark = pytest.mark.normalization
STAGE = "s02_normalization"


PLAIN = Attention(causal=False)  # a softmax over each row: no mask, no scale


def normalised(stage, form, scores):
    """What a failed check of a softmax (``form``: a function of the stage, scores -> weights) or of
    all_pairs_weights (its scores given) is diagnosed with: the softmax's mistakes searched, by hand ones included,
    and its weights probed on scores of the probe's own."""
    run = getattr(stage, form)
    if form == "all_pairs_weights":  # its argument is the inputs, not the scores: probe through the search only
        return WeightsFunction(PLAIN, by_hand=True).evidence(scores)[:1]
    return WeightsFunction(PLAIN, rerun=lambda s, width: run(s), by_hand=True).evidence(scores)


@pytest.mark.public
def test_journey_weights_by_sum(stage, public_fx):
    weights = stage.normalize_by_sum(public_fx.attn_scores_2)
    assert_close("attn_weights_2_tmp", weights, public_fx.weights_by_sum,
                 mistakes={"softmax instead of dividing by the sum": softmax(public_fx.attn_scores_2)})


@pytest.mark.public
@pytest.mark.parametrize("form", ["softmax_by_hand", "softmax_torch"])
def test_journey_softmax_weights(stage, public_fx, form):
    weights = getattr(stage, form)(public_fx.attn_scores_2)
    assert_close("attn_weights_2", weights, public_fx.weights_softmax,
                 diagnosis=normalised(stage, form, public_fx.attn_scores_2))


@pytest.mark.public
def test_journey_all_pairs_scores(stage, public_fx):
    assert_close("attn_scores", stage.all_pairs_scores(public_fx.inputs), public_fx.attn_scores)


@pytest.mark.public
def test_journey_all_pairs_weights_rows_sum_to_one(stage, public_fx):
    weights = stage.all_pairs_weights(public_fx.inputs)
    assert_close("attn_weights", weights, public_fx.attn_weights,
                 diagnosis=normalised(stage, "all_pairs_weights", public_fx.attn_scores))


def test_weights_by_sum_for_other_scores(stage, hidden_fx):
    weights = stage.normalize_by_sum(hidden_fx.scores)
    assert_close("weights", weights, hidden_fx.weights_by_sum)
    assert_close("weights.sum()", np.sum(weights), 1.0)


@pytest.mark.parametrize("form", ["softmax_by_hand", "softmax_torch"])
def test_softmax_of_a_vector_and_of_each_row(stage, hidden_fx, form):
    run = getattr(stage, form)
    assert_close("softmax(scores)", run(hidden_fx.scores), hidden_fx.weights_softmax,
                 diagnosis=normalised(stage, form, hidden_fx.scores))
    assert_close("softmax(matrix)", run(hidden_fx.matrix), hidden_fx.matrix_softmax,
                 diagnosis=normalised(stage, form, hidden_fx.matrix))


@pytest.mark.parametrize("form", ["softmax_by_hand", "softmax_torch"])
def test_softmax_is_stable_for_huge_scores(stage, hidden_fx, form):
    weights = getattr(stage, form)(hidden_fx.large)
    assert_close("softmax(large)", weights, hidden_fx.large_softmax,
                 diagnosis=normalised(stage, form, hidden_fx.large),
                 hint="Scores around 1000 make exp() overflow to inf in float32 unless each row's max is subtracted "
                      "first.")


def test_softmax_by_hand_honours_dim(stage, hidden_fx):
    weights = stage.softmax_by_hand(hidden_fx.matrix, dim=0)
    assert_close("softmax_by_hand(matrix, dim=0)", weights, softmax(hidden_fx.matrix, axis=0),
                 mistakes={"the dim argument is ignored (softmax over the last dim)": hidden_fx.matrix_softmax})


def test_all_pairs_for_other_inputs(stage, hidden_fx):
    assert_close("attn_scores", stage.all_pairs_scores(hidden_fx.inputs), hidden_fx.attn_scores)
    assert_close("attn_weights", stage.all_pairs_weights(hidden_fx.inputs), hidden_fx.attn_weights,
                 diagnosis=normalised(stage, "all_pairs_weights", hidden_fx.attn_scores))


def test_random_cases(stage, reference, rng):
    ref = reference.stage(STAGE)
    scores = rng.uniform(0.1, 5.0, size=rng.integers(2, 10)).astype(np.float32)
    assert_close("normalize_by_sum(scores)", stage.normalize_by_sum(scores), ref.normalize_by_sum(scores))
    matrix = normal(rng, rng.integers(1, 6), rng.integers(2, 9), scale=float(rng.choice([1.0, 10.0, 300.0])))
    for form in ("softmax_by_hand", "softmax_torch"):
        assert_close(f"{form}(matrix {matrix.shape})", getattr(stage, form)(matrix), ref.softmax_torch(matrix),
                     diagnosis=normalised(stage, form, matrix))
    inputs = normal(rng, rng.integers(2, 9), rng.integers(2, 6))
    assert_close("all_pairs_weights(inputs)", stage.all_pairs_weights(inputs), ref.all_pairs_weights(inputs),
                 diagnosis=normalised(stage, "all_pairs_weights", inputs @ inputs.T))
