"""The diagnosis engine's wording rules: a hint says what the learner's numbers show, and names a cause only where
that cause was reproduced on the learner's case (a searched change or a listed mistake whose output equals theirs)
or where the evidence is the cause itself (an error whose own text says what was done). A probe shows an effect: the
message states the effect and names no cause, not even as a possibility (a false possibility misleads as much as a
false fact). An error's sizes show where two tensors met, not which step made them so: the reading states the
facts (which named sizes met, in which operation, at which dimension) and names no cause, since nothing run on the
learner's code reproduced one."""
import numpy as np
import pytest

from diagnosis import Call, Finding, Probed, Said, Searched, Switch, assert_close, error_findings
from diagnosis.explain import reconcile
from diagnosis.findings import LIKELY, POSSIBLE


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
                                         ("a mean over the batch", "a view that mixes b and tokens"), "batch",
                                         "probe")])
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
    """torch's raw text names no size: the reading says which of the case's sizes met where, and nothing more (heads
    not repeated, a table of positions read along the heads: both give these sizes)."""
    text = "RuntimeError: The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 1"
    [found] = error_findings(text, gqa_call())
    assert "dimension 1 is num_heads (4)" in found.shows and "dimension 1 is num_kv_groups (2)" in found.shows
    assert found.causes == () and found.lines() == [f"Evidence: {found.shows}"]


@pytest.mark.parametrize(("text", "shown"), [
    # keys.T on a batched (b, tokens, d) tensor: the token axis meets a feature axis
    ("RuntimeError: The size of tensor a (5) must match the size of tensor b (7) at non-singleton dimension 2",
     "num_tokens (5)"),
    # a table of positions taken from the heads axis meets the tokens
    ("RuntimeError: The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 2",
     "num_heads (4)"),
    # a cache joined on another axis than the token axis
    ("RuntimeError: Sizes of tensors must match except in dimension 1. Expected size 5 but got size 1 for tensor "
     "number 1 in the list.", "torch.cat joined tensors along dimension 1, where every other axis must agree"),
    ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (15x28 and 112x28)", "num_heads * d_out (112)"),
    ("RuntimeError: shape '[3, 5, 4, 8]' is invalid for input of size 420", "a tensor of 420 values = "),
])
def test_torch_s_shape_errors_are_named_in_one_reading_as_facts(text, shown):
    """Each of these sizes comes from several steps (the comments name one): the reading says the sizes, no cause."""
    found = error_findings(text, gqa_call())
    assert found and any(shown in f.shows for f in found), [f.lines() for f in found]
    assert all(f.causes == () for f in found), [f.lines() for f in found]
    assert not any("mistake" in line.lower() for f in found for line in f.lines())


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
    assert found[0].causes == () and not found[0].stated


def test_an_error_whose_own_text_says_what_was_done_is_stated():
    text = "RuntimeError: view size is not compatible with input tensor's size and stride (at least one dimension ...)"
    [found] = error_findings(text, gqa_call())
    assert found.lines() == [f"{LIKELY} {found.causes[0]}"]


def test_probed_findings_keep_their_evidence():
    probe = Probed([lambda: [Finding("row 0 moves with token 3.", ("a", "b"), "masking", "probe")]])
    assert probe.findings(np.zeros(1), 1e-4, 1e-6)[0].lines()[0] == "Evidence: row 0 moves with token 3."


# ---------------------------------------------------------------- rule 2: a match holds on every case looked at

def dropout_by_hand(factor_of_p):
    """A learner's dropout that keeps where rand >= p and scales the kept values by factor_of_p(p)."""
    def run(p, x):
        keep = np.random.default_rng(0).uniform(size=x.shape) >= p
        return np.where(keep, x * factor_of_p(p), 0.0).astype(np.float32)
    return run


def dropout_message(learner, p=0.5, separate=True):
    from diagnosis import check_dropout
    x = np.ones((60, 60), np.float32)
    with pytest.raises(AssertionError) as failed:
        check_dropout(learner(p, x), x, p, "dropout", second=(lambda rate: (learner(rate, x), x)) if separate else None)
    return str(failed.value)


