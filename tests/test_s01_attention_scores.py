"""Stage 1: attention scores for one query.

Spec: the score of token i is the dot product inputs[i] . query. The loop
form and the matmul form each return that (num_tokens,) vector; each form is
graded on its own.
"""
import pytest

from diagnosis import Listed, Said, argument_findings, assert_close
from suite_runtime.cases import normal

pytestmark = pytest.mark.attention_scores
STAGE = "s01_attention_scores"
FORMS = ["attention_scores_loop", "attention_scores_matmul"]


def explained(stage, form, inputs, query):
    """What a failed check of a scores form is diagnosed with: its typical mistakes, and whether it uses both of
    its arguments (perturbed one at a time)."""
    return [Listed({"the scores of every pair of tokens; one query needs one score per token": inputs @ inputs.T,
                    "scores against inputs[1] instead of the given query": inputs @ inputs[1]}),
            Said(lambda values: argument_findings(getattr(stage, form), [inputs, query], ["inputs", "the query"],
                                                  what="your scores"))]


@pytest.mark.public
@pytest.mark.parametrize("form", FORMS)
def test_journey_scores_every_token_against_the_query(stage, public_fx, form):
    scores = getattr(stage, form)(public_fx.inputs, public_fx.query)
    assert_close(
        "attn_scores_2", scores, public_fx.attn_scores_2,
        diagnosis=explained(stage, form, public_fx.inputs, public_fx.query),
        hint="attn_scores_2[i] is the dot product of inputs[i] with the query inputs[1].",
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["case0", "case1"])
def test_scores_for_other_sizes_and_a_query_outside_the_inputs(stage, hidden_fx, form, case):
    inputs, query = hidden_fx[f"{case}/inputs"], hidden_fx[f"{case}/query"]
    scores = getattr(stage, form)(inputs, query)
    assert_close(
        "scores", scores, hidden_fx[f"{case}/scores"],
        diagnosis=explained(stage, form, inputs, query),
        hint=f"inputs {inputs.shape}, query {query.shape}: one dot product per input row.",
    )


@pytest.mark.parametrize("form", FORMS)
def test_random_cases(stage, reference, rng, form):
    for _ in range(3):
        t, d = rng.integers(2, 12), rng.integers(2, 9)
        inputs, query = normal(rng, t, d), normal(rng, d)
        expected = reference.stage(STAGE).attention_scores_matmul(inputs, query)
        assert_close(f"scores for inputs {inputs.shape}", getattr(stage, form)(inputs, query), expected,
                     diagnosis=explained(stage, form, inputs, query))
