"""The tamper corpora of the assignments after chapter 3's (``tamper.ASSIGNMENT_CORPORA``: modern-attention's,
frontier-attention's) graded by ``attnkit grade``, as kit_tests/grading/test_tamper_grade.py grades chapter 3's,
each in a course of its own: an honest bystander graded alone, then the corpus and a late copy of the bystander in
one run with one worker (one sandbox template serves everybody). Each entry gets the grade its honest work
deserves, with the reason in its feedback; the late bystander's record is byte-identical to the early one; nothing
outside the records changed, and nothing is left in TMPDIR.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from grader.course.build import build
from grader.course.samples import by_student, write_submission
from grader.course.settings import Course
from grader.grading import records as R
from grader.kit import KIT, marker, stages
from runs import Nbgrader, attnkit_grade, expected_scores, feedback, file_hashes, graded_content
from tamper import ASSIGNMENT_CORPORA, LATE, Context, write_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BYSTANDER = "reference"
CORPORA = {assignment: corpus() for assignment, corpus in ASSIGNMENT_CORPORA.items()}
ENTRIES = [(assignment, entry) for assignment, corpus in CORPORA.items() for entry in corpus]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """assignment -> its course graded (the bystander alone, then the corpus with the late bystander), each graded
    when a test first asks for it."""
    done = {}

    def of(assignment):
        if assignment not in done:
            done[assignment] = grade_corpus(tmp_path_factory, assignment, CORPORA[assignment])
        return done[assignment]

    return of


def grade_corpus(tmp_path_factory, assignment, corpus):
    root = tmp_path_factory.mktemp(f"tamper-{assignment}") / "course"
    tmpdir = tmp_path_factory.mktemp("tmpdir")
    build(root, assignments=[assignment], test_timeout=3.0)
    Nbgrader(root)("generate_assignment", assignment)
    release, out = root / "release" / assignment, R.results_dir(root, assignment)
    write_submission(by_student(BYSTANDER, assignment), release, root / "submitted" / BYSTANDER / assignment)
    attnkit_grade(root, tmpdir, assignment)
    alone = R.read_record(R.record_path(out, BYSTANDER))

    ctx = Context(course=root, assignment=assignment, bystanders=(BYSTANDER,))
    for entry in corpus:
        write_entry(entry, ctx, release, root / "submitted" / entry.name / assignment)
    write_submission(by_student(BYSTANDER, assignment), release, root / "submitted" / (LATE + BYSTANDER) / assignment)
    files_before = file_hashes(root, skip=[out.relative_to(root), Path("gradebook.db")])
    attnkit_grade(root, tmpdir, assignment)
    return dict(course=Course.load(root, assignment), root=root, out=out, alone=alone, records=R.read_records(out),
                files_before=files_before, tmpdir=tmpdir)


@pytest.mark.parametrize(("assignment", "entry"), ENTRIES, ids=lambda x: getattr(x, "name", x))
def test_entry_gets_its_honest_grade_and_the_reason(graded, assignment, entry):
    g = graded(assignment)
    record = g["records"][entry.name]
    got = {s["stage"]: s["points"] for s in record["stages"]}
    assert got == pytest.approx(expected_scores(g["course"], entry), abs=1e-6), f"{entry.name} ({entry.description})"
    for reason in entry.reasons:
        assert reason in feedback(record), f"{entry.name}: {reason!r} not in its feedback"


@pytest.mark.parametrize("assignment", CORPORA)
def test_the_late_bystander_is_graded_byte_for_byte_as_alone(graded, assignment):
    late = graded(assignment)["records"][LATE + BYSTANDER]
    assert graded_content(late) == graded_content(graded(assignment)["alone"])
    assert late["total"] == late["max_total"]


@pytest.mark.parametrize("assignment", CORPORA)
def test_nothing_outside_the_records_changed_and_nothing_is_left(graded, assignment):
    g = graded(assignment)
    root = g["root"]
    after = file_hashes(root, skip=[g["out"].relative_to(root), Path("gradebook.db")])
    assert after == g["files_before"]
    assert not (KIT / "pwned.txt").exists() and not (KIT / "solutions" / "pwned.txt").exists()
    assert list(g["tmpdir"].iterdir()) == [], "files left in TMPDIR"


@pytest.mark.parametrize("assignment", CORPORA)
def test_every_stage_is_attacked(assignment):
    """By an attacker: the late victims (the untouched stubs) do not count."""
    attacked = {marker(stage) for entry in CORPORA[assignment] if not entry.name.startswith(LATE)
                for stage in entry.modules(Context(KIT, assignment, ()))}
    assert attacked == {marker(s) for s in stages(assignment)}
