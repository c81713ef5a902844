"""The tamper corpus (kit_tests/tamper.py) graded by nbgrader's own autograde, on a loaded machine: its entries
that aim beyond the sandbox (``Tamper.beyond_the_box``: the notebook and its kernel, the files beside it, the course
while nbgrader grades it, the processes around the kernel, the notebooks graded after it). The attacks on the
sandbox from inside a box meet the grading worker every path shares; kit_tests/grading/test_tamper_grade.py grades
the whole corpus through it, here and in a container.

One course per module. Two honest "bystanders" (the reference, and a submission with one real mistake) are
graded first, alone. Then every corpus entry joins as its own student, with late copies of the bystanders named
to be graded after every attacker (nbgrader grades students in the order of their names), and one ``nbgrader
autograde`` call grades them all on a loaded machine (two CPU-bound processes alongside, or the other pytest-
xdist worker: kit_tests/load.py). The tests check that the run completed, that each entry got exactly the grade
its honest work deserves and the reason in its feedback, that the late bystanders' autograder cells say byte for
byte what the early ones said, and that nothing outside each entry's own autograded folder changed: not the
bystanders' files, not their rows in the gradebook, not the kit.
"""
from __future__ import annotations

import difflib
import html
import json
import re
import time
from pathlib import Path

import nbformat
import pytest

from grader.course.build import build
from grader.course.samples import by_student, write_submission
from grader.kit import KIT, stages
from grader.submission import LINK_NOTE
from load import cpu_hogs
from runs import Nbgrader, expected_scores, file_hashes, gradebook_rows, hidden_quotes, scores
from tamper import BYSTANDERS, LATE, MARK, REDACTED, Context, corpus, write_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ASSIGNMENT = "attention"
TEST_TIMEOUT = 3.0  # CPU seconds per check: the learner's own time, so a loaded machine needs no more
CORPUS = [entry for entry in corpus() if entry.beyond_the_box or entry.in_every_output]


def feedback_text(root: Path, student: str) -> str:
    """The feedback page's text, its whitespace as single spaces (the stage reports wrap long lines)."""
    path = root / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html"
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", path.read_text())).split())


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    start = time.monotonic()
    root = tmp_path_factory.mktemp("tamper") / "course"
    c = build(root, test_timeout=TEST_TIMEOUT)
    db = root / "gradebook.db"
    nbgrader = Nbgrader(root)
    nbgrader("generate_assignment", ASSIGNMENT)
    release = root / "release" / ASSIGNMENT

    def submit(student, write):
        dest = write(root / "submitted" / student / ASSIGNMENT)
        (dest / "timestamp.txt").write_text("2026-01-15 12:00:00.000000 UTC")

    # 1. The bystanders, graded alone.
    for student in BYSTANDERS:
        submit(student, lambda dest, s=student: write_submission(by_student(s), release, dest))
    nbgrader("autograde", ASSIGNMENT)
    alone = scores(c, db, BYSTANDERS)

    # 2. The corpus joins; everything that exists now is recorded.
    ctx = Context(course=root, assignment=ASSIGNMENT, bystanders=BYSTANDERS)
    for entry in CORPUS:
        submit(entry.name, lambda dest, e=entry: write_entry(e, ctx, release, dest))
    for student in BYSTANDERS:
        submit(LATE + student, lambda dest, s=student: write_submission(by_student(s), release, dest))
    targets_before = {p: p.read_bytes() if p.is_file() else None for p in ctx.target_files()}
    files_before = file_hashes(root, skip=[Path("gradebook.db")])
    rows_before = gradebook_rows(db)

    # 3. One autograde call for everybody (the early bystanders are skipped: already graded).
    t = time.monotonic()
    with cpu_hogs():
        run = nbgrader("autograde", ASSIGNMENT)
    autograde_seconds = time.monotonic() - t
    nbgrader("generate_feedback", ASSIGNMENT)

    print(f"\ntamper corpus: autograde of {len(CORPUS)} entries {autograde_seconds:.0f} s; nbgrader "
          f"{ {k: round(sum(v)) for k, v in nbgrader.timings.items()} }; "
          f"whole fixture {time.monotonic() - start:.0f} s")
    return dict(course=c, root=root, db=db, ctx=ctx, alone=alone, log=run.stdout + run.stderr,
                scores=scores(c, db, BYSTANDERS + tuple(LATE + s for s in BYSTANDERS) + tuple(e.name for e in CORPUS)),
                targets_before=targets_before, files_before=files_before,
                rows_before=rows_before)


