"""Grades an instructor can trust: every catalogued mistake loses points on its own stage, with its
cause named, and every correct variant gets full marks; the grades of the catalogue and of the
demo's samples are the ones on record.

Each submission is graded as ``attnkit grade`` grades a class (the full suite, book tests excluded,
learner code in the sandbox), the way nbgrader's autograder cells grade it too (grader.grading.worker).
The entries share submissions ("packs"), one entry per stage in each (the i-th pack holding each stage's i-th
entry, the reference module where a stage has fewer), each judged on its own stage. That is sound because a
submission's stages are graded each in a worker of its own, a stage built on another beside the reference of
that other (grader/sandbox/backend.py): no module of a pack reaches another's stage. The test checks it rather
than trusts it: a stage that builds on another is graded beside a mistake in that other in most packs (its
verdicts are on record), and every reference module a pack holds must get full marks beside the pack's
mistakes. The demo's samples, graded as whole submissions, lose points exactly where they break: chapter 3's in the
same run as the packs, the later assignments' as ``attnkit grade`` graded them in the course of every assignment
(kit_tests/rounds.py, made once per test run: those records are read here, not made a second time).

One stage's entries alone (an author's loop: seconds, not the whole catalogue's minutes): each entry's tests are
named after its stage, so

    pytest kit_tests/grading/test_catalogue.py -k s05_self_attention

selects them, and then only that stage's entries are graded, on that stage alone (``selected_stages``). A selection
that takes in a test of the whole catalogue (the grades on record, the samples, the reference beside each pack)
grades it all.
"""
import importlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from rounds import LATER, course_graded_in_rounds
from verdicts import verdicts

from catalogue import BUGS, VARIANTS
from grader.course.samples import samples, write_modules
from grader.grading.records import read_records, results_dir
from grader.grading.run import grade
from grader.grading.scoring import stage_score
from grader.grading.targets import folder_target
from grader.kit import SOLUTIONS, SUITE, assignments, marker, stages
from suite_runtime.stage_names import builds_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAMPLE = "sample-"  # the demo's samples are graded in the same run, under this prefix
BESIDE = "reference-beside-"  # the reference modules of a pack (stages with fewer entries), graded beside its entries


def packs(entries) -> list[dict]:
    """``entries`` as submissions of one entry per stage: [{stage: entry}], the i-th holding each stage's i-th."""
    by_stage = defaultdict(list)
    for entry in entries:
        by_stage[entry.stage].append(entry)
    return [{stage: listed[i] for stage, listed in by_stage.items() if i < len(listed)}
            for i in range(max(map(len, by_stage.values()), default=0))]


def packs_of(assignment, only=None) -> list[dict]:
    """The packs of ``assignment``'s catalogue entries (of the stages ``only`` names, if given)."""
    return packs([entry for entry in BUGS + VARIANTS
                  if entry.assignment == assignment and (only is None or entry.stage in only)])


def entry_id(entry) -> str:
    """A catalogue entry's test id: its stage, then its name (so that ``-k STAGE`` selects a stage's entries)."""
    return f"{entry.stage}-{entry.name}"


def selected_stages(session) -> set[str] | None:
    """The stages whose entries the selected tests of this file judge, when each judges one entry (a mistake, a
    variant); None when one judges the whole catalogue (the grades on record, a sample, the reference beside each
    pack), which all of it must then be graded for."""
    only = set()
    for item in session.items:
        if item.path != Path(__file__) or not {"records", "graded"} & set(getattr(item, "fixturenames", ())):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        entry = params.get("bug") or params.get("variant")
        if entry is None:
            return None
        only.add(entry.stage)
    return only