def test_a_cause_that_holds_on_one_rate_only_is_decided_by_the_separating_rate():
    """At p = 0.5, "multiplied by p" and "multiplied by (1 - p)" give the same numbers: the check runs a second rate
    that tells them apart and names the one that holds on both."""
    said = dropout_message(dropout_by_hand(lambda p: p))
    assert f"{LIKELY} the kept values were multiplied by p instead of divided" in said
    assert "(1 - p) instead of divided by it" not in said
    said = dropout_message(dropout_by_hand(lambda p: 1 - p))
    assert f"{LIKELY} the kept values were multiplied by (1 - p) instead of divided by it" in said
    assert "multiplied by p instead" not in said


def test_causes_no_case_separates_are_given_together_never_one_as_fact():
    said = dropout_message(dropout_by_hand(lambda p: p), separate=False)
    assert LIKELY not in said and POSSIBLE in said
    assert "multiplied by p instead" in said and "multiplied by (1 - p) instead" in said


# ---------------------------------------------------------------- rule 3: a fitted value is shown only if it reproduces

def rope_tables(inv, positions=40):
    a = np.arange(positions)[:, None] * np.asarray(inv, np.float64)[None, :]
    a = np.concatenate([a, a], axis=-1)
    return np.stack([np.cos(a), np.sin(a)])


def test_a_fitted_theta_that_does_not_reproduce_the_tables_is_not_shown():
    """RoPE's frequencies rounded to bfloat16: the ratio of the first two fits theta = 4.9e5-ish, which does not give
    the tables back; the precision probe does, and says which intermediate lost precision."""
    import torch

    from diagnosis.rotary import angle_findings
    d, theta = 16, 500_000.0
    inv = theta ** (-np.arange(0, d, 2) / d)
    rounded = torch.tensor(inv).bfloat16().double().numpy()
    lines = [line for f in angle_findings(rope_tables(rounded), d, theta) for line in f.lines()]
    assert not any("theta = 4" in line or "theta_base = 4" in line for line in lines), lines
    assert any("frequencies (inv_freq) rounded to bfloat16" in line for line in lines), lines


def test_a_fitted_theta_that_reproduces_the_tables_is_shown():
    from diagnosis.rotary import angle_findings
    d = 16
    found = angle_findings(rope_tables(490_000.0 ** (-np.arange(0, d, 2) / d)), d, 500_000.0)
    assert any("theta_base = 4.9e+05 at every position" in f.shows for f in found)


def test_a_temperature_that_does_not_reproduce_the_weights_is_not_shown():
    """Weights whose scale drifts from row to row (a scale compounding from tile to tile): the fitted divisor is near
    sqrt(d) but no single one gives them: said as such, with no divisor as the cause."""
    from diagnosis import ExposedWeights
    from diagnosis.probes import weight_findings
    rng = np.random.default_rng(0)
    n, d = 6, 37
    scores = rng.normal(size=(n, n)) * 3
    allowed = np.tril(np.ones((n, n), bool))
    drift = (1.0066 + 3e-4 * np.arange(n))[:, None]  # near 6.083 / 6.043, each row a little further off
    s = np.where(allowed, scores * drift / np.sqrt(d), -np.inf)
    observed = np.exp(s - s.max(-1, keepdims=True))
    observed /= observed.sum(-1, keepdims=True)
    found = weight_findings(ExposedWeights(observed, scores, allowed, 1 / np.sqrt(d),
                                           divisors={"sqrt(head_dim)": np.sqrt(d)}))
    lines = [line for f in found for line in f.lines()]
    assert any("no single divisor" in line for line in lines), lines
    assert not any("softmax(scores / " in line for line in lines) and not any("mistake" in line for line in lines)


# ---------------------------------------------------------------- rule 4: boilerplate only where it holds

def test_a_names_reading_says_what_the_module_lacks_or_has_beyond_never_what_it_has():
    import torch

    from suite_runtime.adapters import names_differ

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W_query = torch.nn.Linear(2, 2)
            self.extra = torch.nn.Parameter(torch.zeros(2))
            self.blocks = [torch.nn.Linear(2, 2)]  # a plain list: not registered

    model = Heads()
    given = {"W_query.weight": 0, "W_query.bias": 0}
    said = "\n".join(names_differ(model, given, dict(model.named_parameters())))
    assert "Use the names" not in said and "lacks" not in said
    assert "['extra']" in said and "blocks (a plain list of 1 modules)" in said


