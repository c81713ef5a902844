"""Grades an instructor can trust: every catalogued mistake loses points on its own stage, with its
cause named, and every correct variant gets full marks; the grades of the catalogue and of the
demo's samples are the ones on record.

Each submission is graded as ``attnkit grade`` grades a class (the full suite, book tests excluded,
learner code in the sandbox), the way nbgrader's autograder cells grade it too (grader.grading.worker).
"""
import importlib

import numpy as np
import pytest
from verdicts import verdicts

from catalogue import BUGS, VARIANTS
from grader.course.samples import samples
from grader.grading.run import grade
from grader.grading.scoring import stage_score
from grader.grading.targets import folder_target
from grader.kit import SUITE, assignments, stages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAMPLE = "sample-"  # the demo's samples are graded in the same run, under this prefix


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> record of every catalogue entry and sample, all graded in one run of attnkit grade's
    warm workers (torch imported once per worker)."""
    root = tmp_path_factory.mktemp("catalogue")
    records = {}
    for assignment in assignments():  # each graded on its own assignment's stages, as a course grades it
        folder = root / assignment
        for entry in BUGS + VARIANTS:
            if entry.assignment == assignment:
                entry.build(folder / "submissions" / entry.name)
        for sample in samples(assignment):
            sample.write(folder / "submissions" / (SAMPLE + assignment + "-" + sample.student))
        target = folder_target(folder / "submissions", folder / "grades", assignment,
                               points={stage: 1.0 for stage in stages(assignment)})
        outcome = grade(target, quiet=True)
        assert not outcome.errors, outcome.errors
        records |= outcome.records
    return records


@pytest.fixture(scope="module")
def graded(records):
    """name -> {stage: (score out of 1, [failure messages])}."""
    return {
        name: {s["stage"]: (stage_score(s["tests"], 1.0),
                            [t["message"] for t in s["tests"] if t["outcome"] == "failed"])
               for s in record["stages"]}
        for name, record in records.items()
    }


def test_grades_are_the_ones_on_record(records, snapshot):
    """Every check's verdict for every catalogue entry and sample, as kept in __snapshots__/ (see verdicts.py)."""
    assert {name: verdicts(record) for name, record in sorted(records.items())} == snapshot


def test_the_catalogue_is_large_and_spans_every_stage():
    assert len(BUGS) >= 25 and len(VARIANTS) >= 10
    assert {b.stage for b in BUGS} == set(stages()), "every stage needs at least one catalogued mistake"
    named = sum(b.diagnosis is not None for b in BUGS)
    assert named >= 0.9 * len(BUGS), f"only {named} of {len(BUGS)} mistakes have a named diagnosis"


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.name)
def test_mistake_costs_points_on_its_stage_only_and_is_named(graded, bug):
    result = graded[bug.name]
    score, failures = result[bug.stage]
    assert score < 1, f"{bug.name} ({bug.why}) got full marks on {bug.stage}"
    # Every other stage gets full marks, those that import the buggy one too (stage 9 runs beside the
    # reference CausalAttention when graded): a mistake costs points once.
    others = {s: r[0] for s, r in result.items() if s != bug.stage}
    assert others and all(v == 1 for v in others.values()), f"{bug.name} lost points on other stages: {others}"
    if bug.diagnosis:
        assert any(bug.diagnosis in message for message in failures), (
            f"{bug.name}: no failure message says {bug.diagnosis!r}. Messages:\n" + "\n---\n".join(failures[:4])
        )


@pytest.mark.parametrize("bug", [b for b in BUGS if b.not_said], ids=lambda b: b.name)
def test_no_feedback_sends_a_mistake_to_a_wrong_fix(graded, bug):
    """A hint once shown for this mistake pointed to a fix its code already had (or to another mistake): a
    reading is shown only when the submission's own numbers bear it out, so these words appear nowhere."""
    failures = [message for _, messages in graded[bug.name].values() for message in messages]
    said = {words: [m for m in failures if words in m][:1] for words in bug.not_said
            if any(words in m for m in failures)}
    assert not said, f"{bug.name} ({bug.why}) was told what does not apply to it: {said}"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_correct_variant_gets_full_marks(graded, variant):
    lost = {s: (score, failures[:1]) for s, (score, failures) in graded[variant.name].items() if score < 1}
    assert not lost, f"{variant.name} ({variant.why}) lost points: {lost}"


@pytest.fixture
def suite(monkeypatch):
    """The graded suite's modules (tests/ is not a package, and only some of its modules are installed)."""
    monkeypatch.syspath_prepend(str(SUITE))
    return importlib.import_module