@pytest.fixture(scope="module")
def records(request, tmp_path_factory):
    """name -> record of every catalogue entry (its own stage), of the reference modules beside each pack's entries
    (BESIDE + assignment + pack) and of every sample, graded in one run of attnkit grade's warm workers per
    assignment (torch imported once per worker), the later assignments' samples in the course of every assignment
    (kit_tests/rounds.py). Only the entries of ``selected_stages`` when the selected tests judge those alone, each
    pack graded on those stages only."""
    root = tmp_path_factory.mktemp("catalogue")
    only = selected_stages(request.session)
    records = {}
    for assignment in assignments():  # each graded on its own assignment's stages, as a course grades it
        folder = root / assignment
        packed = packs_of(assignment, only)
        if not packed and only is not None:
            continue
        for index, pack in enumerate(packed):
            write_modules(folder / "submissions" / f"pack-{index}", assignment=assignment,
                          replaced={stage: entry.modules()[stage] for stage, entry in pack.items()})
        for sample in samples(assignment) if only is None and assignment not in LATER else ():
            sample.write(folder / "submissions" / (SAMPLE + assignment + "-" + sample.student))
        target = folder_target(folder / "submissions", folder / "grades", assignment,
                               points={stage: 1.0 for stage in stages(assignment) if only is None or stage in only})
        outcome = grade(target, quiet=True)
        assert not outcome.errors, outcome.errors
        for index, pack in enumerate(packed):  # each entry's record: its own stage
            record = outcome.records.pop(f"pack-{index}")
            for stage, entry in pack.items():
                records[entry.name] = dict(record, stages=[s for s in record["stages"] if s["stage"] == stage])
            if len(pack) < len(target.points):
                records[f"{BESIDE}{assignment}-{index}"] = dict(
                    record, stages=[s for s in record["stages"] if s["stage"] not in pack])
        records |= outcome.records
    if only is None:  # (attnkit grade graded them in the course of every assignment, with the course's points)
        course = course_graded_in_rounds(tmp_path_factory)["root"]
        for assignment in LATER:
            records |= {SAMPLE + assignment + "-" + student: record
                        for student, record in read_records(results_dir(course, assignment)).items()}
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


def test_the_reference_beside_a_pack_s_mistakes_gets_full_marks(graded):
    """A mistake costs points once: the reference modules a pack holds (stage 9's wrapper beside a wrong stage 8
    among them) pass every check, whatever the pack's other modules get wrong."""
    beside = {name: result for name, result in graded.items() if name.startswith(BESIDE)}
    assert {name.removeprefix(BESIDE).rsplit("-", 1)[0] for name in beside} == set(assignments())
    lost = {name: {s: score for s, (score, _) in result.items() if score < 1} for name, result in beside.items()}
    assert not any(lost.values()), {name: stages for name, stages in lost.items() if stages}


def test_a_stage_built_on_another_is_graded_beside_a_mistake_in_it():
    """What makes the check above reach stage 9 (and every stage built on another): some pack holds the reference
    of the stage beside a mistake in the stage it builds on (and some pack an entry of the stage beside one: its
    verdicts are on record)."""
    for assignment in assignments():
        packed = packs_of(assignment)
        for stage in stages(assignment):
            for base in builds_on((SOLUTIONS / f"{stage}.py").read_text()):
                assert any(stage not in pack and pack.get(base) in BUGS for pack in packed), (stage, base)
                assert any(stage in pack and pack.get(base) in BUGS for pack in packed), (stage, base)


def test_every_frontier_stage_has_four_named_mistakes_and_a_variant():
    for stage in stages("frontier-attention"):
        assert sum(b.stage == stage for b in BUGS) >= 4, f"{stage} needs at least four catalogued mistakes"
        assert any(v.stage == stage for v in VARIANTS), f"{stage} needs a correct variant"
    assert all(b.diagnosis for b in BUGS if b.assignment == "frontier-attention"), "a frontier mistake not named"
    assert len({e.name for e in BUGS + VARIANTS}) == len(BUGS + VARIANTS), "two entries of the same name"


def test_every_kernels_stage_has_four_named_mistakes_and_a_variant():
    for stage in stages("kernels"):
        assert sum(b.stage == stage for b in BUGS) >= 4, f"{stage} needs at least four catalogued mistakes"
        assert any(v.stage == stage for v in VARIANTS), f"{stage} needs a correct variant"
    assert all(b.diagnosis for b in BUGS if b.assignment == "kernels"), "a kernels mistake not named"


@pytest.mark.parametrize("sample", samples(), ids=lambda s: f"{s.assignment}-{s.student}")
def test_each_sample_gets_what_its_record_says(graded, sample):
    """The reference gets full marks and the stubs nothing on every stage; a mistake loses points on its stages
    only."""
    scores = {marker(stage): score for stage, (score, _) in graded[SAMPLE + sample.assignment + "-" +
                                                                    sample.student].items()}
    assert len(scores) == len(stages(sample.assignment))
    if "*" in sample.breaks:
        wrong = {m: score for m, score in scores.items() if score != 0}
    else:  # (full marks exactly where it breaks nothing)
        wrong = {m: score for m, score in scores.items() if (score == 1) == (m in sample.breaks)}
    assert not wrong, f"{sample.student} ({sample.expected()}): {wrong}"


