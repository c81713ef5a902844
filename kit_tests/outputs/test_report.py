"""``attnkit report``: the class report's numbers match the gradebook and the result files, and its
plots are real images.

The class is synthetic: a course from ``attnkit course build``, a gradebook filled through nbgrader's
own Gradebook API (one autograded grade cell per stage, as ``attnkit grade`` writes it), and one
``attnkit-grades/<assignment>/<student>.json`` per student in the grading schema. The report's
figures are checked against nbgrader's own reading of that gradebook: its Gradebook API and the
scores ``nbgrader export`` writes.
"""
from __future__ import annotations

import csv
import json
import os
import random
import statistics
import sys
import warnings
from collections import Counter

import pytest

from grader.course.gradebook import class_report
from grader.course.settings import Course
from grader.grading import records as results
from grader.grading.scoring import label, stage_report
from grader.kit import marker, stages
from grader.outputs.report import build_report, first_line, load_results, summarize
from runs import Nbgrader

# grader.course.build (nbformat) and nbgrader are imported inside the fixtures: importing them here would
# slow down every `pytest -m public` run in the kit by seconds, at collection.

ASSIGNMENT = "attention"
MISTAKES = {  # stage -> mistakes a failed test may name
    "s02_normalization": ["softmax over dim 0: each column sums to 1 instead of each row",
                          "Subtract each row's max before exp"],
    "s04_trainable_projections": ["the scores were not scaled by 1/sqrt(d_k)", "scores divided by d_k"],
    "s06_causal_mask": ["the mask hides the past instead of the future"],
    "s10_multihead_attention": ["heads split with view alone, no transpose", "out_proj was not applied",
                                "scaled by sqrt(d_out) instead of sqrt(head_dim)"],
}
LIMITS = ("time", "memory", "crash", "exit", "output")
STUB_MESSAGE = "NotImplementedError: {stage}: f: see its TODO\nNot written yet: write the code its TODO describes"
STUBBORN = {"student07": "*", "student21": "s10_multihead_attention"}  # who left which stages as stubs


def synthetic_record(student: str, points: dict, rng: random.Random) -> dict:
    """One student's result in the grading schema: 4 tests per stage, some failing with mistakes or limits;
    the stages STUBBORN names fail every test on a stub."""
    stages = []
    for stage, max_points in points.items():
        tests = []
        for i in range(4):
            if STUBBORN.get(student) in ("*", stage):
                tests.append({"nodeid": f"tests/test_{stage}.py::test_{i}", "label": f"case {i}", "outcome": "failed",
                              "message": STUB_MESSAGE.format(stage=stage),
                              "mistakes": [],
                              "limit": None})
                continue
            failed = rng.random() < 0.3
            mistakes = rng.sample(MISTAKES[stage], k=1) if failed and stage in MISTAKES and rng.random() < 0.8 else []
            limit = rng.choice(LIMITS) if failed and not mistakes and rng.random() < 0.25 else None
            message = "".join(f"values differ\nLikely mistake: {m}" for m in mistakes) or ("limit hit" if limit else "")
            tests.append({"nodeid": f"tests/test_{stage}.py::test_{i}", "label": f"case {i}",
                          "outcome": "failed" if failed else "passed", "message": message,
                          "mistakes": mistakes, "limit": limit})
        passed = sum(t["outcome"] == "passed" for t in tests)
        stages.append({"stage": stage, "marker": marker(stage), "points": round(max_points * passed / 4, 2),
                       "max_points": max_points, "passed": passed, "counted": 4, "tests": tests})
    total = round(sum(s["points"] for s in stages), 2)
    return {"schema": 1, "student": student, "assignment": ASSIGNMENT,
            "submission": f"submitted/{student}/{ASSIGNMENT}",
            "fingerprint": f"{rng.getrandbits(64):016x}", "seed": rng.getrandbits(31),
            "graded_at": "2026-11-22T09:00:00+00:00", "seconds": round(rng.uniform(0.5, 3), 2),
            "total": total, "max_total": sum(points.values()), "stages": stages}


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    """A course with 40 graded students: gradebook + JSON files. One gradebook grade differs from its JSON."""
    from grader.course.build import build

    root = tmp_path_factory.mktemp("report") / "course"
    c = build(root)
    rng = random.Random(5)
    records = [synthetic_record(f"student{i:02d}", c.points, rng) for i in range(40)]
    folder = root / "attnkit-grades" / ASSIGNMENT
    folder.mkdir(parents=True)
    for r in records:
        (folder / f"{r['student']}.json").write_text(json.dumps(r, indent=1))
    (folder / "grades.json").write_text(json.dumps({"students": [r["student"] for r in records]}))  # not a student
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        # nbgrader runs `alembic` when it creates a gradebook: find it next to this Python
        mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        warnings.simplefilter("ignore")  # SQLAlchemy's autoflush warnings from nbgrader's add_submission
        fill_gradebook(root, c, records)
    return root, c, records