def test_a_heads_reading_names_the_fault_the_parameters_show():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("s09", Path(__file__).parents[1] / "tests" /
                                                  "test_s09_multihead_wrapper.py")
    s09 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s09)
    heads = {f"heads.{h}.W_{w}.weight": [2, 4] for h in range(3) for w in ("query", "key", "value")}
    extra = s09.heads_built({"parameters": {**heads, "scale": [1]}, "distinct_parameter_storages": 10,
                             "parameter_count_with_duplicates": 10, "unregistered": []})
    assert "['scale']" in extra and "for _ in range(num_heads)" not in extra
    shared = s09.heads_built({"parameters": heads, "distinct_parameter_storages": 3,
                              "parameter_count_with_duplicates": 9, "unregistered": []})
    assert "for _ in range(num_heads)" in shared


# ---------------------------------------------------------------- rule 5: index errors read against the named sizes

def test_an_index_out_of_range_is_read_against_the_named_sizes():
    text = "IndexError: index 6 is out of bounds for dimension 1 with size 2"
    [found] = error_findings(text, gqa_call())
    assert "index 6 is out of range for dimension 1" in found.shows and "num_kv_groups (2)" in found.shows
    assert found.causes == ()


def test_an_index_error_is_read_without_a_call_too():
    [found] = error_findings("IndexError: index 9 is out of bounds for dimension 0 with size 8")
    assert "index 9" in found.shows and "size 8" in found.shows


def test_an_output_of_nan_names_no_change_that_also_gives_nan():
    """Rule 1: NaN everywhere equals every change that makes NaN: no change is reproduced by it."""
    switch = Switch("fill", "masking", {"inf": "the masked weights were filled with -inf after the softmax"})

    def compute(choices):
        return np.full(3, np.nan) if choices.get("fill") == "inf" else np.ones(3)

    said = message(np.full(3, np.nan), np.ones(3), diagnosis=[Searched(compute, [switch])])
    assert "no finite value" in said and "mistake" not in said.lower() and "-inf" not in said


# ---------------------------------------------------------------- rule 6: shape errors say what the sizes show

def broadcast_error(a, b, dim):
    return (f"RuntimeError: The size of tensor a ({a}) must match the size of tensor b ({b}) at non-singleton "
            f"dimension {dim}")


@pytest.mark.parametrize(("shape", "a", "b"), [((3, 5, 5), 5, 3), ((4, 5), 5, 4), ((2, 6, 6), 6, 2)])
def test_an_axis_one_place_to_the_right_is_said_as_such_and_no_step_is_named(shape, a, b):
    """A row sum without keepdim=True: sum(dim=-1) of a (3, 5, 5) tensor is (3, 5), which meets the (3, 5, 5) at
    dimension 1 (3 against 5). The sizes show the input's axis 0 one place to the right; a reduction that dropped
    an axis gives that, and so do two axes swapped, and neither was reproduced: the fact is said, no step, and never
    the batch axis read where the tokens were meant (a fix the code already follows)."""
    call = Call("call", {"func": "causal_weights_simple", "args": [np.zeros(shape, np.float32)], "kwargs": {}})
    [found] = error_findings(broadcast_error(a, b, 1), call)
    assert "one place to the right" in found.shows and "size of its axis 0" in found.shows
    assert found.causes == () and not found.stated
    said = " ".join(found.lines())
    assert "shape[0]" not in said and "read it from the last axes" not in said


def test_sizes_that_are_not_an_input_s_neighbouring_axes_are_not_read_as_a_shift():
    call = Call("call", {"func": "causal_weights_simple", "args": [np.zeros((3, 5, 5), np.float32)], "kwargs": {}})
    found = error_findings(broadcast_error(5, 3, 2), call)  # (a (3, 3) table meeting the last axis: no shift)
    assert not any("one place to the right" in f.shows for f in found)


def cross_call(batch=2, tokens=6, d_in=3, d_context=7, d_out=20, cached=False):
    """A cross-attention forward whose sizes are pairwise distinct (or, with ``cached``, d_in = a step's length)."""
    steps = [{"method": "forward", "args": [np.zeros((batch, d_in if cached else tokens, d_in), np.float32)],
              "kwargs": {"context": np.zeros((batch, 5, d_context), np.float32)}}]
    if cached:
        steps.insert(0, {"method": "forward", "args": [np.zeros((batch, d_in, d_in), np.float32)],
                         "kwargs": {"use_cache": True}})
    return Call("session", {"cls": "CrossAttention", "init": dict(d_in=d_in, d_context=d_context, d_out=d_out,
                                                                  num_heads=2), "steps": steps})