def test_a_stage_left_as_its_stub_is_not_written_yet_never_a_mistake(records):
    """A check that reaches a stub fails saying "Not written yet" (as a student's pytest does), in the message that
    nbgrader's cells, Gradescope and the feedback show, never "Likely mistake:"; no mistake is recorded."""
    untouched = [record for name, record in records.items() if name.startswith(SAMPLE) and name.endswith("-untouched")]
    stubbed = [t for record in untouched for s in record["stages"] for t in s["tests"]
               if t["outcome"] == "failed" and "NotImplementedError" in t["message"]]
    assert len(untouched) == len(assignments()) and len(stubbed) > 100
    for t in stubbed:
        assert "Not written yet: write the code its TODO describes" in t["message"], t["message"]
        assert "Likely mistake" not in t["message"] and t["mistakes"] == [], t


@pytest.mark.parametrize("bug", BUGS, ids=entry_id)
def test_mistake_costs_points_on_its_stage_only_and_is_named(graded, bug):
    result = graded[bug.name]
    score, failures = result[bug.stage]
    assert score < 1, f"{bug.name} ({bug.why}) got full marks on {bug.stage}"
    # (Its record holds its own stage only; that it costs nothing elsewhere: test_the_reference_beside_... above.)
    assert list(result) == [bug.stage]
    if bug.diagnosis:
        assert any(bug.diagnosis in message for message in failures), (
            f"{bug.name}: no failure message says {bug.diagnosis!r}. Messages:\n" + "\n---\n".join(failures[:4])
        )


@pytest.mark.parametrize("bug", [b for b in BUGS if b.not_said], ids=entry_id)
def test_no_feedback_sends_a_mistake_to_a_wrong_fix(graded, bug):
    """A hint once shown for this mistake pointed to a fix its code already had (or to another mistake): a
    reading is shown only when the submission's own numbers bear it out, so these words appear nowhere."""
    failures = [message for _, messages in graded[bug.name].values() for message in messages]
    said = {words: [m for m in failures if words in m][:1] for words in bug.not_said
            if any(words in m for m in failures)}
    assert not said, f"{bug.name} ({bug.why}) was told what does not apply to it: {said}"


@pytest.mark.parametrize("variant", VARIANTS, ids=entry_id)
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


def flex(function, **kwargs):
    """A call of f04's ``function`` on (1, 2, 4, 4) queries, keys and values."""
    q = np.zeros((1, 2, 4, 4), np.float32)
    return "call", {"func": function, "args": [q, q, q], "kwargs": kwargs}


VMAP = ("RuntimeError: vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow. "
        "We don't support that yet, please file an issue at https://github.com/pytorch/pytorch/issues .")
