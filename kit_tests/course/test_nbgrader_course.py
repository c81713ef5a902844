"""End to end with the installed nbgrader: build a course, release it, collect submissions through
the exchange and zip_collect, autograde, write feedback, export, regrade.

One course is built and graded per module (the fixture ``graded``); the tests read the results.
Every nbgrader step runs nbgrader's own command line, unmodified.
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from grader.course.build import build, hidden_test_names, solution_lines
from grader.course.demo import stage_scores
from grader.course.samples import by_student, write_submission
from grader.grading.scoring import stage_score
from grader.grading.worker import grade_folder
from grader.kit import FIXTURES, SOLUTIONS, marker, stages, suite_files
from grader.sandbox.limits import Limits
from runs import Nbgrader
from suite_runtime.stage_names import module_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ASSIGNMENT = "attention"
# graded through the exchange (release/fetch/submit/collect), through zip_collect, or copied into submitted/
VIA_EXCHANGE = "reference"
VIA_ZIP = "noisy-correct"
COPIED = ("untouched", "tril-for-triu", "syntax-error")
STUDENTS = (VIA_EXCHANGE, VIA_ZIP) + COPIED
TAMPERED = "tril-for-triu"  # also carries an extra notebook cell and a fake grader/ package


EDITED_CELL = "grade_s01_attention_scores"  # the locked autograder cell the tampered submission edits


def tamper(folder: Path):
    """What a student might try: a notebook cell that patches the grader, an edit of a locked
    autograder cell, and a grader/ package next to the notebook that would shadow the real one if
    the kernel imported from its cwd."""
    path = folder / f"{ASSIGNMENT}.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(2, nbformat.v4.new_code_cell(
        "import grader.grading.scoring as g\ng.stage_score = lambda tests, points: points\n"))
    (edited,) = [cell for cell in nb.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == EDITED_CELL]
    edited.source += "\nprint('tampered: full marks please')"
    nbformat.write(nb, path)
    (folder / "grader" / "course").mkdir(parents=True)
    (folder / "grader" / "__init__.py").write_text("")
    (folder / "grader" / "course" / "__init__.py").write_text("")
    (folder / "grader" / "course" / "cells.py").write_text(
        "class Grading:\n    def stage(self, marker, points):\n        return points\n")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("course")
    course = tmp / "course"
    db = tmp / "elsewhere" / "grades.sqlite"
    db.parent.mkdir()
    exchange = tmp / "exchange"
    c = build(course, db_url=f"sqlite:///{db}", exchange_root=str(exchange))

    nbgrader = Nbgrader(course)
    start = time.monotonic()
    generated = nbgrader("generate_assignment", ASSIGNMENT)
    release = course / "release" / ASSIGNMENT
    # No line per file copied (a hundred of them buried nbgrader's other lines); they are there at DEBUG.
    assert "Copying " not in generated.stdout + generated.stderr and "Updating/creating assignment" in generated.stderr

    # 1. the exchange: release, a student fetches and submits, the instructor collects
    nbgrader("release_assignment", ASSIGNMENT)
    home = tmp / "home-reference"
    home.mkdir()
    student_args = [f"--Exchange.root={exchange}", f"--CourseDirectory.course_id={c.course_id}"]
    nbgrader("fetch_assignment", ASSIGNMENT, *student_args, cwd=home)
    by_student(VIA_EXCHANGE).write(home / ASSIGNMENT)
    nbgrader("submit", ASSIGNMENT, *student_args, f"--student={VIA_EXCHANGE}", cwd=home)
    nbgrader("collect", ASSIGNMENT)

    # 2. zip_collect: an LMS download, files named <student>_<file>
    staged = tmp / "zip-staging"
    write_submission(by_student(VIA_ZIP), release, staged)
    archive = course / "downloaded" / ASSIGNMENT / "archive"
    archive.mkdir(parents=True)
    with zipfile.ZipFile(archive / "lms.zip", "w") as z:
        for f in [f"{ASSIGNMENT}.ipynb"] + [f"{s}.py" for s in stages(ASSIGNMENT)]:
            z.write(staged / f, f"{VIA_ZIP}_{f}")
    nbgrader("zip_collect", ASSIGNMENT)

    # 3. the rest copied into submitted/ (as an LMS export script would)
    for student in COPIED:
        dest = write_submission(by_student(student), release, course / "submitted" / student / ASSIGNMENT)
        (dest / "timestamp.txt").write_text("2026-01-15 12:00:00.000000 UTC")
    tamper(course / "submitted" / TAMPERED / ASSIGNMENT)

    t = time.monotonic()
    autograde = nbgrader("autograde", ASSIGNMENT)
    autograde_seconds = time.monotonic() - t
    said = autograde.stdout + autograde.stderr  # nbgrader's own lines, not a copy line per file nor the kernel's noise
    assert "without encryption" not in said and "Copying " not in said and "Autograding" in said, said[-3000:]
    nbgrader("generate_feedback", ASSIGNMENT)
    nbgrader("export", "--to", str(tmp / "grades.csv"))
    assert c.assignment == ASSIGNMENT and c.gradebook_url == f"sqlite:///{db}"
    first = stage_scores(c, STUDENTS)

    nbgrader("autograde", ASSIGNMENT, "--force", "--student", TAMPERED)
    nbgrader("autograde", ASSIGNMENT, "--force", "--student", VIA_ZIP)
    regraded = stage_scores(c, STUDENTS)

    print(f"\nnbgrader timings (s): { {k: [round(x, 1) for x in v] for k, v in nbgrader.timings.items()} }; "
          f"autograde of {len(STUDENTS)} submissions {autograde_seconds:.1f} s "
          f"({autograde_seconds / len(STUDENTS):.1f} s each, incl. one CLI start); "
          f"whole pipeline {time.monotonic() - start:.0f} s")
    return dict(course=c, root=course, release=release, db=db, grades_csv=tmp / "grades.csv",
                first=first, regraded=regraded, tmp=tmp, autograde_log=autograde.stdout + autograde.stderr)


# ---------------------------------------------------------------- what students get

def test_release_has_no_solution_code_hidden_test_or_hidden_fixture(graded):
    release = graded["release"]
    assert not (release / "fixtures" / "hidden").exists()
    names = hidden_test_names()
    lines = solution_lines()
    assert names and lines
    for path in release.rglob("*"):
        if path.is_dir() or path.suffix == ".npz":
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".ipynb":
            text = "\n".join(cell.source for cell in nbformat.reads(text, as_version=4).cells)
        found = {line.strip() for line in text.splitlines()} & lines
        assert not found, f"{path.name} contains solution lines: {sorted(found)[:5]}"
        leaked = [n for n in names if re.search(rf"\b{n}\b", text)]
        assert not leaked, f"{path.name} names hidden tests: {leaked}"
        # (only the suite's wiring names the hidden fixture's loader, which finds no hidden file in a release)
        assert "hidden_fx" not in text or path.name == "conftest.py" or path.parent.name == "suite_plugin"
        assert "Grading(" not in text and "grading.stage" not in text, f"{path.name} shows the grading call"
    public_npz = sorted(p.name for p in (release / "fixtures" / "public").glob("*.npz"))
    assert public_npz and all((FIXTURES / "public" / n).is_file() for n in public_npz)


def test_release_notebook_has_one_locked_autograder_cell_per_stage(graded):
    c = graded["course"]
    nb = nbformat.read(graded["release"] / f"{ASSIGNMENT}.ipynb", as_version=4)
    cells = {cell.metadata["nbgrader"]["grade_id"]: cell for cell in nb.cells if "nbgrader" in cell.metadata}
    for stage, points in c.points.items():
        meta = cells[f"grade_{stage}"].metadata["nbgrader"]
        assert meta["grade"] and meta["locked"] and meta["points"] == points
    assert sum(c.points.values()) == pytest.approx(100)
    assert nb.metadata["kernelspec"]["name"] == "python3"


def test_students_run_the_public_tests_on_their_own_modules(graded, tmp_path):
    folder = tmp_path / "student"
    shutil.copytree(graded["release"], folder)
    stub = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                          capture_output=True, text=True)
    assert stub.returncode == 1 and " failed" in stub.stdout and " passed" not in stub.stdout.splitlines()[-1]
    for path in module_files(SOLUTIONS):
        shutil.copy(path, folder / path.name)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=folder,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "Every stage passes." in done.stdout


# ---------------------------------------------------------------- grades

def test_reference_and_warning_submission_get_full_marks(graded):
    c = graded["course"]
    for student in (VIA_EXCHANGE, VIA_ZIP):
        assert graded["first"][student] == c.points, student


def test_warning_submission_cells_have_no_stderr(graded):
    nb = nbformat.read(graded["root"] / "autograded" / VIA_ZIP / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4)
    grade_cells = [cell for cell in nb.cells if cell.metadata.get("nbgrader", {}).get("grade")]
    assert len(grade_cells) == len(stages(ASSIGNMENT))
    for cell in grade_cells:
        kinds = [(o.output_type, o.get("name")) for o in cell.outputs]
        assert ("stream", "stderr") not in kinds and not any(k == "error" for k, _ in kinds), kinds
        assert [k for k, _ in kinds][-1] == "execute_result"


def test_untouched_stubs_get_nothing(graded):
    assert all(score == 0 for score in graded["first"]["untouched"].values())


def test_syntax_error_costs_only_its_stage(graded):
    c = graded["course"]
    scores = graded["first"]["syntax-error"]
    assert scores["s05_self_attention"] == 0
    assert {s: v for s, v in scores.items() if s != "s05_self_attention"} == \
        {s: v for s, v in c.points.items() if s != "s05_self_attention"}


def test_mistake_scores_are_exact_and_tampering_changes_nothing(graded, tmp_path):
    """tril-for-triu, graded through nbgrader with a patching cell and a fake grader/ package,
    scores exactly what the suite gives its modules when run directly."""
    c = graded["course"]
    modules = by_student(TAMPERED).write(tmp_path / "modules")
    direct = grade_folder(modules, Limits(), list(c.points))
    expected = {stage: stage_score([t for t in direct["tests"] if t["stage"] == stage], points)
                for stage, points in c.points.items()}
    assert expected["s06_causal_mask"] < c.points["s06_causal_mask"]
    assert {s: v for s, v in expected.items() if s != "s06_causal_mask"} == \
        {s: v for s, v in c.points.items() if s != "s06_causal_mask"}
    assert graded["first"][TAMPERED] == expected


def test_force_regrade_gives_the_same_grades(graded):
    assert graded["regraded"] == graded["first"]


def test_export_lists_every_student(graded):
    text = graded["grades_csv"].read_text()
    for student in STUDENTS:
        assert student in text


# ---------------------------------------------------------------- feedback

def hidden_test_code_lines() -> set[str]:
    """Distinctive lines of the hidden tests' bodies (those not also in a shipped file)."""
    import ast

    names = hidden_test_names()
    lines = set()
    for path in suite_files():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                body = text.splitlines()[node.body[0].lineno - 1:node.end_lineno]
                lines.update(s.strip() for s in body if len(s.strip()) >= 25)
    return lines