def broadcast(a, b, dim):
    return (f"RuntimeError: The size of tensor a ({a}) must match the size of tensor b ({b}) at non-singleton "
            f"dimension {dim}")


def cached(*chunks):
    """A session of cached steps of the given lengths (b = 2, d_in = 4, context_length = 12)."""
    steps = [{"method": "forward", "args": [np.zeros((2, n, 4), np.float32)], "kwargs": {"use_cache": True}}
             for n in chunks]
    return "session", {"cls": "MultiHeadAttentionWithCache", "init": {"context_length": 12}, "steps": steps}


def forward(tokens, **init):
    return "forward", {"cls": "CausalAttention", "init": {"d_in": 4, "d_out": 2, **init},
                       "x": np.zeros((2, tokens, 4), np.float32)}


def tiled(n_q, n_kv, block_size):
    q, k = np.zeros((1, 1, n_q, 4), np.float32), np.zeros((1, 1, n_kv, 4), np.float32)
    return "call", {"func": "tiled_attention", "args": [q, k, k],
                    "kwargs": {"is_causal": True, "block_size": block_size}}


READINGS = [  # (stage module whose readings apply, error text, the failing call, words shown or None: nothing specific)
    ("s08_causal_attention", broadcast(3, 8, 1), forward(3, context_length=8), "cut it to the sequence"),
    ("s08_causal_attention", broadcast(3, 8, 1), forward(5, context_length=8), None),  # sizes of no mask of this call
    ("s08_causal_attention", broadcast(6, 8, 1), forward(8, context_length=9), "never hard-code the sequence length"),
    ("s08_causal_attention", broadcast(6, 8, 1), forward(8, context_length=9, d_in=6), None),  # (6: the check's)
    ("m03_kv_cache", broadcast(3, 7, 3), cached(4, 3), "cut for the new tokens alone"),
    ("m03_kv_cache", broadcast(7, 12, 3), cached(4, 3), "context_length x context_length"),
    ("m03_kv_cache", broadcast(3, 7, 2), cached(4, 3), None),  # the query axis: not the mask cut to the new tokens
    ("m03_kv_cache", broadcast(3, 7, 3), cached(4, 1, 2), None),  # no step with 3 new of 7 keys
    ("s08_causal_attention", broadcast(3, 7, 3), cached(4, 3), None),  # chapter 3's readings know no cache
    ("m07_tiled_attention", broadcast(4, 2, 3), tiled(10, 10, 4), "full tile size"),
    ("m07_tiled_attention", broadcast(4, 2, 3), tiled(8, 8, 4), None),  # no tile of 2
    ("s08_causal_attention", broadcast(4, 2, 3), tiled(10, 10, 4), None),
    ("s10_multihead_attention", "AttributeError: 'CausalAttention' object has no attribute 'num_heads'",
     forward(4, context_length=6), "self.num_heads is used but never set"),
    ("s10_multihead_attention", "AttributeError: 'Tensor' object has no attribute 'num_heads'",
     forward(4, context_length=6), None),
    ("s10_multihead_attention", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x4 and 3x2)",
     forward(4, context_length=6), "never from globals"),
    ("s10_multihead_attention", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x4 and 2x4)",
     forward(4, context_length=6), "transpose missing or extra"),
    ("s10_multihead_attention", "RuntimeError: shape '[2, 4, 3, 1]' is invalid for input of size 16",
     forward(4, context_length=6, num_heads=1), "never from a global"),
    ("s10_multihead_attention", "RuntimeError: shape '[2, 4, 2, 1]' is invalid for input of size 48",
     forward(4, context_length=6, num_heads=1), None),  # sizes no reading accounts for
    ("s01_attention_scores", "NotImplementedError: s01_attention_scores: attention_scores_loop: see its TODO", None,
     "still a stub"),
    ("s01_attention_scores", "NotImplementedError: ", None, "still a stub"),  # nbgrader's stub
    ("s01_attention_scores", "NotImplementedError: Could not run 'aten::_foo' with arguments from the 'CUDA' backend",
     None, None),
]


@pytest.mark.parametrize(("stage", "text", "call", "words"), READINGS)
def test_an_error_is_read_only_as_far_as_its_evidence_goes(suite, stage, text, call, words):
    """What an exception means is read from its own message (never the traceback a sandbox appends, which quotes
    the learner's code) and checked against the call that raised it: a reading the sizes do not bear out says
    nothing."""
    checks = suite("checks")
    said = checks.explain_error(checks.error_text("SubmissionError", f"{text}\nwhere (most recent call last):\n  mask"),
                                call and checks.Call(*call), getattr(suite(f"test_{stage}"), "ERROR_READINGS", None))
    assert (words is None and not said) or (words is not None and any(words in s for s in said)), said