# ---------------------------------------------------------------- grades

@pytest.mark.parametrize("entry", CORPUS, ids=lambda e: e.name)
def test_entry_gets_its_honest_grade(graded, entry):
    got = graded["scores"][entry.name]
    want = expected_scores(graded["course"], entry)
    assert got == pytest.approx(want, abs=1e-6), f"{entry.name} ({entry.description})"


@pytest.mark.parametrize("entry", CORPUS, ids=lambda e: e.name)
def test_feedback_gives_the_reason(graded, entry):
    c = graded["course"]
    text = feedback_text(graded["root"], entry.name)
    for reason in entry.reasons:
        assert reason in text, f"{entry.name}: {reason!r} not in its feedback"
    for stage, points in c.points.items():
        score = expected_scores(c, entry)[stage]
        assert f"-> {score:g} of {points:g} points" in text, f"{entry.name}: stage {stage} line"
    assert "all checks pass" not in text and "SHADOW-RAN" not in text


@pytest.mark.parametrize("entry", [e for e in CORPUS if e.links], ids=lambda e: e.name)
def test_a_link_carries_nothing_into_the_feedback(graded, entry):
    """nbgrader's copy follows links; what a link pointed at (the solutions) must not reach the student."""
    for name, target in entry.links.items():
        given = graded["root"] / "feedback" / entry.name / ASSIGNMENT / name
        assert given.read_text() == LINK_NOTE, f"{entry.name}: {name} in the feedback is not the note"
        assert given.read_bytes() != Path(target).read_bytes()


def test_bystanders_keep_their_grades(graded):
    c = graded["course"]
    alone = graded["alone"]
    assert alone["reference"] == c.points
    mistake = alone["tril-for-triu"]
    assert mistake["s06_causal_mask"] < c.points["s06_causal_mask"]
    assert {s: v for s, v in mistake.items() if s != "s06_causal_mask"} == \
        {s: v for s, v in c.points.items() if s != "s06_causal_mask"}
    for student in BYSTANDERS:
        assert graded["scores"][student] == alone[student], student


def printed(nb) -> list[str]:
    """What each autograder cell of a notebook printed, as text to compare: its outputs with consecutive
    stream outputs of one stream merged. How a kernel splits its stdout into stream messages depends on
    timing (one "...points)\\n" or "...points)" then "\\n"); the text does not."""
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    nb, _ = CoalesceStreamsPreprocessor().preprocess(nbformat.from_dict(json.loads(json.dumps(nb))), {})
    return [json.dumps(cell.outputs, sort_keys=True) for cell in nb.cells
            if cell.metadata.get("nbgrader", {}).get("grade")]


def grade_cell_outputs(root: Path, student: str) -> list[str]:
    return printed(nbformat.read(root / "autograded" / student / ASSIGNMENT / f"{ASSIGNMENT}.ipynb", as_version=4))


def test_autograder_cells_that_print_the_same_text_in_other_chunks_compare_equal():
    def graded_cell(*chunks):
        cell = nbformat.v4.new_code_cell("grading.stage('x', points=5)",
                                         metadata={"nbgrader": {"grade": True, "grade_id": "grade_x"}})
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=c) for c in chunks] + [
            nbformat.v4.new_output("execute_result", data={"text/plain": "12.0"}, execution_count=1)]
        return nbformat.v4.new_notebook(cells=[cell])

    assert printed(graded_cell("Stage x: 3 of 3 checks pass -> 12 of 12 points)\n")) == \
        printed(graded_cell("Stage x: 3 of 3 checks pass -> 12 of 12 points)", "\n"))
    assert printed(graded_cell("12 of 12 points)\n")) != printed(graded_cell("11 of 12 points)\n"))