def test_feedback_shows_verdicts_but_no_hidden_test_code(graded):
    code = hidden_test_code_lines()
    release_text = "\n".join(p.read_text(errors="replace") for p in graded["release"].rglob("*.py"))
    code = {line for line in code if line not in release_text}
    assert code
    sol = solution_lines()
    for student in STUDENTS:
        path = graded["root"] / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html"
        text = html.unescape(re.sub(r"<[^>]+>", "", path.read_text()))
        assert "checks pass" in text
        stripped = {line.strip() for line in text.splitlines()}
        assert not stripped & code, f"{student}: hidden test code in feedback: {sorted(stripped & code)[:3]}"
        assert not stripped & sol, f"{student}: solution lines in feedback: {sorted(stripped & sol)[:3]}"
    feedback_files = list((graded["root"] / "feedback").rglob("*"))
    assert not [p for p in feedback_files if p.name == "attnkit-grading.json"], "the grading record must stay private"
    tril = html.unescape((graded["root"] / "feedback" / TAMPERED / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text())
    assert "FAIL" in tril and "PASS" in tril


def test_feedback_names_each_stage_and_shows_no_grading_code(graded):
    """The page's index and each autograder cell carry the stage's heading, not nbgrader's "Test cell"
    and the grade_id; the hidden region is out, markers included; the CUDA twins of checks are not
    shown as something the student should go and do."""
    from grader.kit import stage_info

    headings = [stage_info(s).heading for s in stages(ASSIGNMENT)]
    for student in STUDENTS:
        page = html.unescape((graded["root"] / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text())
        text = html.unescape(re.sub(r"<[^>]+>", "", page))
        toc = text[:text.index("Attention, stage by stage")]
        assert [h for h in headings if h in toc] == headings, toc
        assert "Test cell" not in text and "Grade cell" not in text and "grade_s" not in text
        assert "HIDDEN TESTS" not in text and "grading.stage" not in text and "Grading(" not in text
        assert "tampered: full marks please" not in text  # the edited locked cell was restored
        assert "run on a GPU" not in text and "(case 1, CUDA)" not in text
    reference = html.unescape(re.sub(r"<[^>]+>", "", (graded["root"] / "feedback" / VIA_EXCHANGE / ASSIGNMENT /
                                                      f"{ASSIGNMENT}.html").read_text()))
    assert "PASS  other sizes (case 1, CPU)" in reference
    assert "more checks need a CUDA GPU: not run here, so they count for no points" in reference


def test_autograde_warns_only_about_a_locked_cell_that_was_edited(graded):
    """nbgrader's "Attribute 'checksum' ... has changed!" (nbgrader issue #1961: every autograder cell
    with hidden tests, every submission) appears once: for the one locked cell a student edited."""
    changed = re.findall(r"Attribute '(\w+)' for cell (\S+) has changed", graded["autograde_log"])
    assert changed == [("checksum", EDITED_CELL)], changed


def test_grading_record_kept_for_the_instructor(graded):
    record = json.loads((graded["root"] / "autograded" / TAMPERED / ASSIGNMENT / "attnkit-grading.json").read_text())
    assert {t["marker"] for t in record["tests"]} == {marker(s) for s in stages(ASSIGNMENT)}
