"""The grading worker drives pytest through its public hooks only: it replaces the test loop
(``pytest_runtestloop``) and runs the collected checks once per submission, relying on pytest to
set the suite's session fixtures up again for each one. These tests fail loudly if a pytest
release changes that, instead of letting it grade one submission with another's implementation.
"""
from types import SimpleNamespace

from grader import submission as S
from grader.plugin import GradingPlugin
from grader.samples import by_student
from grader.sandbox import Limits
from grader.worker import JobLoop, WorkerProcess


def job(folder):
    sources = S.sources(folder)
    return {"sources": sources, "seed": S.seed_of(S.fingerprint(sources))}


def graded(worker, jobs):
    try:
        return [[(t["nodeid"], t["outcome"], t["message"]) for t in worker.grade(j)["tests"]] for j in jobs]
    finally:
        worker.close()


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
