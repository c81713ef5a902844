"""The tamper corpus of modern-attention (``tamper.modern_corpus``) graded by ``attnkit grade``, as
kit_tests/grading/test_tamper_grade.py grades chapter 3's: an honest bystander graded alone, then the corpus
and a late copy of the bystander in one run with one worker (one sandbox template serves everybody).
Each entry gets the grade its honest work deserves, with the reason in its feedback; the late
bystander's record is byte-identical to the early one; nothing outside the records changed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grader.course.build import build
from grader.course.samples import by_student, write_submission
from grader.course.settings import Course
from grader.grading import records as R
from grader.kit import KIT, marker, stages
from runs import attnkit_grade, expected_scores, feedback, file_hashes, graded_content
from tamper import LATE, Context, modern_corpus, write_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ASSIGNMENT = "modern-attention"
BYSTANDER = "reference"
CORPUS = modern_corpus()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("tamper-modern") / "course"
    tmpdir = tmp_path_factory.mktemp("tmpdir")
    build(root, assignments=[ASSIGNMENT], test_timeout=3.0)
    run = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", ASSIGNMENT], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    release, out = root / "release" / ASSIGNMENT, R.results_dir(root, ASSIGNMENT)
    write_submission(by_student(BYSTANDER, ASSIGNMENT), release, root / "submitted" / BYSTANDER / ASSIGNMENT)
    attnkit_grade(root, tmpdir, ASSIGNMENT)
    alone = R.read_record(R.record_path(out, BYSTANDER))

    ctx = Context(course=root, assignment=ASSIGNMENT, bystanders=(BYSTANDER,))
    for entry in CORPUS:
        write_entry(entry, ctx, release, root / "submitted" / entry.name / ASSIGNMENT)
    write_submission(by_student(BYSTANDER, ASSIGNMENT), release, root / "submitted" / (LATE + BYSTANDER) / ASSIGNMENT)
    files_before = file_hashes(root, skip=[out.relative_to(root), Path("gradebook.db")])
    attnkit_grade(root, tmpdir, ASSIGNMENT)
    return dict(course=Course.load(root, ASSIGNMENT), root=root, out=out, alone=alone, records=R.read_records(out),
                files_before=files_before, tmpdir=tmpdir)


@pytest.mark.parametrize("entry", CORPUS, ids=lambda e: e.name)
def test_entry_gets_its_honest_grade_and_the_reason(graded, entry):
    record = graded["records"][entry.name]
    got = {s["stage"]: s["points"] for s in record["stages"]}
    assert got == pytest.approx(expected_scores(graded["course"], entry), abs=1e-6), entry.name
    for reason in entry.reasons:
        assert reason in feedback(record), f"{entry.name}: {reason!r} not in its feedback"


def test_the_late_bystander_is_graded_byte_for_byte_as_alone(graded):
    late = graded["records"][LATE + BYSTANDER]
    assert graded_content(late) == graded_content(graded["alone"])
    assert late["total"] == late["max_total"]


def test_nothing_outside_the_records_changed_and_nothing_is_left(graded):
    root = graded["root"]
    after = file_hashes(root, skip=[graded["out"].relative_to(root), Path("gradebook.db")])
    assert after == graded["files_before"]
    assert not (KIT / "pwned.txt").exists() and not (KIT / "solutions" / "pwned.txt").exists()
    assert list(graded["tmpdir"].iterdir()) == [], "files left in TMPDIR"


def test_every_stage_of_modern_attention_is_attacked():
    attacked = {marker(stage) for entry in CORPUS for stage in entry.modules(Context(KIT, ASSIGNMENT, ()))}
    assert attacked == {marker(s) for s in stages(ASSIGNMENT)}