def test_a_layer_made_for_another_of_the_module_s_widths_is_said_by_the_sizes_alone():
    """Keys projected from x where the context is meant: W_key, made for d_context, gets x of width d_in. The sizes
    say which widths met; "build every layer from the constructor's arguments" would send the student to a fix
    their code follows already, and a transposed-product list to three fixes none of which applies."""
    text = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (12x3 and 7x20)"
    [found] = error_findings(text, cross_call())
    assert "a tensor of width d_in (3) met a matrix made for width d_context (7)" in found.shows
    assert found.causes == () and found.lines() == [f"Evidence: {found.shows}"]
    assert "gave x of width 3 and a context of width 7: the matrix made for the context's width got a tensor as " \
           "wide as x" in found.shows
    # d_in shared with the cached tokens of a step: still two widths of the module, no story of transposed axes
    [found] = error_findings("RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x4 and 7x18)",
                             cross_call(d_in=4, d_out=18, cached=True))
    assert found.causes == (), found.causes
    # d_in = d_out and d_context = b * num_tokens: the second operand transposed fits by coincidence of sizes
    [found] = error_findings("RuntimeError: mat1 and mat2 shapes cannot be multiplied (48x64 and 48x64)",
                             cross_call(batch=4, tokens=12, d_in=64, d_context=48, d_out=64))
    assert found.causes == () and "transposed" not in found.shows


def test_a_layer_width_that_is_no_size_of_the_check_is_said_as_such():
    """A width that is no size of the check: a global, the book's example or a slip of arithmetic give it alike."""
    text = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (12x3 and 9x20)"
    [found] = error_findings(text, cross_call())
    assert "No size of this check is 9" in found.shows
    assert found.causes == () and "global" not in " ".join(found.lines())


# ---------------------------------------------------------------- rule 7: what an exception's own text says

@pytest.mark.parametrize(("torch_name", "dtype", "words"), [
    ("c10::BFloat16", "bfloat16", "torch.finfo(scores.dtype).min"), ("c10::Half", "float16", "float('-inf')"),
    ("float", "float32", "torch.finfo(scores.dtype).min"), ("int64_t", "int64", "integer tensor")])
def test_a_fill_value_that_overflows_its_dtype_is_read_from_the_exception(torch_name, dtype, words):
    """masked_fill(mask, torch.finfo(torch.float32).min) on bfloat16 scores: the exception names the dtype, so its
    range and a value every such dtype holds may be stated."""
    [found] = error_findings(f"RuntimeError: value cannot be converted to type {torch_name} without overflow")
    assert found.stated and f"its dtype, {dtype}," in found.causes[0] and words in found.causes[0]
    if dtype == "bfloat16":
        assert "-3.39e+38 to 3.39e+38" in found.causes[0] and "float32).min = -3.403e+38" in found.causes[0]


# ---------------------------------------------------------------- rule 8: the residual, in every stage

def test_an_output_that_is_the_expected_one_plus_an_input_says_so():
    """Context vectors plus the inputs: the output minus the expected values equals the inputs the function was
    given, whatever made it so; said by name in any stage's check (compare.assert_close)."""
    from diagnosis.residual import note
    rng = np.random.default_rng(0)
    weights, inputs = rng.dirichlet(np.ones(6), size=6), rng.normal(size=(6, 3))
    note("call", {"func": "all_context_vectors", "args": [weights, inputs]}, lambda: ["attn_weights", "inputs"])
    said = message(weights @ inputs + inputs, weights @ inputs)
    assert ("out minus the expected values equals inputs (argument 2 of all_context_vectors)" in said
            and "something adds inputs to the result" in said), said
    said = message(weights @ inputs - 2 * inputs, weights @ inputs)
    assert "equals -2 x inputs (argument 2 of all_context_vectors)" in said
    said = message(weights @ inputs + inputs + 0.01 * rng.normal(size=(6, 3)), weights @ inputs)
    assert "minus the expected" not in said  # (not within the check's tolerance: nothing said)
    # A function whose right output is its input (dropout at p = 0): zeros are no input subtracted, but a scale.
    note("call", {"func": "dropout_by_hand", "args": [inputs, 0.0]}, lambda: ["x", "p"])
    assert "minus the expected" not in message(np.zeros_like(inputs), inputs)