def fill_gradebook(root, c, records):
    """What `attnkit grade` writes into the gradebook: per student a submission, one grade cell per stage."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", c.course_id) as gb:
        gb.add_assignment(ASSIGNMENT)
        gb.add_notebook(c.notebook, ASSIGNMENT)
        for stage, points in c.points.items():
            gb.add_grade_cell(f"grade_{stage}", c.notebook, ASSIGNMENT, max_score=points, cell_type="code")
        for r in records:
            gb.add_student(r["student"])
            gb.add_submission(ASSIGNMENT, r["student"])
            for s in r["stages"]:
                gb.find_grade(f"grade_{s['stage']}", c.notebook, ASSIGNMENT, r["student"]).auto_score = s["points"]
        # an instructor's manual override: the gradebook wins over the JSON
        gb.find_grade("grade_s05_self_attention", c.notebook, ASSIGNMENT, "student03").manual_score = 1.5
        gb.db.commit()


def test_numbers_match_the_gradebook_and_the_results(graded_class):
    from grader.cli import main

    root, c, records = graded_class
    assert main(["report", ASSIGNMENT, "--course", str(root)]) == 0
    index, report = class_report(Course.load(root))
    assert index == root / "attnkit-grades" / ASSIGNMENT / "report" / "index.html"
    assert sorted(report.students) == [r["student"] for r in records]

    # per-stage means: from the gradebook (with the manual override), computed independently here
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", c.course_id) as gb:
        for stage, points in c.points.items():
            scores = [gb.find_grade(f"grade_{stage}", c.notebook, ASSIGNMENT, r["student"]).score for r in records]
            assert report.stages[stage].max_points == points
            assert report.stages[stage].mean == pytest.approx(statistics.fmean(scores))
    assert report.stages["s05_self_attention"].points["student03"] == 1.5
    assert any("student03" in m and "s05_self_attention" in m for m in report.mismatches)
    assert len(report.mismatches) == 1

    # mistakes: students and tests per mistake; a stub is not one, its students are counted apart
    for stage in c.points:
        tests = [(r["student"], t) for r in records for s in r["stages"] if s["stage"] == stage for t in s["tests"]]
        mine = [(who, t) for who, t in tests if "NotImplementedError" not in t["message"]]
        expected = Counter(m for _, t in mine for m in t["mistakes"])
        assert dict(report.stages[stage].mistakes) == dict(expected)
        assert not any("stub" in text for text in expected)
        for text in expected:
            who = {student for student, t in mine if text in t["mistakes"]}
            assert report.stages[stage].mistake_students[text] == who
        assert report.stages[stage].students_with_mistakes == {student for student, t in mine if t["mistakes"]}
        assert report.stages[stage].stubs == {who for who, t in tests if "NotImplementedError" in t["message"]}
    assert report.stages["s10_multihead_attention"].stubs == {"student07", "student21"}
    assert report.stages["s01_attention_scores"].stubs == {"student07"}

    # limits: one hit per (student, stage, kind), named by its first check, with the checks it failed
    hits = {}
    for r in records:
        for s in r["stages"]:
            for t in s["tests"]:
                if t["limit"]:
                    hits.setdefault((r["student"], s["stage"], t["limit"]), []).append(t["label"])
    expected = sorted((*key, labels[0], len(labels)) for key, labels in hits.items())
    assert expected and any(len(labels) > 1 for labels in hits.values()), "the class should hit limits, some twice"
    assert sorted((x.student, x.stage, x.kind, x.test, x.checks) for x in report.limits) == expected

    # the page shows the same numbers; students, not failed tests, in the counts
    page = index.read_text()
    for stage, s in report.stages.items():
        assert f"<td>{stage}</td><td class=num>{s.max_points:g}</td><td class=num>{s.mean:.2f}</td>" in page
        assert (f"<td class=num>{s.full_marks}</td><td class=num>{s.zero}</td>"
                f"<td class=num>{len(s.students_with_mistakes)}</td><td class=num>{len(s.stubs)}</td>"
                f"<td class=num>{len(s.could_not_run)}</td></tr>") in page
    assert "<td>s10_multihead_attention</td><td class=num>2</td><td>student07, student21</td>" in page
    for student, stage, kind, name, checks in expected:
        assert f"<td>{student}</td><td>{stage}</td><td>{kind}</td><td>{name}</td><td class=num>{checks}</td>" in page
    assert "The gradebook and the result files disagree" in page


def test_totals_match_nbgrader_export(graded_class):
    """nbgrader's own export of the gradebook gives every student the total the report shows."""
    from grader.cli import main

    root, c, records = graded_class
    csv_path = root / "export.csv"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    Nbgrader(root)("export", "--to", str(csv_path), env=env)
    with open(csv_path, newline="") as handle:
        exported = {row["student_id"]: row for row in csv.DictReader(handle)}
    assert main(["report", ASSIGNMENT, "--course", str(root)]) == 0
    index, report = class_report(Course.load(root))
    assert sorted(exported) == sorted(report.students)
    for student, info in report.students.items():
        assert info["total"] == pytest.approx(float(exported[student]["raw_score"]), abs=0.01), student
        assert sum(s.max_points for s in report.stages.values()) == pytest.approx(float(exported[student]["max_score"]))
    # the override of student03's s05 (1.5 points) is in both
    assert report.students["student03"]["total"] != next(r["total"] for r in records if r["student"] == "student03")