def test_late_bystanders_are_graded_byte_for_byte_as_alone(graded):
    """Graded after every attacker: their autograder cells print exactly what they printed alone (the same
    text; how the kernel's stdout was split into stream messages may differ)."""
    for student in BYSTANDERS:
        assert graded["scores"][LATE + student] == graded["alone"][student], student
        late, alone = grade_cell_outputs(graded["root"], LATE + student), grade_cell_outputs(graded["root"], student)
        for index, (a, b) in enumerate(zip(alone, late)):
            changes = "\n".join(difflib.unified_diff(a.split("\\n"), b.split("\\n"), lineterm="", n=1))
            assert a == b, f"{student}: grade cell {index} differs:\n{changes}"
        assert len(late) == len(alone)


# ---------------------------------------------------------------- nothing else changed

def test_no_file_outside_the_entries_own_autograded_folders_changed(graded):
    root = graded["root"]
    own = [Path("autograded") / e.name for e in CORPUS] + [Path("autograded") / (LATE + s) for s in BYSTANDERS] + [
        Path("feedback")]
    after = file_hashes(root, skip=[Path("gradebook.db")] + own)
    before = {k: v for k, v in graded["files_before"].items() if not any(Path(k).parts[:2] == o.parts for o in own)}
    changed = sorted(k for k in before if after.get(k) != before[k])
    added = sorted(k for k in after if k not in before and not k.endswith(".log"))
    assert not changed, f"files changed: {changed[:10]}"
    assert not added, f"files appeared outside the entries' autograded folders: {added[:10]}"
    for path, content in graded["targets_before"].items():
        if path.name != "gradebook.db":  # nbgrader writes it; test_no_gradebook_row_changed checks it
            assert (path.read_bytes() if path.is_file() else None) == content, path


def test_the_kit_is_untouched(graded):
    """The kit is shared with other work in progress: look for the attacks' traces only."""
    for folder in (KIT, KIT / "solutions", KIT / "fixtures", KIT / "fixtures" / "hidden", KIT / "tests"):
        assert not (folder / "pwned.txt").exists(), folder
    for path in list((KIT / "solutions").glob("*.py")) + list((KIT / "fixtures").rglob("*.npz")):
        assert b"pwned" not in path.read_bytes()[-64:], path


def test_no_gradebook_row_changed(graded):
    after = gradebook_rows(graded["db"])
    lost = graded["rows_before"] - after
    assert not lost, f"rows changed or removed: {sorted(lost, key=str)[:5]}"


def test_no_feedback_quotes_hidden_material(graded):
    """No feedback page shows a line of a reference's solution regions or of a hidden test that the student's own
    modules do not hold, however it was dressed (the leak-dressed entry's separators, invisible characters, case and
    width): where it was, the page says it was removed."""
    root = graded["root"]
    for folder in sorted((root / "feedback").iterdir()):
        submitted = root / "submitted" / folder.name / ASSIGNMENT
        own = "\n".join(p.read_text(errors="replace") for p in submitted.glob("s*.py") if p.is_file())
        page = (folder / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()
        assert not hidden_quotes(html.unescape(re.sub(r"<[^>]+>", "", page)), own), folder.name
    assert REDACTED in feedback_text(root, "leak-dressed")


def test_learner_code_never_ran_in_the_kernel(graded):
    root = graded["root"]
    for entry in CORPUS:
        folder = root / "autograded" / entry.name / ASSIGNMENT
        assert not (folder / "SHADOW-RAN").exists()
        assert not list(folder.rglob("SHADOW-RAN")), entry.name
        nb = nbformat.read(folder / f"{ASSIGNMENT}.ipynb", as_version=4)
        sources = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
        assert MARK not in sources, entry.name
        grade_cells = [cell for cell in nb.cells if cell.metadata.get("nbgrader", {}).get("grade")]
        assert len(grade_cells) == len(stages(ASSIGNMENT)), entry.name
        for cell in grade_cells:
            assert "grading.stage(" in cell.source, entry.name
            kinds = [o.output_type for o in cell.outputs]
            assert "error" not in kinds, (entry.name, cell.outputs)