def test_the_residual_reads_only_the_running_test_s_inputs(monkeypatch):
    from diagnosis.residual import note
    x = np.arange(6.0).reshape(2, 3) + 1
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "an earlier test (call)")
    note("call", {"func": "f", "args": [x]}, lambda: ["x"])
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "this test (call)")
    assert "minus the expected" not in message(2 * x, x)


# ---------------------------------------------------------------- rule 9: dropout's evidence says what was measured

def test_dropout_that_changed_the_weights_but_zeroed_none_is_not_said_to_have_kept_them_unchanged():
    """Dropout on the scores before the softmax: no weight is 0, yet the weights changed, and every row still sums
    to 1: what a dropout before the softmax gives, said as such; "every value was kept unchanged" would be false."""
    from diagnosis import check_dropout
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(40, 8))
    keep = rng.uniform(size=scores.shape) >= 0.5
    plain = np.exp(scores) / np.exp(scores).sum(-1, keepdims=True)
    dropped = np.where(keep, scores * 2, 0.0)
    trained = np.exp(dropped) / np.exp(dropped).sum(-1, keepdims=True)
    with pytest.raises(AssertionError) as failed:
        check_dropout(trained.astype(np.float32), plain.astype(np.float32), 0.5, "weights")
    said = str(failed.value)
    assert "kept unchanged" not in said and "dropped nothing" not in said
    assert "no weight became 0" in said and "dropout acting before the softmax" in said
    with pytest.raises(AssertionError) as failed:
        check_dropout(plain.astype(np.float32), plain.astype(np.float32), 0.5, "weights")
    assert "every value was kept unchanged: nothing was dropped" in str(failed.value)


def test_stage_6_s_row_sums_without_keepdim_are_named_on_one_table_of_weights():
    """On one (T, T) table a row sum without keepdim=True raises nothing: (T,) broadcasts along the last axis and
    column j is divided by row j's sum. The simple mask's own mistakes reproduce that on the check's weights."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "tests" / "test_s06_causal_mask.py"
    spec = importlib.util.spec_from_file_location("s06", path)
    s06 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s06)
    weights = np.random.default_rng(3).dirichlet(np.ones(6), size=6).astype(np.float32)
    masked = weights * np.tril(np.ones((6, 6), np.float32))
    said = message(masked / masked.sum(axis=-1), masked / masked.sum(axis=-1, keepdims=True),
                   diagnosis=s06.simple(None, weights))
    assert f"{LIKELY} the row sums were taken without keepdim=True" in said, said


# ---------------------------------------------------------------- rule 6: a step left out is matched, not seen

def test_a_step_left_out_is_said_as_what_was_matched_never_as_missing():
    """m05 of a held-out set: queries and keys rotated along the head axis, so a query and a key of one head turn by
    the same angle and the scores equal those of no rotation; the code calls apply_rope. The match says what was
    matched, and that RoPE is missing or has no effect as written, never that it is not applied."""
    from diagnosis import attention as A
    spec = A.Attention(num_heads=2, rope_theta=10_000.0)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 5, 6))
    weights = {f"{n}.weight": rng.normal(size=(8, 6)) for n in ("W_query", "W_key", "W_value")}
    weights |= {"out_proj.weight": rng.normal(size=(8, 8)), "out_proj.bias": rng.normal(size=8)}
    actual = A.forward(spec, x, weights, {"rope": "none"})  # what a rotation by the head's index gives
    said = message(actual, A.forward(spec, x, weights),
                   diagnosis=[Searched(lambda c: A.forward(spec, x, weights, c), A.switches(spec, 6, 8))])
    assert "the right computation gives your output with no rotation at all" in said, said
    assert f"{LIKELY} RoPE is missing or, as written, has no effect" in said and "not applied" not in said, said


@pytest.mark.parametrize("module", ["attention", "flex", "latent", "sinks"])
def test_the_shared_mechanisms_never_call_a_step_missing(module):
    """Every searched step left out in the mechanisms many stages share is worded with search.no_effect."""
    import importlib

    from diagnosis.search import NO_EFFECT
    found = importlib.import_module(f"diagnosis.{module}")
    switches = [v for v in vars(found).values() if isinstance(v, Switch)]
    switches += [s for v in vars(found).values() if isinstance(v, dict) for s in v.values() if isinstance(s, Switch)]
    said = [w for s in switches for w in s.wrong.values()
            if any(p in w.split(":")[0] for p in ("not applied", "is missing", "was ignored", "were not scaled"))
            and w not in NO_EFFECT]
    assert switches and not said, said


def test_a_soft_cap_of_another_form_is_searched():
    """score * tanh(score / cap) (a published softcap slip): the soft-capping mechanism's switches hold its form."""
    from diagnosis import flex as F
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(1, 2, 6, 4)) * 4, rng.normal(size=(1, 2, 6, 4)), rng.normal(size=(1, 2, 6, 4))
    spec = F.Flex("causal", "soft_cap", cap=2.0)
    actual = F.attention(spec, q, k, v, {"cap": "score_times"})
    said = message(actual, F.attention(spec, q, k, v),
                   diagnosis=[Searched(lambda c: F.attention(spec, q, k, v, c), F.switches(spec, 2))])
    assert f"{LIKELY} tanh's result was multiplied by the score, not by cap" in said, said