def test_plots_are_real_images(graded_class):
    from PIL import Image

    root, c, records = graded_class
    index, report = class_report(Course.load(root))
    page = index.read_text()
    for name in ("scores", "mistakes", "limits"):
        path = index.parent / f"{name}.png"
        assert path.is_file() and f"src='{name}.png'" in page
        with Image.open(path) as img:
            img.verify()  # raises on a truncated or corrupt file
        with Image.open(path) as img:
            assert img.format == "PNG"
            assert 400 <= img.width <= 4000 and 200 <= img.height <= 6000, img.size
            # not blank: plenty of distinct colours
            assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 20


def test_results_folder_alone_and_cli(graded_class, tmp_path, capsys):
    from grader.cli import main

    root, c, records = graded_class
    folder = root / "attnkit-grades" / ASSIGNMENT
    out = tmp_path / "elsewhere"
    assert main(["report", "--results", str(folder), "--out", str(out)]) == 0
    assert "40 students" in capsys.readouterr().out
    assert (out / "index.html").is_file() and (out / "scores.png").is_file()
    # without the gradebook the JSON's points are used
    report = summarize(load_results(folder))
    assert report.stages["s05_self_attention"].points["student03"] == next(
        s["points"] for s in records[3]["stages"] if s["stage"] == "s05_self_attention")
    assert not report.mismatches


def test_clear_errors(tmp_path, capsys):
    from grader.cli import main

    assert main(["report", "--course", str(tmp_path)]) == 2
    assert "not an attnkit course" in capsys.readouterr().err
    assert main(["report", "--results", str(tmp_path)]) == 2
    assert "no student results" in capsys.readouterr().err


def test_an_assignment_the_gradebook_lacks_is_named_with_those_it_has(graded_class, capsys):
    """The course has every assignment, its gradebook only the one generated: `attnkit report` on another says
    which the gradebook has, and how to get the one asked for."""
    from grader.cli import main

    assert main(["report", "modern-attention", "--course", str(graded_class[0])]) == 2
    err = capsys.readouterr().err
    assert ("the gradebook has no assignment 'modern-attention'; its assignments: attention "
            "(e.g. `attnkit report attention`). To report on modern-attention: `nbgrader generate_assignment "
            "modern-attention` in the course folder, then grade it") in err, err


