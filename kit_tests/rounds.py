"""The course of every assignment, graded in rounds (kit_tests/course/test_assignment_rounds.py checks it): built
with every assignment, each released; the reference submits every assignment and each later assignment's samples
submit theirs. For each later assignment nbgrader autogrades two students (the reference, and the first sample with
one mistake: its feedback names it) and writes their feedback, then ``attnkit grade`` grades every sample and
``attnkit report`` reports; last, nbgrader autogrades the reference's chapter-3 submission.

Made once per test run (kit_tests/shared.py): the catalogue (kit_tests/grading/test_catalogue.py) reads the
records ``attnkit grade`` wrote here for the later assignments' samples instead of grading them a second time.
"""
from __future__ import annotations

from pathlib import Path

from shared import once

from grader.cli import main
from grader.course.build import build
from grader.course.demo import stage_scores
from grader.course.samples import samples, write_submission
from grader.course.settings import Course
from grader.kit import assignments
from runs import Nbgrader

ASSIGNMENTS = list(assignments())  # the kit's assignments, in teaching order
FIRST, LATER = ASSIGNMENTS[0], ASSIGNMENTS[1:]
BOTH = "reference"  # also submits chapter 3's assignment


def autograded(assignment):
    """The students nbgrader autogrades: the reference, and the first sample with one mistake
    (its feedback names it)."""
    return [BOTH, next(s.student for s in samples(assignment) if s.breaks and "*" not in s.breaks)]


def graded_in_rounds(folder: Path) -> dict:
    """The course (in ``folder``), and for each later assignment {student: {stage: nbgrader's score}} of the
    students it autogrades."""
    root = folder / "course"
    build(root)
    nbgrader = Nbgrader(root)
    for name in ASSIGNMENTS:
        nbgrader("generate_assignment", name)
    for sample in samples():
        if sample.assignment in LATER or sample.student == BOTH:
            write_submission(sample, root / "release" / sample.assignment,
                             root / "submitted" / sample.student / sample.assignment)
    scores = {}
    for name in LATER:
        for student in autograded(name):
            nbgrader("autograde", name, "--student", student)
        nbgrader("generate_feedback", name)
        scores[name] = stage_scores(Course.load(root, name), autograded(name))
        assert main(["grade", name, "--course", str(root)]) == 0
        assert main(["report", name, "--course", str(root)]) == 0
    nbgrader("autograde", FIRST, "--student", BOTH)
    return dict(root=str(root), scores=scores)


def course_graded_in_rounds(tmp_path_factory) -> dict:
    """``graded_in_rounds``, once per test run: {"root": the course's Path, "scores": ...}."""
    made = once(tmp_path_factory, "every-assignment", graded_in_rounds)
    return dict(made, root=Path(made["root"]))
