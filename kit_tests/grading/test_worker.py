"""The grading worker drives pytest through its public hooks only: it replaces the test loop
(``pytest_runtestloop``) and runs the collected checks once per submission, relying on pytest to
set the suite's session fixtures up again for each one. These tests fail loudly if a pytest
release changes that, instead of letting it grade one submission with another's implementation.
"""
from types import SimpleNamespace

import pytest

from grader import submission as S
from grader.course.samples import by_student, edited, write_modules
from grader.grading.plugin import GradingPlugin
from grader.grading.worker import JobLoop, WorkerProcess
from grader.kit import SOLUTIONS, stages
from grader.sandbox.limits import Limits
from suite_runtime.stage_names import stage_of


def job(folder):
    """A job grading the submission in ``folder`` on chapter 3's stages."""
    sources = S.sources(folder)
    return {"sources": sources, "seed": S.seed_of(S.fingerprint(sources)), "stages": stages("attention")}


def graded(worker, jobs):
    try:
        return [[(t["nodeid"], t["outcome"], t["message"]) for t in worker.grade(j)["tests"]] for j in jobs]
    finally:
        worker.close()


@pytest.mark.timeout(600)  # (a whole grading: seconds idle, minutes on a loaded machine)
def test_one_session_grades_each_submission_as_a_fresh_one_does(tmp_path, monkeypatch):
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the workers' (and their sandboxes') folders go here
    reference, mistake = (by_student(name).write(tmp_path / name) for name in ("reference", "softmax-dim0"))
    warm = graded(WorkerProcess(Limits()), [job(reference), job(mistake), job(reference)])
    fresh = [graded(WorkerProcess(Limits()), [job(folder)])[0] for folder in (reference, mistake)]
    assert warm[0] == fresh[0] == warm[2], "a submission graded after another got other verdicts"
    assert warm[1] == fresh[1], "a submission graded after another got other verdicts"
    assert warm[0] != warm[1]
    assert list(scratch.iterdir()) == [], "a worker that was closed left its folders behind"


def test_a_job_whose_implementation_was_not_set_up_once_gets_no_grades(tmp_path):
    """What a pytest that kept the session fixtures (or set them up twice) would do: the job is
    answered with an error, and the submission is graded again by a fresh worker."""
    staging = tmp_path / "staging"
    staging.mkdir()
    loop = JobLoop(GradingPlugin(Limits(), sandbox=None), staging, jobs=[], answer=None, started=0.0)
    session = SimpleNamespace(items=[], config=SimpleNamespace(option=SimpleNamespace(seed=0)))  # runs nothing
    answer = loop.grade(session, job(by_student("reference").write(tmp_path / "reference")))
    assert "grading stopped rather than give grades it cannot vouch for" in answer["error"]


def test_a_mistake_in_stage_8_costs_no_points_on_stage_9(tmp_path):
    """Stage 9's wrapper imports stage 8's CausalAttention. A mask that also hides the diagonal makes
    the first token's row all -inf (NaN out of the softmax): with it, every head of a correct wrapper
    would be wrong too. Grading runs stage 9 beside the reference CausalAttention instead, so the
    mistake costs points on stage 8 only."""
    s08 = "s08_causal_attention"
    broken = edited((SOLUTIONS / f"{s08}.py").read_text(), [(
        "torch.triu(torch.ones(context_length, context_length), diagonal=1)",
        "torch.triu(torch.ones(context_length, context_length), diagonal=0)")], s08)
    folder = write_modules(tmp_path / "broken-s08", replaced={s08: broken}, assignment="attention")
    outcomes = {}
    for nodeid, outcome, _ in graded(WorkerProcess(Limits()), [job(folder)])[0]:
        outcomes.setdefault(stage_of(nodeid), []).append(outcome)
    assert "failed" in outcomes[s08]
    assert outcomes["s09_multihead_wrapper"].count("passed") >= 4
    lost = {stage: o for stage, o in outcomes.items() if stage != s08 and set(o) - {"passed", "skipped"}}
    assert not lost, f"the mistake in {s08} cost points elsewhere: {sorted(lost)}"
    assert set(outcomes) == set(stages("attention")), "a job is graded on the stages it names, and on those only"
