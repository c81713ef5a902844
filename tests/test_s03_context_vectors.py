"""Stage 3: context vectors.

Spec: a query's context vector is sum_i weights[i] * inputs[i]; all context
vectors at once are attn_weights @ inputs, row i for token i.
"""
import numpy as np
import pytest

from diagnosis import Listed, Said, argument_findings, assert_close, softmax
from suite_runtime.cases import normal

pytestmark = pytest.mark.context_vectors
STAGE = "s03_context_vectors"
AGAIN = "softmax was applied to weights that are already normalised: use attn_weights as they are"


def context_mistakes(weights, inputs):
    """weights: one query's (num_tokens,) or every query's (num_tokens, num_tokens)."""
    mistakes = {AGAIN: softmax(weights) @ inputs}
    if weights.ndim == 2:
        mistakes["attn_weights.T @ inputs: the weights were transposed; row i belongs to query i"] = weights.T @ inputs
    return mistakes


def context(stage, function, weights, inputs, **more):
    """What a failed check of a context function is diagnosed with: its typical mistakes (and ``more``), and whether
    it uses both of its arguments."""
    return [Listed({**more, **context_mistakes(weights, inputs)}),
            Said(lambda values: argument_findings(getattr(stage, function), [weights, inputs],
                                                  ["the weights", "the inputs"], what="your context vectors"))]


@pytest.mark.public
def test_journey_context_vector(stage, public_fx):
    assert_close(
        "context_vec_2", stage.context_vector(public_fx.attn_weights_2, public_fx.inputs), public_fx.context_vec_2,
        diagnosis=context(stage, "context_vector", public_fx.attn_weights_2, public_fx.inputs,
                          **{"the inputs were averaged without their weights": public_fx.inputs.mean(axis=0),
                             "the inputs were summed without their weights": public_fx.inputs.sum(axis=0)}),
    )


@pytest.mark.public
def test_journey_all_context_vectors(stage, public_fx):
    assert_close(
        "all_context_vecs", stage.all_context_vectors(public_fx.attn_weights, public_fx.inputs),
        public_fx.all_context_vecs,
        diagnosis=context(stage, "all_context_vectors", public_fx.attn_weights, public_fx.inputs),
    )


def test_context_vector_for_other_weights(stage, hidden_fx):
    weights, inputs = hidden_fx.attn_weights, hidden_fx.inputs
    assert_close("context_vec_3", stage.context_vector(weights[3], inputs), hidden_fx.context_vec_3,
                 diagnosis=context(stage, "context_vector", weights[3], inputs))


def test_all_context_vectors_for_other_weights(stage, hidden_fx):
    weights, inputs = hidden_fx.attn_weights, hidden_fx.inputs
    assert_close(
        "all_context_vecs", stage.all_context_vectors(weights, inputs), hidden_fx.all_context_vecs,
        diagnosis=context(stage, "all_context_vectors", weights, inputs),
    )


def test_random_cases(stage, reference, rng):
    ref = reference.stage(STAGE)
    t, d = rng.integers(2, 10), rng.integers(2, 7)
    inputs = normal(rng, t, d)
    weights = rng.dirichlet(np.ones(t), size=t).astype(np.float32)
    i = rng.integers(t)
    assert_close(f"context vector of token {i}", stage.context_vector(weights[i], inputs),
                 ref.context_vector(weights[i], inputs), diagnosis=context(stage, "context_vector", weights[i], inputs))
    assert_close("all context vectors", stage.all_context_vectors(weights, inputs),
                 ref.all_context_vectors(weights, inputs),
                 diagnosis=context(stage, "all_context_vectors", weights, inputs))