def test_a_class_without_mistakes_or_limits(tmp_path):
    """All correct: no mistakes or limits plots, the page says so."""
    rng = random.Random(1)
    points = {"s01_attention_scores": 5.0, "s02_normalization": 8.0}
    for i in range(3):
        r = synthetic_record(f"s{i}", points, rng)
        for s in r["stages"]:
            s["points"] = s["max_points"]
            for t in s["tests"]:
                t.update(outcome="passed", message="", mistakes=[], limit=None)
        (tmp_path / f"s{i}.json").write_text(json.dumps(r))
    index, report = build_report(tmp_path)
    assert sorted(p.name for p in index.parent.glob("*.png")) == ["scores.png"]
    page = index.read_text()
    assert "No failed test named a likely mistake" in page and "hit a time, memory" in page


def test_reads_what_grader_results_writes(tmp_path):
    """The record writer of `attnkit grade` (grader.grading.records) and this report agree on the format."""
    points = {"s02_normalization": 8.0, "s03_context_vectors": 5.0}
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "s02_normalization.py").write_text("# a submission\n")

    def test(stage, name, outcome, message="", limit=None):
        return {"nodeid": f"tests/test_{stage}.py::test_{name}", "stage": stage, "marker": marker(stage),
                "label": name, "outcome": outcome, "message": message, "limit": limit,
                "mistakes": said_mistakes(message)}

    tests = [
        test("s02_normalization", "rows", "failed",
             "values differ\nLikely mistake: softmax over dim 0 (each column sums to 1)"),
        test("s02_normalization", "book", "passed"),
        test("s03_context_vectors", "loop", "failed",
             "s03_context_vectors: time limit of 10 s exceeded — an infinite loop?", "time"),
        test("s03_context_vectors", "matrix", "passed"),
    ]
    record = results.build(student="alice", assignment=ASSIGNMENT, submission=folder, fingerprint="0" * 64,
                           tests=tests, points=points, seconds=1.0)
    out = tmp_path / "grades"
    results.write_record(out, record)
    results.write_summary(out, ASSIGNMENT, [record])
    index, report = build_report(out)
    assert report.stages["s02_normalization"].points == {"alice": 4.0}
    assert dict(report.stages["s02_normalization"].mistakes) == {"softmax over dim 0 (each column sums to 1)": 1}
    limits = [(x.student, x.stage, x.kind, x.test) for x in report.limits]
    assert limits == [("alice", "s03_context_vectors", "time", "loop")]


def test_check_names_and_cuda_checks_in_words():
    """What students read in feedback (and instructors in the report's tables): checks by name, the CUDA
    twins of the CPU checks left out when there is no GPU, with a word on why."""
    assert label("tests/test_s10_multihead_attention.py::test_other_sizes[cpu-case0]") == "other sizes (case 1, CPU)"
    assert label("tests/test_s01_attention_scores.py::test_journey_scores_every_token_against_the_query"
                 "[attention_scores_loop]") == "journey scores every token against the query (attention_scores_loop)"
    assert label("tests/test_s10_multihead_attention.py::test_head_counts_and_lengths[1-4]") == \
        "head counts and lengths (1, 4)"
    assert label("tests/test_s03_context_vectors.py::test_random_cases") == "random cases"

    def check(name, outcome, message=""):
        nodeid = f"tests/test_s10_multihead_attention.py::{name}"
        return {"nodeid": nodeid, "label": label(nodeid), "outcome": outcome, "message": message}

    skip = "CUDA case: no CUDA device on this machine (its CPU twin ran; run on a GPU to check this one)"
    text = stage_report("s10_multihead_attention", 16, [
        check("test_other_sizes[cpu-case0]", "passed"), check("test_other_sizes[cuda-case0]", "skipped", skip),
        check("test_random_cases[cpu]", "failed", "values differ"), check("test_random_cases[cuda]", "skipped", skip),
    ])
    assert text.splitlines()[0] == "Stage 10: Multi-head attention with weight splits: 1 of 2 checks pass -> 8 of 16 " \
                                   "points"
    assert "PASS  other sizes (case 1, CPU)" in text and "FAIL  random cases (CPU)" in text
    assert "CUDA)" not in text and "run on a GPU" not in text
    assert text.splitlines()[-1] == "  (2 more checks need a CUDA GPU: not run here, so they count for no points)"


