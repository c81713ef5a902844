"""Stage 4: trainable projections for one query.

Spec: query = x_query @ W_query, keys = inputs @ W_key, values = inputs @ W_value;
scores = keys . query; weights = softmax(scores / sqrt(d_k)) with d_k the key
dimension; the context vector is weights @ values.
"""
import pytest

from diagnosis import Attention, Said, WeightsFunction, argument_findings, assert_close, softmax
from suite_runtime.cases import normal

pytestmark = pytest.mark.trainable_projections
STAGE = "s04_trainable_projections"


def scaled(stage, scores, d_k):
    """What a failed check of scaled_weights is diagnosed with: one query's weights, softmax(scores / sqrt(d_k)) over
    every key, its scaling and softmax searched and probed (diagnosis.WeightsFunction)."""
    return WeightsFunction(Attention(causal=False, head_name="d_k"), d_k, rerun=stage.scaled_weights).evidence(scores)


def context_mistakes(weights, inputs, values):
    return {
        "the weights mixed the inputs; they must mix the values": weights @ inputs,
        "softmax was applied to weights that are already normalised: use attn_weights as they are":
            softmax(weights) @ values,
    }


def arguments(stage, function, args, names, what):
    """Whether ``function`` of the stage uses each of its arguments (perturbed one at a time)."""
    return [Said(lambda values: argument_findings(getattr(stage, function), args, names, what=what))]


def check_projections(stage, fx, name):
    for what, x, w, expected in (("query", fx.x_query, fx.W_query, fx.query), ("keys", fx.inputs, fx.W_key, fx.keys),
                                 ("values", fx.inputs, fx.W_value, fx.values)):
        assert_close(f"{what} ({name})", stage.project(x, w), expected,
                     diagnosis=arguments(stage, "project", [x, w], ["x", "W"], f"your {what}"))


def check_scores(stage, fx, name):
    assert_close(f"attn_scores ({name})", stage.scores_for_query(fx.query, fx.keys), fx.attn_scores,
                 diagnosis=arguments(stage, "scores_for_query", [fx.query, fx.keys], ["the query", "the keys"],
                                     "your scores"))


def check_weights(stage, fx, name):
    d_k = fx.keys.shape[-1]
    assert_close(f"attn_weights ({name})", stage.scaled_weights(fx.attn_scores, d_k), fx.attn_weights,
                 diagnosis=scaled(stage, fx.attn_scores, d_k))


def check_context(stage, fx, name):
    assert_close(
        f"context_vec ({name})", stage.context_for_query(fx.attn_weights, fx.values), fx.context_vec,
        mistakes=context_mistakes(fx.attn_weights, fx.inputs, fx.values),
        diagnosis=arguments(stage, "context_for_query", [fx.attn_weights, fx.values], ["the weights", "the values"],
                            "your context vector"),
    )


CHECKS = [check_projections, check_scores, check_weights, check_context]


@pytest.mark.public
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_journey_with_the_book_s_weights(stage, public_fx, check):
    check(stage, public_fx, "journey, the book's W at seed 123")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_other_sizes_d_in_5_d_out_4(stage, hidden_fx, check):
    check(stage, hidden_fx, "d_in=5, d_out=4, 7 tokens")


def test_random_cases(stage, reference, rng):
    ref = reference.stage(STAGE)
    t, d_in = rng.integers(2, 10), rng.integers(2, 8)
    d_out = d_in + rng.integers(1, 4)  # d_in != d_out: a transposed W cannot pass
    inputs = normal(rng, t, d_in)
    W_query, W_key, W_value = (normal(rng, d_in, d_out, scale=0.5) for _ in range(3))
    query = ref.project(inputs[rng.integers(t)], W_query)
    keys, values = ref.project(inputs, W_key), ref.project(inputs, W_value)
    assert_close("keys", stage.project(inputs, W_key), keys)
    scores = ref.scores_for_query(query, keys)
    assert_close("attn_scores", stage.scores_for_query(query, keys), scores)
    weights = ref.scaled_weights(scores, int(d_out))
    assert_close("attn_weights", stage.scaled_weights(scores, int(d_out)), weights,
                 diagnosis=scaled(stage, scores, int(d_out)))
    assert_close("context_vec", stage.context_for_query(weights, values), ref.context_for_query(weights, values),
                 mistakes=context_mistakes(weights, inputs, values))