# ---------------------------------------------------------------- rule 7: no conclusion from what a probe cannot read

def test_a_mask_is_not_read_from_outputs_that_are_not_weights():
    """m03 of a held-out set: the value cache filled with keys, so the exposing case's outputs are not weights; a
    reading of which keys a query sees from them would blame a mask that is right."""
    from diagnosis import attention as A
    from diagnosis.caches import step_rows_findings
    allowed = np.tril(np.ones((5, 5), bool))
    garbage = np.random.default_rng(0).normal(size=(1, 1, 5, 5))
    assert step_rows_findings(garbage, allowed, [2, 1, 2], A.Attention()) == []
    seen_late = np.where(np.triu(np.ones((5, 5), bool), 0), 0.2, 0.0)[None, None]  # (each row sees the future)
    assert step_rows_findings(seen_late, allowed, [2, 1, 2], A.Attention())


def test_torch_s_own_registry_is_not_a_plain_dict_of_modules():
    import torch

    from suite_runtime.adapters import unregistered

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.out_proj = torch.nn.Linear(4, 4)
            self.plain = [torch.nn.Linear(2, 2)]
            self.alias = list(self.heads)  # (registered through self.heads: nothing lost)

    assert unregistered(Wrapper()) == ["plain (a plain list of 1 modules)"]


