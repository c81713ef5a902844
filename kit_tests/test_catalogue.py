"""Grades an instructor can trust: every catalogued mistake loses points on its own stage, with its
cause named, and every correct variant gets full marks; the grades of the catalogue and of the
demo's samples are the ones on record.

Each submission is graded as ``attnkit grade`` grades a class (the full suite, book tests excluded,
learner code in the sandbox), the way nbgrader's autograder cells grade it too (grader.worker).
"""
import pytest
from verdicts import verdicts

from catalogue import BUGS, VARIANTS
from grader.grade import grade
from grader.kit import ASSIGNMENTS, stages
from grader.samples import SAMPLES
from grader.scoring import stage_score
from grader.targets import folder_target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAMPLE = "sample-"  # the demo's samples are graded in the same run, under this prefix


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """name -> record of every catalogue entry and sample, all graded in one run of attnkit grade's
    warm workers (torch imported once per worker)."""
    root = tmp_path_factory.mktemp("catalogue")
    records = {}
    for assignment in ASSIGNMENTS:  # each graded on its own assignment's stages, as a course grades it
        folder = root / assignment
        for entry in BUGS + VARIANTS:
            if entry.assignment == assignment:
                entry.build(folder / "submissions" / entry.name)
        for sample in SAMPLES:
            if sample.assignment == assignment:
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