def test_a_long_message_is_cut_in_feedback_but_keeps_the_mistakes_it_names():
    """Big arrays make long messages; the named mistakes come last, and feedback still shows them."""
    nodeid = "tests/test_m07_tiled_attention.py::test_random_cases[cpu]"
    message = ("out differs from the expected values\n" + "  expected: [" + "0.1234, " * 200 + "]\n"
               "Likely mistake: the running max is not carried from one tile of keys to the next\n"
               "a hint after the mistake")
    text = stage_report("m07_tiled_attention", 16, [
        {"nodeid": nodeid, "label": label(nodeid), "outcome": "failed", "message": message}])
    assert " [...]" in text and len(text) < len(message)
    assert text.splitlines()[-1].strip() == \
        "Likely mistake: the running max is not carried from one tile of keys to the next"
    shown = "Likely mistake: the max is off"  # within the cut: shown once
    text = stage_report("m07_tiled_attention", 16, [{"nodeid": nodeid, "label": label(nodeid), "outcome": "failed",
                                                 "message": f"{shown}\n{message}"}])
    assert text.count(shown) == 1 and text.count("running max is not carried") == 1


def said_mistakes(message: str) -> list[str]:
    """The mistakes a synthetic message names after "Likely mistake: ", as the suite's diagnosis would have given
    them to the grading plugin (a verdict's ``mistakes``: records never read them from the message's words)."""
    return [part.split("\n")[0] for part in message.split("Likely mistake: ")[1:]]


def record_of(student: str, tests: list[tuple], points=None) -> dict:
    """A record as ``attnkit grade`` writes it (grader.grading.records), from (stage, check, outcome, message[,
    limit]) tuples."""
    points = points or {"s02_normalization": 8.0, "s03_context_vectors": 5.0, "s05_self_attention": 10.0}
    verdicts = [{"nodeid": f"tests/test_{stage}.py::test_{name}", "stage": stage, "marker": marker(stage),
                 "label": name, "outcome": outcome, "message": message, "limit": limit,
                 "mistakes": said_mistakes(message)}
                for stage, name, outcome, message, limit in ((*t, None)[:5] for t in tests)]
    return results.build(student=student, assignment=ASSIGNMENT, submission=".", fingerprint="0" * 64,
                         tests=verdicts, points=points, seconds=1.0)


def test_a_limit_hit_is_counted_once_with_the_checks_it_failed(tmp_path, capsys):
    """An endless loop stops one check at the time limit, and the rest of its stage is not run: one hit, five
    checks. A submission's budget that runs out fails every check after it, across stages: one hit too."""
    from grader.cli import main

    loop = "s03_context_vectors: time limit of 10 s of CPU time for one check exceeded — an infinite loop?"
    skipped = "not run: an earlier check of this stage hit the time limit"
    budget = "s02_normalization: the time budget of this submission ran out (120 s of CPU time, ...)"
    out = tmp_path / "grades"
    for record in (
        record_of("loops", [("s03_context_vectors", "one", "failed", loop, "time")]
                  + [("s03_context_vectors", f"n{i}", "failed", skipped, "time") for i in range(4)]),
        record_of("slow", [("s02_normalization", "one", "passed", ""),
                           ("s02_normalization", "two", "failed", budget, "budget"),
                           ("s03_context_vectors", "one", "failed", budget.replace("s02_normalization", "s03"),
                            "budget")]),
    ):
        results.write_record(out, record)
    assert main(["report", "--results", str(out)]) == 0
    assert "2 students, 3 stages, 2 limit hits (7 checks failed by them)" in capsys.readouterr().out
    report = summarize(load_results(out))
    assert sorted((x.student, x.stage, x.kind, x.test, x.checks) for x in report.limits) == [
        ("loops", "s03_context_vectors", "time", "one", 5), ("slow", "s02_normalization", "budget", "two", 2)]
    page = (out / "report" / "index.html").read_text()
    assert "<td>loops</td><td>s03_context_vectors</td><td>time</td><td>one</td><td class=num>5</td>" in page


def test_a_module_that_could_not_run_is_in_the_report(tmp_path):
    """A syntax error names no mistake and hits no limit; the report says which students' modules never ran."""
    syntax = ("s05_self_attention.py has a syntax error on line 34: '(' was never closed\n"
              "    attn_scores = queries @ keys.transpose(-2, -1\nFix it (python -m py_compile FILE ...)")
    out = tmp_path / "grades"
    results.write_record(out, record_of("typo", [("s05_self_attention", "v1", "failed", syntax),
                                                 ("s05_self_attention", "v2", "failed", syntax),
                                                 ("s02_normalization", "rows", "passed", "")]))
    results.write_record(out, record_of("ok", [("s05_self_attention", "v1", "passed", "")]))
    index, report = build_report(out)
    assert report.stages["s05_self_attention"].could_not_run == {
        "typo": "s05_self_attention.py has a syntax error on line 34: '(' was never closed"}
    assert not report.stages["s05_self_attention"].mistakes and not report.limits
    page = index.read_text()
    assert ("<td>s05_self_attention</td><td>typo</td><td>s05_self_attention.py has a syntax error on line 34: "
            "&#39;(&#39; was never closed</td>") in page


