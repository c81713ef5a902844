"""The diagnosis engine's wording rules: a hint says what the learner's numbers show, and names a cause only where
that cause was reproduced on the learner's case (a searched change or a listed mistake whose output equals theirs)
or where the evidence is the cause itself (an error whose own text says what was done). A probe shows an effect: the
message states the effect and names no cause, not even as a possibility (a false possibility misleads as much as a
false fact). An error's sizes show where two tensors met: their causes are said with "if"."""
import numpy as np
import pytest

from diagnosis import Call, Finding, Probed, Said, Searched, Switch, assert_close, error_findings
from diagnosis.explain import reconcile
from diagnosis.findings import LIKELY, POSSIBLE_ONE


def message(actual, expected, **kwargs) -> str:
    with pytest.raises(AssertionError) as failed:
        assert_close("out", actual, expected, **kwargs)
    return str(failed.value)


def test_a_probe_s_cause_is_not_shown_only_its_effect():
    """Rule 1: a probe measured an effect; a cause it did not reproduce is no hint, not even "Possible mistake"."""
    probe = Said(lambda values: [Finding("swapping two heads' weights changed your output.",
                                         ("the heads were split without transpose",), "heads", "probe")])
    said = message(np.ones(3), np.zeros(3), diagnosis=[probe])
    assert "Evidence: swapping two heads' weights changed your output." in said
    assert "transpose" not in said and "mistake" not in said.lower()


def test_a_probe_s_list_of_causes_is_not_shown():
    """Rule 1: "Possible mistakes: (1) ... OR (2) ..." from a probe: none of them was reproduced."""
    probe = Said(lambda values: [Finding("batch row 1 changed when only batch row 0 changed.",
                                         ("a mean over the batch", "a view that mixes b and tokens"), "batch", "probe")])
    said = message(np.ones(3), np.zeros(3), diagnosis=[probe])
    assert "batch row 1 changed" in said and "Possible mistake" not in said and "a mean over the batch" not in said
    [found] = probe.findings(np.ones(3), 1e-4, 1e-6)
    assert found.record()["causes"] == [] and found.text == found.shows


def test_two_probes_of_different_mechanisms_name_no_cause():
    found = reconcile([Finding("rows move with later tokens.", ("the mask is missing",), "masking", "probe"),
                       Finding("heads mix.", ("the heads were merged without transpose",), "heads", "probe")])
    lines = [line for f in found for line in f.lines()]
    assert lines == ["Evidence: rows move with later tokens.", "Evidence: heads mix."]


def test_a_cause_the_search_reproduced_on_the_learner_s_case_is_the_likely_mistake():
    switch = Switch("scale", "scaling", {"none": "the scores were not scaled"})

    def compute(choices):
        return np.array([1.0, 2.0]) * (1.0 if choices.get("scale") == "none" else 0.5)

    said = message(np.array([1.0, 2.0]), np.array([0.5, 1.0]), diagnosis=[Searched(compute, [switch])])
    assert f"{LIKELY} the scores were not scaled" in said


def test_a_listed_match_is_reproduced_and_stated():
    said = message(np.array([2.0]), np.array([1.0]), mistakes={"doubled": np.array([2.0])})
    assert f"{LIKELY} doubled" in said


def test_a_probe_s_cause_gives_way_to_the_cause_the_search_reproduced():
    found = reconcile([Finding("a later token moves row 0.", ("the mask is missing",), "masking", "probe"),
                       Finding("the right computation with one change gives your output.",
                               ("the mask starts one diagonal too high",), "masking", "mutation")])
    lines = [line for f in found for line in f.lines()]
    assert f"{LIKELY} the mask starts one diagonal too high" in lines
    assert not any("the mask is missing" in line for line in lines)


def gqa_call(batch=3):
    """A forward of a grouped-query module whose sizes are pairwise distinct (head_dim = 7, b = 3, 5 tokens)."""
    sizes = dict(d_in=10, d_out=28, num_heads=4, num_kv_groups=2, context_length=11)
    return Call("forward", {"cls": "GroupedQueryAttention", "init": sizes,
                            "x": np.zeros((batch, 5, 10), np.float32)})


def test_a_shape_error_is_read_against_the_case_s_named_sizes():
    """torch's raw text names no size: the reading says which of the case's sizes met where, and the class of
    mistake such a meeting comes from, with "if"."""
    text = "RuntimeError: The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 1"
    [found] = error_findings(text, gqa_call())
    assert "dimension 1 is num_heads (4)" in found.shows and "dimension 1 is num_kv_groups (2)" in found.shows
    assert any("were not repeated" in c for c in found.causes)
    assert not found.stated and all(c.startswith("if ") for c in found.causes)


@pytest.mark.parametrize(("text", "shown", "cause"), [
    # keys.T on a batched (b, tokens, d) tensor: the token axis meets a feature axis
    ("RuntimeError: The size of tensor a (5) must match the size of tensor b (7) at non-singleton dimension 2",
     "num_tokens (5)", "transposed on the wrong axes"),
    # a table of positions taken from the heads axis meets the tokens
    ("RuntimeError: The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 2",
     "num_heads (4)", "from the wrong axis"),
    # a cache joined on another axis than the token axis
    ("RuntimeError: Sizes of tensors must match except in dimension 1. Expected size 5 but got size 1 for tensor "
     "number 1 in the list.", "num_tokens (5)", "join along the axis that differs"),
    ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (15x28 and 112x28)", "num_heads * d_out (112)",
     "if"),
    ("RuntimeError: shape '[3, 5, 4, 8]' is invalid for input of size 420", "a tensor of 420 values = ",
     "if a size in the view"),
])
def test_torch_s_shape_errors_are_named_in_one_reading(text, shown, cause):
    found = error_findings(text, gqa_call())
    assert found and any(shown in f.shows for f in found), [f.lines() for f in found]
    assert any(cause in c for f in found for c in f.causes)
    assert not any(line.startswith(LIKELY) for f in found for line in f.lines())


def test_a_size_shared_by_two_names_is_said_with_both():
    text = "RuntimeError: The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 0"
    [found] = error_findings(text, gqa_call(batch=4))
    assert "num_heads or the batch size b (4)" in found.shows


def test_a_layer_as_wide_as_all_heads_is_not_blamed_on_one_cause():
    """out_proj built as wide as every head's output side by side: the sizes show the width, not the step."""
    text = ("RuntimeError: Error(s) in loading state_dict: size mismatch for out_proj.weight: copying a param with "
            "shape torch.Size([28, 10]) from checkpoint, the shape in current model is torch.Size([28, 112]).")
    found = error_findings(text, gqa_call())
    assert found and "num_heads * d_out (112)" in found[0].shows
    assert len(found[0].causes) > 1 and not found[0].stated


def test_an_error_whose_own_text_says_what_was_done_is_stated():
    text = "RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension ...)"
    [found] = error_findings(text, gqa_call())
    assert found.lines() == [f"{LIKELY} {found.causes[0]}"]


def test_probed_findings_keep_their_evidence():
    probe = Probed([lambda: [Finding("row 0 moves with token 3.", ("a", "b"), "masking", "probe")]])
    assert probe.findings(np.zeros(1), 1e-4, 1e-6)[0].lines()[0] == "Evidence: row 0 moves with token 3."
