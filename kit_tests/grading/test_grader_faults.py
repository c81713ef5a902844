"""A failure of the grader is never a grade, on any path: ``attnkit grade``, nbgrader's ``autograde``, Gradescope's
``run_autograder``.

Faults of the grader's own machinery are made mid-run (grader/grading/faults.py, ``ATTNKIT_INJECT_FAULT``): the
sandbox that cannot start, its template killed, a box's first process killed, the grading worker dying, the reference
failing in the trusted process; each at the third check of a submission, after two have passed. A submission the
grader failed on is graded again in a fresh worker and sandbox; when that fails too it gets no score anywhere:
``attnkit grade`` writes no record and no gradebook row and says why (exit status 1), nbgrader's autograde fails for
that submission (non-zero exit, the reason on the terminal, no submission in the gradebook, or the grades it had
before), ``run_autograder`` writes no results.json and exits non-zero (Gradescope then shows an autograder failure).
A fault that strikes once costs nothing: the retry gives the submission its grade. Every kind meets at least one
path and every path at least two kinds: beyond the grading worker's answer the paths share nothing a kind changes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from gradescope_results import unzip

from grader.course.build import build
from grader.course.samples import by_student, write_submission
from grader.grading import records as R
from grader.grading.faults import VARIABLE
from grader.outputs.gradescope import ROOT_ENV
from runs import Nbgrader, nbgrader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ASSIGNMENT = "attention"
NOT_THE_STUDENT = "the grader failed"  # what every path says: the failure is the grader's, not the student's work


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults") / "course"
    build(root, assignments=[ASSIGNMENT])
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    return root


def submit(course, student, sample="reference"):
    write_submission(by_student(sample), course / "release" / ASSIGNMENT, course / "submitted" / student / ASSIGNMENT)


def with_fault(fault: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    return env if fault is None else {**env, VARIABLE: fault}


def attnkit_grade(course, fault, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grader.cli", "grade", ASSIGNMENT, "--course", str(course),
                           "--workers", "1", "--quiet"], capture_output=True, text=True,
                          env={**with_fault(fault), "TMPDIR": str(tmp_path)})


def gradebook_submissions(course) -> dict:
    """student -> total score of each submission the gradebook holds."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s.student.id: s.score for s in gb.assignment_submissions(ASSIGNMENT)}


@pytest.mark.parametrize("fault", ["template@3", "reference@3"])
def test_attnkit_grade_records_no_grade(course, fault, tmp_path):
    student = f"attnkit-{fault.split('@')[0]}"
    submit(course, student)
    run = attnkit_grade(course, fault, tmp_path)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said[-3000:]
    assert f"not graded: {student}" in said and NOT_THE_STUDENT in said, said[-3000:]
    assert "attempt 2 of 2" in said  # (tried again in a fresh worker first)
    assert R.read_record(R.record_path(R.results_dir(course, ASSIGNMENT), student)) is None
    assert student not in gradebook_submissions(course)
    assert list(tmp_path.iterdir()) == []  # (no folder of the failed workers is left behind)


def test_attnkit_grade_grades_again_in_a_fresh_worker(course, tmp_path):
    """A fault that strikes once (the first worker's template killed mid-run): the retry grades the submission."""
    student = "attnkit-once"
    submit(course, student)
    run = attnkit_grade(course, f"template@3@{tmp_path / 'struck'}", tmp_path)
    assert run.returncode == 0 and (tmp_path / "struck").exists(), run.stderr[-3000:]
    record = R.read_record(R.record_path(R.results_dir(course, ASSIGNMENT), student))
    assert record["total"] == record["max_total"]
    (tmp_path / "struck").unlink()


def test_nbgrader_autograde_fails_loudly_and_keeps_no_grade(course):
    """The sandbox cannot start (issue 33: a Python the boxes cannot read): every student's autograde fails, none gets
    a grade row, nbgrader says why and exits non-zero. Graded later without the fault: full marks. A regrade the
    grading worker dies in fails as loudly and keeps the grades the submission had."""
    students = ["nbgrader-a", "nbgrader-b"]
    for student in students:
        submit(course, student)
    env = with_fault("start@1")
    run = nbgrader("autograde", ASSIGNMENT, "--student=nbgrader-?", cwd=course, env=env)  # (both)
    said = run.stdout + run.stderr
    assert run.returncode != 0, said[-3000:]
    assert NOT_THE_STUDENT in said and "the sandbox's template could not start" in said, said[-3000:]
    assert not set(students) & set(gradebook_submissions(course))
    assert not any((course / "autograded" / s / ASSIGNMENT).exists() for s in students)

    Nbgrader(course)("autograde", ASSIGNMENT, f"--student={students[0]}", env=with_fault(None))
    full = gradebook_submissions(course)[students[0]]
    assert full == 100
    run = nbgrader("autograde", ASSIGNMENT, f"--student={students[0]}", "--force", cwd=course,
                   env=with_fault("worker@3"))
    assert run.returncode != 0 and "the grading worker died" in run.stdout + run.stderr
    assert gradebook_submissions(course)[students[0]] == full


def test_run_autograder_writes_no_results_and_exits_non_zero(course, tmp_path):
    """A box killed mid-run, in both the first worker and the retry: no results.json (Gradescope then reports an
    autograder failure), a non-zero exit, the reason in the log; struck once, the retry gives the score."""
    subprocess.run([sys.executable, "-m", "grader.cli", "gradescope", ASSIGNMENT, "--out", str(tmp_path / "ag.zip")],
                   check=True, capture_output=True)
    root = tmp_path / "autograder"
    unzip(tmp_path / "ag.zip", root / "source")
    by_student("reference").write(root / "submission")

    def run_autograder(fault):
        shutil.rmtree(root / "results", ignore_errors=True)
        (root / "results").mkdir()
        env = {k: v for k, v in with_fault(fault).items() if k != "PYTHONPATH"}
        return subprocess.run([str(root / "source" / "run_autograder")], cwd=root, capture_output=True, text=True,
                              env={**env, ROOT_ENV: str(root), "PATH": f"{os.path.dirname(sys.executable)}:"
                                                                         f"{os.environ['PATH']}"})

    failed = run_autograder("box@3")
    assert failed.returncode != 0, failed.stdout[-3000:]
    assert not (root / "results" / "results.json").exists()
    assert NOT_THE_STUDENT in failed.stdout and "the autograder failed" in failed.stdout, failed.stdout[-3000:]

    once = run_autograder(f"box@3@{tmp_path / 'struck'}")
    assert once.returncode == 0 and (tmp_path / "struck").exists(), once.stdout[-3000:]
    assert json.loads((root / "results" / "results.json").read_text())["score"] == 100
