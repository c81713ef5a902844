"""The second assignment, modern-attention, end to end with the installed nbgrader, in a course that
holds both assignments: release, autograde, feedback, then the same class through ``attnkit grade``
and ``attnkit report``. A student who submits both assignments gets the grades of each.
"""
from __future__ import annotations

import html
import json

import nbformat
import pytest

from grader.cli import main
from grader.course.build import build, find_leaks, hidden_test_names, solution_lines
from grader.course.demo import stage_scores
from grader.course.samples import by_student, samples, write_submission
from grader.course.settings import Course
from grader.kit import assignments, marker, stages
from runs import Nbgrader

ASSIGNMENTS = list(assignments())  # the kit's assignments, in teaching order

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ASSIGNMENT = "modern-attention"
SAMPLE_STUDENTS = [s.student for s in samples(ASSIGNMENT)]
BOTH = "reference"  # also submits chapter 3's assignment


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("both") / "course"
    build(root)
    course = Course.load(root, ASSIGNMENT)
    nbgrader = Nbgrader(root)
    for name in ASSIGNMENTS:
        nbgrader("generate_assignment", name)
    for sample in samples():
        if sample.assignment == ASSIGNMENT or sample.student == BOTH:
            write_submission(sample, root / "release" / sample.assignment,
                             root / "submitted" / sample.student / sample.assignment)
    nbgrader("autograde", ASSIGNMENT)
    nbgrader("autograde", "attention", "--student", BOTH)
    nbgrader("generate_feedback", ASSIGNMENT)
    scores = stage_scores(course, SAMPLE_STUDENTS)
    assert main(["grade", ASSIGNMENT, "--course", str(root)]) == 0
    assert main(["report", ASSIGNMENT, "--course", str(root)]) == 0
    return dict(root=root, course=course, scores=scores)


def test_the_course_holds_both_assignments_each_with_its_own_stages(graded):
    c = graded["course"]
    assert list(c.assignments) == list(ASSIGNMENTS)
    assert list(c.points) == stages(ASSIGNMENT) and sum(c.points.values()) == pytest.approx(100)
    assert list(Course.load(c.root).points) == stages("attention")
    release = c.root / "release" / ASSIGNMENT
    assert sorted(p.name for p in release.glob("*.py")) == \
        sorted(["conftest.py", "notebook_tools.py"] + [f"{s}.py" for s in c.points])
    assert sorted(p.stem for p in (release / "fixtures" / "public").glob("*.npz")) == \
        sorted(s for s in c.points if (release / "fixtures" / "public" / f"{s}.npz").is_file())
    assert all(p.stem in c.points for p in (release / "fixtures" / "public").glob("*.npz"))
    assert sorted(p.name for p in (release / "tests").glob("test_*.py")) == [f"test_{s}.py" for s in c.points]


def test_the_release_holds_no_solution_hidden_test_or_hidden_fixture(graded):
    release = graded["root"] / "release" / ASSIGNMENT
    assert find_leaks(release, hidden_test_names(), solution_lines()) == []
    nb = nbformat.read(release / f"{ASSIGNMENT}.ipynb", as_version=4)
    grade_cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert [c.metadata["nbgrader"]["grade_id"] for c in grade_cells] == [f"grade_{s}" for s in stages(ASSIGNMENT)]
    assert all(c.metadata["nbgrader"]["locked"] for c in grade_cells)
    assert not any("Grading(" in c.source or "HIDDEN" in c.source for c in nb.cells)


def test_samples_lose_points_exactly_on_the_stages_they_break(graded):
    c, scores = graded["course"], graded["scores"]
    for student in SAMPLE_STUDENTS:
        sample = by_student(student, ASSIGNMENT)
        lost = {marker(s) for s, score in scores[student].items() if score < c.points[s] - 1e-9}
        expected = {marker(s) for s in c.points} if "*" in sample.breaks else set(sample.breaks)
        assert lost == expected, (student, scores[student])
    assert sum(scores["untouched"].values()) == 0


def test_attnkit_grade_gives_nbgrader_s_scores_and_keeps_the_other_assignment(graded):
    root, scores = graded["root"], graded["scores"]
    for student in SAMPLE_STUDENTS:
        record = json.loads((root / "attnkit-grades" / ASSIGNMENT / f"{student}.json").read_text())
        assert {s["stage"]: s["points"] for s in record["stages"]} == pytest.approx(scores[student]), student
    chapter3 = stage_scores(Course.load(root, "attention"), [BOTH])[BOTH]
    assert chapter3 == Course.load(root, "attention").points, "the chapter-3 grades of a student with both"
    assert (root / "attnkit-grades" / ASSIGNMENT / "report" / "index.html").is_file()


def test_feedback_names_each_stage_and_hides_the_hidden_tests(graded):
    root = graded["root"]
    for student in SAMPLE_STUDENTS:
        page = html.unescape((root / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text())
        assert "BEGIN HIDDEN TESTS" not in page and "Grading(" not in page, student
        assert "Stage 1: " in page and f"Stage {len(stages(ASSIGNMENT))}: " in page, student
    broken = next(s for s in samples(ASSIGNMENT) if s.breaks and "*" not in s.breaks)
    page = html.unescape((root / "feedback" / broken.student / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text())
    assert "Likely mistake" in page, broken.student


def test_rebuilding_one_assignment_keeps_the_other(graded, tmp_path):
    root = tmp_path / "course"
    build(root, assignments=["attention"])
    assert list(Course.load(root).assignments) == ["attention"]
    build(root, assignments=[ASSIGNMENT])
    assert list(Course.load(root).assignments) == ["attention", ASSIGNMENT]
    assert (root / "source" / "attention" / "attention.ipynb").is_file()
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()  # (it reads the course's settings)
    assert config.Autograde.exclude_overwriting[ASSIGNMENT] == [f"{s}.py" for s in stages(ASSIGNMENT)]