DYNAMO = "Unsupported: Data-dependent branching\n  Higher Order Operator: torch.ops.higher_order.flex_attention"
INDUCTOR = "InductorError: LoweringException: PermissionError: [Errno 1] Operation not permitted\n  target: flex"
READINGS = [  # (stage module whose readings apply, error text, the failing call, words shown or None: nothing specific)
    ("s08_causal_attention", broadcast(3, 8, 1), forward(3, context_length=8),
     "a tensor sized by context_length met one sized by the sequence"),
    ("s08_causal_attention", broadcast(3, 8, 1), forward(5, context_length=8), None),  # sizes of no mask of this call
    ("s08_causal_attention", broadcast(6, 8, 1), forward(8, context_length=9), "no size of this check is 6"),
    ("s08_causal_attention", broadcast(6, 8, 1), forward(8, context_length=9, d_in=6), None),  # (6: the check's)
    ("m03_kv_cache", broadcast(3, 7, 3), cached(4, 3), "sized for the new tokens alone met something sized for all"),
    ("m03_kv_cache", broadcast(7, 12, 3), cached(4, 3), "a tensor as long as the buffer met one sized by the step"),
    ("m03_kv_cache", broadcast(3, 7, 2), cached(4, 3), None),  # the query axis: not the mask cut to the new tokens
    ("m03_kv_cache", broadcast(3, 7, 3), cached(4, 1, 2), None),  # no step with 3 new of 7 keys
    ("s08_causal_attention", broadcast(3, 7, 3), cached(4, 3), None),  # chapter 3's readings know no cache
    ("m07_tiled_attention", broadcast(4, 2, 3), tiled(10, 10, 4), "something sized for a full tile met a shorter one"),
    ("m07_tiled_attention", broadcast(4, 2, 3), tiled(8, 8, 4), None),  # no tile of 2
    ("s08_causal_attention", broadcast(4, 2, 3), tiled(10, 10, 4), None),
    ("s10_multihead_attention", "AttributeError: 'CausalAttention' object has no attribute 'num_heads'",
     forward(4, context_length=6), "self.num_heads is used but never set"),
    ("s10_multihead_attention", "AttributeError: 'Tensor' object has no attribute 'num_heads'",
     forward(4, context_length=6), None),
    ("s10_multihead_attention", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x4 and 3x2)",
     forward(4, context_length=6), "No size of this check is 3"),
    ("s10_multihead_attention", "RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x4 and 2x4)",
     forward(4, context_length=6), "The second matrix transposed, (4x2), would fit"),
    ("s10_multihead_attention", "RuntimeError: shape '[2, 4, 3, 1]' is invalid for input of size 16",
     forward(4, context_length=6, num_heads=1), "asks for 3 x num_heads (1) = 3 values per token, where the tensor "
     "holds 2"),
    ("s10_multihead_attention", "RuntimeError: shape '[2, 4, 2, 1]' is invalid for input of size 48",
     forward(4, context_length=6, num_heads=1), "Per token: the view asks for d_out"),  # (the tensor: 3 * d_out)
    ("s01_attention_scores", "NotImplementedError: s01_attention_scores: attention_scores_loop: see its TODO", None,
     "Not written yet"),
    ("s01_attention_scores", "NotImplementedError: ", None, "Not written yet"),  # nbgrader's stub
    ("s01_attention_scores", "NotImplementedError: Could not run 'aten::_foo' with arguments from the 'CUDA' backend",
     None, None),
    # f04's readings of FlexAttention's errors: shown only for a call that ran the learner's mods (named), or compiled
    ("f04_flex_attention", VMAP, flex("sliding_window_attention", window=2), "sliding_window(window)'s mask_mod"),
    ("f04_flex_attention", VMAP, flex("packed_attention", document_ids=np.zeros(4, np.int64)), "document_causal"),
    ("f04_flex_attention", DYNAMO, flex("gemma2_attention", cap=2.0), "soft_cap(cap)'s score_mod and causal"),
    ("f04_flex_attention", VMAP, flex("attend"), None),  # no mod of the learner's ran
    ("f04_flex_attention", VMAP, None, None),  # no call of the stage's
    ("f04_flex_attention", INDUCTOR, flex("alibi_attention"), "call flex_attention directly"),
    ("f04_flex_attention", INDUCTOR, None, None),
    ("f02_attention_sinks", VMAP, flex("sliding_window_attention", window=2), None),  # another stage's readings
]


@pytest.mark.parametrize(("stage", "text", "call", "words"), READINGS)
def test_an_error_is_read_only_as_far_as_its_evidence_goes(suite, stage, text, call, words):
    """What an exception means is read from its own message (never the traceback a sandbox appends, which quotes
    the learner's code) and checked against the call that raised it: a reading the sizes do not bear out says
    nothing."""
    checks = suite("diagnosis")
    text = checks.error_text("SubmissionError", f"{text}\nwhere (most recent call last):\n  mask")
    found = checks.error_findings(text, call and checks.Call(*call), getattr(suite(f"test_{stage}"), "ERROR_READINGS",
                                                                              None))
    # (where no reading holds, the sizes torch quotes are named and nothing more: no cause, none was reproduced)
    general = call and checks.size_reading(text, checks.Call(*call))
    said = [" ".join(f.lines()) for f in found if f != general]
    assert all(f.causes == () for f in found if f == general)
    assert (words is None and not said) or (words is not None and any(words in s for s in said)), said
    # (a reading of sizes states facts: a cause only where the error's own text is the cause)
    assert all(f.causes == () for f in found if not f.proven), said
