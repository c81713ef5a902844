"""The assignments after chapter 3's (modern-attention, frontier-attention: every assignment but the first; chapter
3's is kit_tests/course/test_nbgrader_course.py's) end to end with the installed nbgrader, in a course that holds
every assignment: release, autograde, feedback, then the same class through ``attnkit grade`` and ``attnkit
report``, which must give nbgrader's score on every stage. A student who submits several assignments gets the
grades of each.

nbgrader autogrades two students of each assignment (the reference, and a sample with one mistake, whose feedback
names it); ``attnkit grade`` grades every sample, and must give nbgrader's scores where both graded. That every
sample loses points exactly where it breaks, graded either way, is also checked for every assignment by
kit_tests/grading/test_catalogue.py (attnkit grade) and for chapter 3 by test_nbgrader_course.py (nbgrader).
"""
from __future__ import annotations

import html

import nbformat
import pytest
from rounds import ASSIGNMENTS, BOTH, FIRST, LATER, autograded, course_graded_in_rounds

from grader.course.build import build, find_leaks, hidden_test_names, solution_lines
from grader.course.demo import stage_scores
from grader.course.samples import by_student, samples
from grader.course.settings import Course
from grader.grading.records import read_records, results_dir
from grader.kit import marker, stages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def students(assignment):
    return [s.student for s in samples(assignment)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The course, and for each later assignment {student: {stage: nbgrader's score}} of the students it autogrades
    (kit_tests/rounds.py: made once per test run, the catalogue reads its records too)."""
    return course_graded_in_rounds(tmp_path_factory)


def recorded(root, assignment) -> dict:
    """{student: {stage: points}} of attnkit grade's records of ``assignment``."""
    return {student: {s["stage"]: s["points"] for s in record["stages"]}
            for student, record in read_records(results_dir(root, assignment)).items()}


@pytest.mark.parametrize("assignment", LATER)
def test_the_course_holds_every_assignment_each_with_its_own_stages(graded, assignment):
    c = Course.load(graded["root"], assignment)
    assert list(c.assignments) == list(ASSIGNMENTS)
    assert list(c.points) == stages(assignment) and sum(c.points.values()) == pytest.approx(100)
    assert list(Course.load(c.root).points) == stages(FIRST)
    release = c.root / "release" / assignment
    assert sorted(p.name for p in release.glob("*.py")) == \
        sorted(["conftest.py", "notebook_tools.py"] + [f"{s}.py" for s in c.points])
    assert sorted(p.stem for p in (release / "fixtures" / "public").glob("*.npz")) == \
        sorted(s for s in c.points if (release / "fixtures" / "public" / f"{s}.npz").is_file())
    assert all(p.stem in c.points for p in (release / "fixtures" / "public").glob("*.npz"))
    assert sorted(p.name for p in (release / "tests").glob("test_*.py")) == [f"test_{s}.py" for s in c.points]


@pytest.mark.parametrize("assignment", LATER)
def test_the_release_holds_no_solution_hidden_test_or_hidden_fixture(graded, assignment):
    release = graded["root"] / "release" / assignment
    assert find_leaks(release, hidden_test_names(), solution_lines()) == []
    nb = nbformat.read(release / f"{assignment}.ipynb", as_version=4)
    grade_cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert [c.metadata["nbgrader"]["grade_id"] for c in grade_cells] == [f"grade_{s}" for s in stages(assignment)]
    assert all(c.metadata["nbgrader"]["locked"] for c in grade_cells)
    assert not any("Grading(" in c.source or "HIDDEN" in c.source for c in nb.cells)


@pytest.mark.parametrize("assignment", LATER)
def test_samples_lose_points_exactly_on_the_stages_they_break(graded, assignment):
    c, scores = Course.load(graded["root"], assignment), recorded(graded["root"], assignment)
    for student in students(assignment):
        sample = by_student(student, assignment)
        lost = {marker(s) for s, score in scores[student].items() if score < c.points[s] - 1e-9}
        expected = {marker(s) for s in c.points} if "*" in sample.breaks else set(sample.breaks)
        assert lost == expected, (student, scores[student])
    assert sum(scores["untouched"].values()) == 0 and sum(scores[BOTH].values()) == pytest.approx(100)


@pytest.mark.parametrize("assignment", LATER)
def test_attnkit_grade_gives_nbgrader_s_scores_and_keeps_the_other_assignments(graded, assignment):
    root, scores = graded["root"], graded["scores"][assignment]
    records = recorded(root, assignment)
    assert sorted(records) == sorted(students(assignment)), "attnkit grade grades every sample"
    for student in autograded(assignment):
        assert records[student] == pytest.approx(scores[student]), student
    chapter3 = stage_scores(Course.load(root, FIRST), [BOTH])[BOTH]
    assert chapter3 == Course.load(root, FIRST).points, "the chapter-3 grades of a student with several"
    assert (root / "attnkit-grades" / assignment / "report" / "index.html").is_file()


@pytest.mark.parametrize("assignment", LATER)
def test_feedback_names_each_stage_and_hides_the_hidden_tests(graded, assignment):
    root = graded["root"]
    for student in autograded(assignment):
        page = html.unescape((root / "feedback" / student / assignment / f"{assignment}.html").read_text())
        assert "BEGIN HIDDEN TESTS" not in page and "Grading(" not in page, student
        assert "Stage 1: " in page and f"Stage {len(stages(assignment))}: " in page, student
    broken = autograded(assignment)[1]
    page = html.unescape((root / "feedback" / broken / assignment / f"{assignment}.html").read_text())
    assert "Likely mistake" in page, broken


@pytest.mark.parametrize("assignment", LATER)
def test_rebuilding_one_assignment_keeps_the_other(assignment, tmp_path):
    root = tmp_path / "course"
    build(root, assignments=[FIRST])
    assert list(Course.load(root).assignments) == [FIRST]
    build(root, assignments=[assignment])
    assert list(Course.load(root).assignments) == [FIRST, assignment]
    assert (root / "source" / FIRST / f"{FIRST}.ipynb").is_file()
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()  # (it reads the course's settings)
    assert config.Autograde.exclude_overwriting[assignment] == [f"{s}.py" for s in stages(assignment)]
