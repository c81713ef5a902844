"""Grades an instructor can trust: every catalogued mistake loses points on its own stage, with its
cause named, and every correct variant gets full marks.

Each submission goes through the same isolated grading run that nbgrader's autograder cells use
(grader.autograde.run_suite: the full suite, book tests excluded, learner code in the sandbox).
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from catalogue import BUGS, DEPENDENTS, VARIANTS
from grader import SOLUTIONS
from grader.autograde import run_suite, stage_score
from grader.kit import marker, stages

pytestmark = [pytest.mark.kit, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """name -> {stage: (score out of 1, [failure messages])}, all submissions graded two at a time."""
    root = tmp_path_factory.mktemp("catalogue")

    def grade(entry):
        results = run_suite(entry.build(SOLUTIONS, root / entry.name))
        per_stage = {}
        for stage in stages():
            tests = [t for t in results["tests"] if t["marker"] == marker(stage)]
            per_stage[stage] = (stage_score(tests, 1.0), [t["message"] for t in tests if t["outcome"] == "failed"])
        return entry.name, per_stage

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(grade, BUGS + VARIANTS))


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
    others = {s: r[0] for s, r in result.items() if s != bug.stage and s not in DEPENDENTS.get(bug.stage, ())}
    assert all(v == 1 for v in others.values()), f"{bug.name} lost points on unrelated stages: {others}"
    if bug.diagnosis:
        assert any(bug.diagnosis in message for message in failures), (
            f"{bug.name}: no failure message says {bug.diagnosis!r}. Messages:\n" + "\n---\n".join(failures[:4])
        )


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_correct_variant_gets_full_marks(graded, variant):
    lost = {s: (score, failures[:1]) for s, (score, failures) in graded[variant.name].items() if score < 1}
    assert not lost, f"{variant.name} ({variant.why}) lost points: {lost}"