def test_empty_heads_share_no_weight():
    """Heads of width d_out // num_heads = 0: their empty weights all have data_ptr 0, and are no shared weight."""
    import types

    import torch

    from suite_runtime.adapters import op_inspect

    class Head(torch.nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query, self.W_key = torch.nn.Linear(d_in, d_out), torch.nn.Linear(d_in, d_out)

    class Wrapper(torch.nn.Module):
        def __init__(self, d_in, d_out, num_heads):
            super().__init__()
            self.heads = torch.nn.ModuleList([Head(d_in, d_out // num_heads) for _ in range(num_heads)])

    module = types.ModuleType("empty_heads")
    module.Wrapper = Wrapper
    info = op_inspect(module, "Wrapper", {"d_in": 4, "d_out": 2, "num_heads": 3})
    assert info["distinct_parameter_storages"] == info["parameter_count_with_duplicates"] == 12


# ---------------------------------------------------------------- rule 8: an error whose text names the dtype

@pytest.mark.parametrize(("text", "dtype"), [
    ("RuntimeError: masked_fill_ only supports boolean masks, but got mask with dtype float", "float32"),
    ("RuntimeError: masked_fill_ only supports boolean masks, but got mask with dtype c10::BFloat16", "bfloat16"),
])
def test_a_float_mask_given_to_masked_fill_is_read(text, dtype):
    [found] = error_findings(text)
    [line] = found.lines()
    assert line.startswith(LIKELY) and f"has dtype {dtype}" in line and ".bool()" in line, line


# ---------------------------------------------------------------- shape errors: facts, never an unreproduced cause

def test_queries_split_into_the_key_value_heads_are_not_blamed_on_x_s_width():
    """Grouped-query attention whose queries are split into num_kv_groups heads: a view (b, n, num_kv_groups,
    head_dim) of W_query's output (width d_out). Where num_kv_groups * head_dim happens to equal d_in, the sizes are
    those of a view by x's width too; neither is the fact. The reading says what met: both names of the view's width,
    d_out = num_heads x head_dim for the tensor's, and no fix."""
    b, n, heads, groups, head_dim = 1, 9, 8, 2, 3
    d_out, d_in = heads * head_dim, groups * head_dim  # (d_in = num_kv_groups * head_dim: the coincidence)
    call = Call("forward", {"cls": "GroupedQueryAttention", "init": dict(d_in=d_in, d_out=d_out, context_length=12,
                                                                         num_heads=heads, num_kv_groups=groups),
                            "x": np.zeros((b, n, d_in), np.float32)})
    text = f"RuntimeError: shape '[{b}, {n}, {groups}, {head_dim}]' is invalid for input of size {b * n * d_out}"
    [found] = error_findings(text, call)
    said = " ".join(found.lines())
    assert found.causes == () and "mistake" not in said.lower(), said
    assert f"num_kv_groups ({groups}) x head_dim ({head_dim}) = {d_in} values per token" in said, said
    assert "d_in = num_kv_groups * head_dim" in said and f"num_heads x head_dim ({heads} x {head_dim})" in said
    assert "x's last size" not in said and "self.d_out" not in said


def test_a_tensor_whose_head_axis_meets_the_batch_is_not_blamed_on_the_batch_axis():
    """RoPE's tables applied to (b, num_tokens, num_heads, head_dim) queries: their token axis (cut to the sequence)
    meets the heads. With b = 2 and three heads the error quotes 3 against 2 at dimension 2: the sizes of the heads
    and of the batch, though the batch axis was never touched. The reading names the sizes, never the batch axis as
    a step."""
    call = Call("session", {"cls": "RoPEAttention", "init": dict(d_in=6, d_out=12, context_length=8, num_heads=3),
                            "steps": [{"method": "forward", "args": [np.zeros((2, 3, 6), np.float32)],
                                       "kwargs": {"use_cache": True}}]})
    text = "RuntimeError: The size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 2"
    found = error_findings(text, call)
    said = " ".join(line for f in found for line in f.lines())
    assert found and all(f.causes == () for f in found), said
    assert "the batch size b (2)" in said and "shape[0]" not in said and "batch axis" not in said, said


@pytest.mark.parametrize("text", [
    "RuntimeError: Sizes of tensors must match except in dimension 0. Expected size 3 but got size 1 for tensor "
    "number 1 in the list.",
    "RuntimeError: Expected size for first two dimensions of batch2 tensor to be: [6, 5] but got: [6, 4].",
    "RuntimeError: The size of tensor a (11) must match the size of tensor b (5) at non-singleton dimension 3",
])
def test_no_shape_reading_offers_a_list_of_possible_causes(text):
    found = error_findings(text, gqa_call())
    said = " ".join(line for f in found for line in f.lines())
    assert found and "Possible mistake" not in said and all(f.causes == () for f in found), said


def test_two_dtypes_meeting_are_said_as_facts_and_not_read_where_the_check_gave_the_other():
    """A check that ran the module in bfloat16 meets a float32 tensor: it was made or converted inside the code
    (which step is not in the error: no cause). Where the check itself gave a tensor of the other dtype (an integer
    table of positions), it may be that one: nothing is said."""
    text = "RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::BFloat16 != float"
    made = Call("forward", {"cls": "CausalAttention", "dtype": "bfloat16", "x": np.zeros((2, 3, 4), np.float32)})
    [found] = [f for f in error_findings(text, made) if f.mechanism == "dtypes"]
    said = " ".join(found.lines())
    assert found.causes == () and "made or converted inside your code" in said and "dtype=x.dtype" in said, said
    given = Call("forward", {"cls": "CausalAttention", "dtype": "float32", "x": np.zeros((2, 3, 4), np.float32),
                             "positions": np.zeros(3, np.int64)})
    assert not [f for f in error_findings("RuntimeError: expected scalar type Float but found Long", given)
                if f.mechanism == "dtypes"]