HOSTILE = ["$\\kitbroken{$", "$x^2$ and \\frac{1}{0}", "<script>alert('mistake')</script>", "\x1b[2J\x1b]0;owned\x07",
           "=HYPERLINK(\"http://evil.example\",\"click\")", "a\u202eb"]


def test_student_text_is_inert_in_the_report(tmp_path, capsys):
    """Mistakes and ids a student controls: drawn as plain text (mathtext once aborted the whole report), escaped
    in the page, never a control character on the terminal."""
    from grader.cli import main

    out = tmp_path / "grades"
    out.mkdir()
    for number, text in enumerate(HOSTILE):
        record = record_of(f"student{number}", [
            ("s02_normalization", "rows", "failed", f"differ\nLikely mistake: {text}"),
            ("s03_context_vectors", "loop", "failed", f"{text}: time limit hit", "time")])
        record["student"] = f"<b>{number}</b>{text}"  # a record's id as another tool might have written it
        (out / f"student{number}.json").write_text(json.dumps(record))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Glyph")  # no glyph of a control character is looked for
        assert main(["report", "--results", str(out)]) == 0
    printed = capsys.readouterr()
    assert not any(c in printed.out + printed.err for c in "\x1b\x07\u202e")
    page = (out / "report" / "index.html").read_text()
    assert "<script>" not in page and "<b>" not in page and "\x1b" not in page
    assert "&lt;script&gt;alert(&#39;mistake&#39;)&lt;/script&gt;" in page and "$\\kitbroken{$" in page
    report = summarize(load_results(out))
    assert set(report.stages["s02_normalization"].mistakes) == {first_line(text) for text in HOSTILE}
    from PIL import Image

    for name in ("scores", "mistakes", "limits"):
        with Image.open(out / "report" / f"{name}.png") as img:
            img.verify()


def test_each_score_panel_says_what_its_axis_counts():
    """The stages' panels count % of the stage's points, the totals' panel % of the total points; each panel with
    nothing below it says so, whatever the number of stages."""
    import matplotlib.pyplot as plt

    from grader.outputs.report import scores_figure

    rng = random.Random(3)
    for count in (2, 5, 7, 11):
        points = {stage: 5.0 for stage in stages(ASSIGNMENT)[:count]}
        report = summarize([synthetic_record(f"s{i}", points, rng) for i in range(3)])
        fig = scores_figure(report)
        panels = [ax for ax in fig.axes if ax.axison]
        assert len(panels) == count + 1
        labelled = {ax.get_title().split("\n")[0]: ax.get_xlabel() for ax in panels if ax.get_xlabel()}
        assert labelled.pop("total") == "% of the total points", count
        assert labelled and set(labelled.values()) == {"% of the stage's points"}, count
        columns = {}  # every column's lowest panel is labelled
        for ax in panels:
            box = ax.get_subplotspec()
            columns[box.colspan.start] = max(columns.get(box.colspan.start, (-1, None)), (box.rowspan.start, ax),
                                             key=lambda pair: pair[0])
        assert all(ax.get_xlabel() for _, ax in columns.values()), count
        plt.close(fig)


def test_students_graded_unconfined_are_named_at_the_top(tmp_path):
    """Plain confinement (the instructor's explicit choice) is said where the instructor reads the grades."""
    rng = random.Random(2)
    points = {"s01_attention_scores": 5.0}
    for i, mode in enumerate(("namespaces", "plain")):
        record = synthetic_record(f"s{i}", points, rng)
        record["confinement"] = {"mode": mode, "missing": []}
        (tmp_path / f"s{i}.json").write_text(json.dumps(record))
    index, report = build_report(tmp_path)
    assert report.unconfined == ["s1"]
    assert "Graded UNCONFINED" in index.read_text() and "1 of 2 students" in index.read_text()
