"""``attnkit grade``: a class graded by warm workers gets nbgrader's cells' verdicts, lands in the nbgrader
gradebook and the JSON records, survives kill -9, gives the same grades on a Dask cluster and on a
loaded machine, keeps every submission within its time budget and leaves nothing in TMPDIR.

The command runs as a real subprocess (``attnkit grade``), on an nbgrader course built and generated
here, and on a plain folder of submissions, each run with a TMPDIR of its own.
"""
from __future__ import annotations

import csv
import html as html_module
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers import free_port

from grader import submission as S
from grader.course.build import build
from grader.course.samples import by_student, write_modules
from grader.grading import records as R
from grader.grading.run import grade
from grader.grading.targets import folder_target
from grader.grading.worker import grade_folder
from grader.kit import KIT, SOLUTIONS, assignments, stage_info, stages
from grader.sandbox.limits import Limits
from grader.untrusted import ID_RULE, printable
from load import cpu_hogs
from runs import ATTNKIT, Nbgrader, attnkit

pytestmark = [pytest.mark.timeout(600)]

ASSIGNMENT = "attention"
PROMISED = "namespaces" if os.geteuid() == 0 else "userns"  # the confinement the README promises here
STUDENTS = ("reference", "softmax-dim0", "tril-for-triu", "endless-loop")


def records(out: Path) -> dict[str, dict]:
    return R.read_records(out)


def outcomes(record: dict) -> dict[str, str]:
    return {t["nodeid"]: t["outcome"] for s in record["stages"] for t in s["tests"]}


# ---------------------------------------------------------------- the record format (fast)

def test_mistakes_and_limits_come_with_the_verdicts_never_from_words():
    # A record's mistakes are the verdict's (the suite's findings, passed on by the grading plugin): words in a
    # message that look like a finding are the learner's text, never read as one.
    check = {"nodeid": "tests/test_s03_context_vectors.py::test_m", "stage": "s03_context_vectors",
             "marker": "context_vectors", "label": "m", "outcome": "failed", "limit": None}
    tests = [{**check, "message": "differ\nLikely mistake: forged by the learner", "mistakes": ["softmax over dim 0"]},
             {**check, "nodeid": check["nodeid"] + "2", "message": "Likely mistake: forged", "mistakes": []}]
    record = R.build(student="ada", assignment="a1", submission=SOLUTIONS, fingerprint="0" * 64, tests=tests,
                     points={"s03_context_vectors": 1.0}, seconds=0.5)
    assert [t["mistakes"] for t in record["stages"][0]["tests"]] == [["softmax over dim 0"], []]
    # The limit is the verdict's (the sandbox set it where it stopped the check), never read from words: a message
    # that speaks of a time limit is no limit hit, and a skipped check has none.
    check = {"nodeid": "tests/test_s03_context_vectors.py::test_a", "stage": "s03_context_vectors",
             "marker": "context_vectors", "label": "a"}
    words = "the time limit of 20 s ... memory limit of 4 GiB"
    tests = [{**check, "outcome": "failed", "message": words, "limit": None},
             {**check, "nodeid": check["nodeid"] + "b", "outcome": "failed", "message": "x", "limit": "crash"},
             {**check, "nodeid": check["nodeid"] + "c", "outcome": "skipped", "message": "x", "limit": "output"}]
    record = R.build(student="ada", assignment="a1", submission=SOLUTIONS, fingerprint="0" * 64, tests=tests,
                     points={"s03_context_vectors": 1.0}, seconds=0.5)
    assert [t["limit"] for t in record["stages"][0]["tests"]] == [None, "crash", None]
    assert R.limits_hit(record) == ["context_vectors"]


def test_a_folder_or_link_named_like_a_module_neither_crashes_nor_counts(tmp_path):
    """What is graded of a submission (and what its fingerprint and seed stand for) is its regular
    module files: a folder named like a module is no module, and a link is graded as a module that
    fails, saying so, without being read. One odd submission must not stop the grading of a class."""
    clean, odd = tmp_path / "clean", tmp_path / "odd"
    for folder in (clean, odd):
        by_student("reference").write(folder)
    (odd / "s05_self_attention.py").unlink()
    (odd / "s05_self_attention.py").mkdir()  # a folder named like a module
    (odd / "s06_causal_mask.py").unlink()
    (odd / "s06_causal_mask.py").symlink_to("/dev/zero")  # a link that would never stop reading
    (clean / "s05_self_attention.py").unlink()
    graded = S.sources(odd)
    assert "s05_self_attention.py" not in graded
    assert b"submitted as a symbolic link" in graded["s06_causal_mask.py"]
    assert {k: v for k, v in graded.items() if k != "s06_causal_mask.py"} == \
        {k: v for k, v in S.sources(clean).items() if k != "s06_causal_mask.py"}


def test_text_a_student_controls_reaches_the_terminal_inert():
    """Control and format characters (ESC sequences, a bell, U+202E, undecodable bytes) are shown as escapes."""
    assert printable("Zoë Ng, alice@uni.edu: 'x' (y)") == "Zoë Ng, alice@uni.edu: 'x' (y)"
    assert printable("a\x1b[2Jb\x07\u202ec\udcff\td\n") == "a\\x1b[2Jb\\x07\\u202ec\\udcff\\td\\n"
    assert printable("one\ntwo\r", newlines=True) == "one\ntwo\\r"


def test_student_ids_that_cannot_be_safe_file_names_are_refused():
    """A student id names a file (<student>.json), a gradebook row and, raw, parts of nbgrader's formgrader pages:
    it must be a safe file name of letters, digits and . _ - @ + (spaces inside), and not the run's own file."""
    for good in ("ada", "Zoë Ng", "alice@uni.edu", "bob.smith+cs101", "_x", "42", "Ωμέγα-3"):
        assert R.student_problem(good) is None, good
    for bad, why in {"grades": "the run's own grades.json", "GRADES": "grades.json", "": "empty",
                     "=HYPERLINK(\"http://evil.example\",\"x\")": "holds", "-rf": "starts with '-'",
                     "+1": "starts with", "@x": "starts with", ".hidden": "starts with", "a/b": "'/'",
                     "<img src=x onerror=alert(1)>": "'<'", "evil\x1b]0;owned\x07": "control",
                     "a\u202eb": "invisible", "\udcff": "UTF-8", "x" * 129: "too long", "é" * 101: "too long",
                     "trailing ": "ends with a space", "two  spaces": "two in a row", "o'brien": "\"'\""}.items():
        problem = R.student_problem(bad)
        assert problem is not None and why in problem, (bad, problem)
    with pytest.raises(ValueError):  # nor can a record be written over the run's own files
        R.record_path(Path("/out"), "grades")


def test_csv_cells_a_spreadsheet_would_run_are_text(tmp_path):
    """OWASP's rule for CSV injection: a cell that starts with = + - @, a tab or a carriage return is written with
    a leading apostrophe, so that a spreadsheet shows it instead of running it (here: a record of an id an older
    kit accepted, or a record written elsewhere); grades.json keeps the ids as they are."""
    ids = ["=HYPERLINK(\"http://evil.example\",\"x\")", "+1+2", "-2+3", "@SUM(A1:A9)", "\tcmd", "\rcmd", "a=b", "ada"]
    tests = [{"nodeid": "tests/test_s01_attention_scores.py::test_a", "stage": "s01_attention_scores",
              "marker": "attention_scores", "label": "a", "outcome": "passed", "message": "", "limit": None}]
    records = [R.build(student=student, assignment="a1", submission=SOLUTIONS, fingerprint="0" * 64, tests=tests,
                       points={"s01_attention_scores": 4.0}, seconds=0.5) for student in ids]
    csv_path, json_path = R.write_summary(tmp_path, "a1", records)
    with csv_path.open(newline="") as handle:
        cells = [row["student"] for row in csv.DictReader(handle)]
    assert sorted(cells) == sorted(f"'{s}" if s[0] in "=+-@\t\r" else s for s in ids)
    assert sorted(row["student"] for row in json.loads(json_path.read_text())["students"]) == sorted(ids)


def test_records_are_written_whole_and_summarised(tmp_path):
    tests = [
        {"nodeid": "tests/test_s01_attention_scores.py::test_a", "stage": "s01_attention_scores",
         "marker": "attention_scores", "label": "a", "outcome": "passed", "message": "", "limit": None},
        {"nodeid": "tests/test_s01_attention_scores.py::test_b", "stage": "s01_attention_scores",
         "marker": "attention_scores", "label": "b", "outcome": "failed", "message": "x\nLikely mistake: y",
         "limit": None, "mistakes": ["y"]},
        {"nodeid": "tests/test_s01_attention_scores.py::test_c[cuda]", "stage": "s01_attention_scores",
         "marker": "attention_scores", "label": "c / cuda", "outcome": "skipped", "message": "no CUDA",
         "limit": None},
    ]
    fingerprint = S.fingerprint(S.sources(SOLUTIONS))
    record = R.build(student="ada", assignment="a1", submission=SOLUTIONS, fingerprint=fingerprint, tests=tests,
                     points={"s01_attention_scores": 4.0}, seconds=0.5)
    assert (record["fingerprint"], record["seed"]) == (fingerprint, S.seed_of(fingerprint))
    (stage,) = record["stages"]
    assert (stage["points"], stage["passed"], stage["counted"]) == (2.0, 1, 2)
    assert stage["tests"][1]["mistakes"] == ["y"] and stage["tests"][2]["limit"] is None
    R.write_record(tmp_path, record)
    assert R.read_records(tmp_path) == {"ada": record}
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind
    csv_path, json_path = R.write_summary(tmp_path, "a1", [record])
    assert list(csv.DictReader(csv_path.open()))[0]["attention_scores"] == "2.0"
    assert json.loads(json_path.read_text())["students"][0]["total"] == 2.0


# ---------------------------------------------------------------- an nbgrader course

@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("grade") / "course"
    build(root)
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    # The class: the kit's samples, loaded as an instructor loads them for a trial run.
    attnkit("samples", ASSIGNMENT, "--course", str(root), *(f"--student={student}" for student in STUDENTS))
    for student in STUDENTS:
        (root / "submitted" / student / ASSIGNMENT / "timestamp.txt").write_text("2026-01-15 10:00:00.000000 UTC")
    tmpdir = tmp_path_factory.mktemp("tmpdir")  # to see what the run leaves there
    start = time.monotonic()
    with cpu_hogs():  # a loaded machine: the grades below are those of an idle one
        stdout, stderr = attnkit("grade", "--course", str(root), "--quiet", tmpdir=tmpdir, stderr=True)
    return root, stdout, time.monotonic() - start, tmpdir, stderr


@pytest.mark.slow
def test_attnkit_samples_loads_the_samples_as_submissions_and_never_over_a_submission(course, tmp_path):
    root = course[0]
    for student in STUDENTS:
        folder = root / "submitted" / student / ASSIGNMENT
        expected = by_student(student).write(tmp_path / student)
        for module in expected.glob("*.py"):
            assert (folder / module.name).read_text() == module.read_text(), (student, module.name)
        assert (folder / f"{ASSIGNMENT}.ipynb").is_file() and (folder / "timestamp.txt").is_file()
    before = snapshot(root / "submitted")
    refused = subprocess.run([*ATTNKIT, "samples", ASSIGNMENT, "--course", str(root)], capture_output=True, text=True)
    assert refused.returncode == 2 and f"already holds {ASSIGNMENT} of {STUDENTS[0]}" in refused.stderr, refused.stderr
    assert "--force" in refused.stderr and snapshot(root / "submitted") == before, "a refused load wrote something"


@pytest.mark.slow
def test_a_submission_of_a_zip_or_a_folder_is_told_what_to_upload(tmp_path):
    """Modules inside an archive or a folder are not graded (0 points), and every check says what to submit
    instead, in the student's terms: not the sandbox's paths, not the kit's exercises/."""
    import zipfile

    submissions = tmp_path / "submissions"
    unzipped = write_modules(tmp_path / "modules", assignment=ASSIGNMENT)
    (submissions / "zipped").mkdir(parents=True)
    with zipfile.ZipFile(submissions / "zipped" / "attention.zip", "w") as archive:
        for module in unzipped.glob("*.py"):
            archive.write(module, module.name)
    shutil.copytree(unzipped, submissions / "nested" / "my-work")
    out = tmp_path / "grades"
    attnkit("grade", ASSIGNMENT, "--submissions", str(submissions), "--out", str(out), "--quiet")
    found = records(out)
    told = {"zipped": "holds the archive 'attention.zip': submit the stage modules themselves",
            "nested": "in the folder my-work/: submit the stage modules themselves, not a folder"}
    for student, words in told.items():
        assert found[student]["total"] == 0, student
        messages = [t["message"] for s in found[student]["stages"] for t in s["tests"] if t["outcome"] == "failed"]
        assert messages and all(words in m for m in messages), (student, messages[:2])
        assert not any("/sandbox" in m or "exercises/" in m for m in messages), messages[:2]


@pytest.mark.slow
def test_a_submission_without_its_notebook_gets_its_grade_and_says_how_to_get_a_notebook(tmp_path):
    """--notebooks: nbgrader makes the autograded notebook from the submitted one. Without it, running again
    changes nothing: the message says what does, and doing it works."""
    root = tmp_path / "course"
    build(root, assignments=[ASSIGNMENT])
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    attnkit("samples", ASSIGNMENT, "--course", str(root), "--student=reference")
    (root / "submitted" / "reference" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").unlink()
    first = subprocess.run([*ATTNKIT, "grade", ASSIGNMENT, "--course", str(root), "--quiet", "--notebooks"],
                           capture_output=True, text=True)
    assert first.returncode == 1, first.stdout + first.stderr
    assert f"no notebook for reference: their submission has no {ASSIGNMENT}.ipynb" in first.stdout, first.stdout
    assert "run again to retry" not in first.stdout and records(R.results_dir(root, ASSIGNMENT))["reference"]
    copy = re.search(r"copy (\S+) into (\S+)/ or have them submit it", first.stdout)
    assert copy, first.stdout
    shutil.copy(shlex.split(copy.group(1))[0], shlex.split(copy.group(2))[0])
    assert "autograded notebooks: 1 written, 0 failed" in attnkit("grade", ASSIGNMENT, "--course", str(root),
                                                                   "--quiet", "--notebooks")


def test_attnkit_samples_needs_a_generated_assignment_and_says_so(tmp_path):
    root = tmp_path / "course"
    build(root, assignments=[ASSIGNMENT])
    refused = subprocess.run([*ATTNKIT, "samples", "--course", str(root)], capture_output=True, text=True)
    assert refused.returncode == 2, refused.stdout
    assert f"run `nbgrader generate_assignment {ASSIGNMENT}` in {shlex.quote(str(root))} first" in refused.stderr
    assert not (root / "submitted").exists()


@pytest.mark.slow
def test_every_student_is_graded_and_the_bad_one_costs_only_its_limit(course):
    root, stdout, seconds, tmpdir, _ = course
    assert f"graded {len(STUDENTS)}, already graded 0, errors 0" in stdout
    found = records(root / "attnkit-grades" / ASSIGNMENT)
    assert sorted(found) == sorted(STUDENTS)
    for student, record in found.items():
        breaks = set(by_student(student).breaks)
        lost = {s["marker"] for s in record["stages"] if s["points"] < s["max_points"]}
        assert lost == breaks, f"{student}: lost points on {lost}, expected {breaks}"
    loop = {s["marker"]: s for s in found["endless-loop"]["stages"]}["context_vectors"]
    assert {t["limit"] for t in loop["tests"]} == {"time"}
    assert R.limits_hit(found["endless-loop"]) == ["context_vectors"]
    # The endless loop held up its own worker for its time limit (10 s of CPU time); the others went on, each
    # graded in less time than the loop's (a ratio: a loaded machine stretches both alike).
    others = max(found[s]["seconds"] for s in STUDENTS if s != "endless-loop")
    assert others < found["endless-loop"]["seconds"], f"a correct submission took {others:.1f} s, the loop less"
    for record in found.values():
        assert record["confinement"] == {"mode": PROMISED, "missing": [] if PROMISED == "namespaces" else ["uid"]}
    assert list(tmpdir.iterdir()) == [], "the run left files in TMPDIR"


@pytest.mark.slow
def test_the_instructor_s_terminal_shows_no_library_warnings(course):
    """Grading students new to the gradebook (--quiet) prints nothing on stderr that would make an
    instructor suspect a problem: no warnings of SQLAlchemy, nbgrader or torch."""
    stderr = course[4]
    assert "Warning" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_verdicts_are_those_of_nbgrader_s_cells(course):
    """Same checks, same seed, same verdicts as nbgrader's autograder cells give the same submission."""
    root = course[0]
    found = records(root / "attnkit-grades" / ASSIGNMENT)
    compared = ("reference", "softmax-dim0")
    with ThreadPoolExecutor(max_workers=2) as pool:
        cells = dict(zip(compared, pool.map(
            lambda s: grade_folder(root / "submitted" / s / ASSIGNMENT, Limits(), stages(ASSIGNMENT)), compared)))
    for student in compared:
        assert outcomes(found[student]) == {t["nodeid"]: t["outcome"] for t in cells[student]["tests"]}, student
        assert (found[student]["fingerprint"], found[student]["seed"]) == \
            (cells[student]["fingerprint"], cells[student]["seed"])


@pytest.mark.slow
def assert_gradebook_holds(root: Path, found: dict[str, dict]):
    """Every stage's score in the gradebook is the record's, for every student."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student, record in found.items():
            for stage in record["stages"]:
                grade = gb.find_grade(f"grade_{stage['stage']}", "attention", ASSIGNMENT, student)
                assert grade.score == pytest.approx(stage["points"]), (student, stage["stage"])
                assert grade.max_score == pytest.approx(stage["max_points"])
            assert gb.find_submission(ASSIGNMENT, student).timestamp.year == 2026


def test_the_gradebook_and_nbgrader_export_show_the_records(course, tmp_path):
    root = course[0]
    found = records(root / "attnkit-grades" / ASSIGNMENT)
    assert_gradebook_holds(root, found)
    export = tmp_path / "grades.csv"
    Nbgrader(root)("export", "--to", str(export))
    rows = {r["student_id"]: r for r in csv.DictReader(export.open()) if r["assignment"] == ASSIGNMENT}
    assert sorted(rows) == sorted(found)
    for student, record in found.items():
        assert float(rows[student]["score"]) == pytest.approx(record["total"], abs=0.02), student
    summary = {r["student"]: r for r in csv.DictReader((root / "attnkit-grades" / ASSIGNMENT / "grades.csv").open())}
    assert {s: float(r["total"]) for s, r in summary.items()} == {s: r["total"] for s, r in found.items()}


@pytest.mark.slow
def test_student_and_force_regrade_only_whom_they_name(course):
    root = course[0]
    out = root / "attnkit-grades" / ASSIGNMENT
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "grades.json"}
    assert "graded 0, already graded 1, errors 0" in attnkit("grade", "--course", str(root), "--quiet",
                                                             "--student", "reference")
    stdout = attnkit("grade", "--course", str(root), "--quiet", "--student", "reference",
                     "--student", "softmax-dim0", "--force")
    assert "graded 2, already graded 0, errors 0" in stdout
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name != "grades.json"}
    changed = {name for name in before if after[name] != before[name]}
    assert changed == {"reference.json", "softmax-dim0.json"}


@pytest.mark.slow
def test_notebooks_give_nbgrader_feedback_with_the_same_grades(course):
    root = course[0]
    # nbgrader's copy follows links: what a link points at must not reach autograded/ (nor the feedback).
    (root / "submitted" / "reference" / ASSIGNMENT / "notes.txt").symlink_to(SOLUTIONS / "s08_causal_attention.py")
    stdout = attnkit("grade", "--course", str(root), "--quiet", "--notebooks")
    assert f"autograded notebooks: {len(STUDENTS)} written, 0 failed" in stdout
    assert (root / "autograded" / "reference" / ASSIGNMENT / "notes.txt").read_text() == S.LINK_NOTE
    found = records(root / "attnkit-grades" / ASSIGNMENT)
    # nbgrader's own autograde read the scores back from the notebooks' outputs: the records' scores.
    assert_gradebook_holds(root, found)
    Nbgrader(root)("generate_feedback", ASSIGNMENT)
    for student, record in found.items():
        html = (root / "feedback" / student / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()
        for stage in record["stages"]:
            said = f"{stage_info(stage['stage']).heading}: {stage['passed']} of {stage['counted']} checks pass"
            assert said in html_module.unescape(html), student
    assert "Likely mistake" in (root / "feedback" / "tril-for-triu" / ASSIGNMENT / f"{ASSIGNMENT}.html").read_text()
    # Up to date now: nothing to write again.
    assert "autograded notebooks: 0 written, 0 failed" in attnkit("grade", "--course", str(root), "--quiet",
                                                                  "--notebooks")


def test_an_assignment_not_generated_is_refused(tmp_path):
    root = tmp_path / "course"
    build(root)
    (root / "submitted" / "ada" / ASSIGNMENT).mkdir(parents=True)
    run = subprocess.run([*ATTNKIT, "grade", "--course", str(root), "--quiet"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 2
    # The command that fixes it acts on this course, from wherever attnkit was run.
    assert f"run `cd {shlex.quote(str(root))} && nbgrader generate_assignment {ASSIGNMENT}` first" in run.stderr, \
        run.stderr


# ---------------------------------------------------------------- a folder of submissions

CLASS = 8


@pytest.fixture(scope="module")
def submissions(tmp_path_factory):
    """Eight submissions with distinct fingerprints: the reference with a comment, one softmax bug."""
    root = tmp_path_factory.mktemp("class") / "submissions"
    for number in range(CLASS):
        folder = root / f"student{number:02d}"
        folder.mkdir(parents=True)
        for stage in stages("attention"):
            text = (SOLUTIONS / f"{stage}.py").read_text()
            if stage == "s01_attention_scores":
                text += f"\n# submission {number}\n"
            if stage == "s02_normalization" and number == 3:
                text = text.replace("torch.softmax(all_pairs_scores(inputs), dim=-1)",
                                    "torch.softmax(all_pairs_scores(inputs), dim=0)")
            (folder / f"{stage}.py").write_text(text)
    return root


def descendants(pid: int) -> set[int]:
    found = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                for child in map(int, handle.read().split()):
                    found |= {child} | descendants(child)
    except OSError:
        pass
    return found


@pytest.fixture(scope="module")
def local_grades(submissions, tmp_path_factory):
    """Graded by a run killed with SIGKILL after its first records, then by a second run."""
    out = tmp_path_factory.mktemp("local") / "grades"
    env = dict(os.environ, TMPDIR=str(tmp_path_factory.mktemp("tmpdir")))
    cmd = [*ATTNKIT, "grade", "--submissions", str(submissions), "--out", str(out), "--quiet", "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)
    deadline = time.monotonic() + 240
    while len(list(out.glob("student*.json"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    first = {p.stem: p.stat().st_mtime_ns for p in out.glob("student*.json")}
    # The killed run's grading processes (and their sandboxes) die with it.
    for _ in range(100):
        if not any(os.path.exists(f"/proc/{pid}") and not _zombie(pid) for pid in workers):
            break
        time.sleep(0.1)
    leftover = {pid for pid in workers if os.path.exists(f"/proc/{pid}") and not _zombie(pid)}
    # (each folder's kind: its name less its random end and, for a worker's, the pid of the run that started it)
    left_in_tmpdir = sorted(re.sub(r"(-\d+)?-[^-]+$", "", p.name) for p in Path(env["TMPDIR"]).iterdir())
    run = subprocess.run(cmd[:-2], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, first, run.stdout, leftover, left_in_tmpdir, sorted(Path(env["TMPDIR"]).iterdir())


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
def test_a_killed_run_resumes_without_loss_or_duplication(local_grades):
    out, first, stdout, leftover, _, _ = local_grades
    assert 2 <= len(first) < CLASS, f"the run was not cut midway ({len(first)} records)"
    assert not leftover, f"processes of the killed run survive: {leftover}"
    assert f"graded {CLASS - len(first)}, already graded {len(first)}, errors 0" in stdout
    found = records(out)
    assert sorted(found) == [f"student{n:02d}" for n in range(CLASS)]
    for student, mtime in first.items():
        assert (out / f"{student}.json").stat().st_mtime_ns == mtime, f"{student} was graded twice"
    rows = list(csv.DictReader((out / "grades.csv").open()))
    assert sorted(r["student"] for r in rows) == sorted(found)
    assert {s for s, r in found.items() if r["total"] < r["max_total"]} == {"student03"}
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_the_next_run_removes_what_a_killed_run_left_in_tmpdir(local_grades):
    """kill -9 leaves the dead workers' folders (their copy of a submission, their sandbox's); the next
    run removes them, and its own."""
    *_, left_after_kill, left_after_rerun = local_grades
    assert {"attnkit-worker", "attnkit-sandbox"} <= set(left_after_kill)
    assert left_after_rerun == []


@pytest.mark.slow
def test_a_slow_submission_gets_a_record_within_its_budget(tmp_path):
    """Correct but slow: every check within its limit, the whole far over the budget. The run records
    what was graded, fails the rest saying the budget ran out, and a rerun does not try again. The
    tight limits cost the correct submission nothing: they count the learner's CPU time only."""
    submissions = tmp_path / "submissions"
    for student in ("reference", "slow"):
        by_student("reference").write(submissions / student)
    s01 = submissions / "slow" / "s01_attention_scores.py"
    s01.write_text(s01.read_text() + SLOW)
    out, tmpdir = tmp_path / "grades", tmp_path / "tmpdir"
    tmpdir.mkdir()
    args = ["grade", "--submissions", str(submissions), "--out", str(out), "--workers", "1",
            "--test-timeout", "0.5", "--time-budget", "2"]
    env = dict(os.environ, TMPDIR=str(tmpdir))
    run = subprocess.run([*ATTNKIT, *args], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"sandbox: {PROMISED}" in run.stderr  # announced before grading
    found = records(out)
    assert found["reference"]["total"] == found["reference"]["max_total"]
    slow = {s["stage"]: s for s in found["slow"]["stages"]}
    first = [t for t in slow["s01_attention_scores"]["tests"] if t["outcome"] != "skipped"]
    assert first[0]["outcome"] == "passed"  # graded until the budget ran out...
    assert first[-1]["limit"] == "budget" and "time budget of this submission ran out" in first[-1]["message"]
    for stage in list(slow)[1:]:  # ...and nothing after it was run
        assert {t["limit"] for t in slow[stage]["tests"] if t["outcome"] != "skipped"} == {"budget"}, stage
    assert found["slow"]["seconds"] < 2 * 5 + 10  # the budget's wall clock (5 x 2 s), and some slack
    assert list(tmpdir.iterdir()) == []
    again = subprocess.run([*ATTNKIT, *args], capture_output=True, text=True, env=env)
    assert "graded 0, already graded 2" in again.stdout


SLOW = """

def _slowly(function):
    def slow(*args, **kwargs):
        import time
        end = time.process_time() + 0.3  # well within the 0.5 s per check...
        while time.process_time() < end:
            pass
        return function(*args, **kwargs)
    return slow


attention_scores_loop = _slowly(attention_scores_loop)  # ...but 2 s run out after a few checks
attention_scores_matmul = _slowly(attention_scores_matmul)
"""


@pytest.mark.slow
def test_dask_gives_the_local_pools_grades(submissions, local_grades, tmp_path, capsys):
    import dask
    import distributed

    out = tmp_path / "dask"
    # (Dask's scratch space in the test's own folder: by default it stays in TMPDIR after the run)
    with dask.config.set({"temporary-directory": str(tmp_path / "dask-scratch")}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=None) as cluster:
        outcome = grade(folder_target(submissions, out), executor="dask",
                        scheduler=cluster.scheduler_address, quiet=False)
    assert not outcome.errors and len(outcome.graded) == CLASS
    # Said before grading, as on this machine: how the Dask workers keep submissions apart.
    assert f"sandbox: {PROMISED}" in capsys.readouterr().err and outcome.confinement.endswith("(on 2 Dask workers)")
    local, remote = records(local_grades[0]), records(out)
    assert sorted(local) == sorted(remote)
    for student in local:
        assert outcomes(remote[student]) == outcomes(local[student]), student
        assert [(s["stage"], s["points"]) for s in remote[student]["stages"]] == \
            [(s["stage"], s["points"]) for s in local[student]["stages"]]
        assert (remote[student]["fingerprint"], remote[student]["seed"]) == \
            (local[student]["fingerprint"], local[student]["seed"])


# ---------------------------------------------------------------- bad input on the instructor's path (fast)

def attnkit_refuses(*args, cwd=None) -> str:
    """``attnkit ARGS`` must stop with a plain error (exit 2, no traceback); returns what it said."""
    run = subprocess.run([*ATTNKIT, *args], cwd=cwd, capture_output=True, text=True)
    assert run.returncode == 2, f"attnkit {' '.join(args)} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    return run.stderr


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and mtime, to prove a refused run touched nothing."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def graded_before(out: Path):
    """What an earlier run left in ``out``: a record and the summaries (their content does not matter here)."""
    out.mkdir(parents=True)
    for name in ("ada.json", "grades.csv", "grades.json"):
        (out / name).write_text(f"graded before: {name}\n")


@pytest.fixture(scope="module")
def spaced_course(tmp_path_factory):
    """A course in a folder whose name has a space, built by the command line; returns (root, its output)."""
    root = tmp_path_factory.mktemp("cli") / "my course"
    return root, attnkit("course", "build", str(root))


def test_hints_quote_paths_so_they_can_be_pasted(spaced_course):
    root, stdout = spaced_course
    (hint,) = [line for line in stdout.splitlines() if line.startswith("next: ")]
    generate = [word for name in assignments() for word in ("&&", "nbgrader", "generate_assignment", name)]
    assert shlex.split(hint.removeprefix("next: ")) == ["cd", str(root), *generate]
    missing = root / "not a course"
    said = attnkit_refuses("grade", "--course", str(missing))
    assert f"`attnkit course build {shlex.quote(str(missing))}`" in said


def test_an_empty_submissions_folder_is_refused_and_touches_nothing(tmp_path):
    empty, out = tmp_path / "sub missions", tmp_path / "grades"
    empty.mkdir()
    (empty / "notes.txt").write_text("a file is no submission folder")
    graded_before(out)
    before = snapshot(out)
    said = attnkit_refuses("grade", "--submissions", str(empty), "--out", str(out), "--quiet")
    assert f"no submissions to grade: {shlex.quote(str(empty))} holds no submission folder" in said
    assert "Nothing was graded or changed" in said
    assert snapshot(out) == before


def test_a_course_without_submissions_is_refused_and_touches_nothing(tmp_path):
    root = tmp_path / "course"
    build(root)
    (root / "gradebook.db").write_bytes(b"an earlier run's gradebook")
    graded_before(root / "attnkit-grades" / ASSIGNMENT)
    before = snapshot(root)
    submitted = shlex.quote(str(root / "submitted"))
    for layout in ("no submitted/ folder", "a student with another assignment only"):
        if layout != "no submitted/ folder":
            (root / "submitted" / "ada" / "homework0").mkdir(parents=True)
        said = attnkit_refuses("grade", "--course", str(root), "--quiet")
        assert f"no submissions to grade: nothing in {submitted}/<student>/{ASSIGNMENT}/" in said, layout
        assert f"`nbgrader collect {ASSIGNMENT}`" in said and "Nothing was graded or changed" in said, layout
        assert {k: v for k, v in snapshot(root).items() if not k.startswith("submitted")} == before, layout
    # That gradebook is no database: said as such, by both commands that read it, still touching nothing.
    by_student("reference").write(root / "submitted" / "ada" / ASSIGNMENT)
    for args in (("grade", "--course", str(root), "--quiet", "--workers", "1"), ("report", "--course", str(root))):
        said = attnkit_refuses(*args)
        assert "the course's gradebook cannot be read (file is not a database)" in said, args[0]
        assert f"`nbgrader generate_assignment {ASSIGNMENT}` in the course folder" in said, args[0]
        assert {k: v for k, v in snapshot(root).items() if not k.startswith("submitted")} == before, args[0]


def test_an_assignment_the_course_lacks_is_named_with_those_it_has(spaced_course):
    root = spaced_course[0]
    for command in ("report", "grade"):
        said = attnkit_refuses(command, "WRONG", "--course", str(root))
        assert f"the course in {shlex.quote(str(root))} has no assignment 'WRONG'; its assignments: " \
               f"{', '.join(assignments())} (e.g. `attnkit {command} {ASSIGNMENT}`)" in said, command


def test_other_bad_input_gets_an_error_that_says_what_to_do(spaced_course, tmp_path):
    root = spaced_course[0]
    folders = tmp_path / "submissions"
    (folders / "ada").mkdir(parents=True)
    not_a_course = tmp_path / "elsewhere"
    not_a_course.mkdir()
    assert "is not an attnkit course" in attnkit_refuses("grade", cwd=not_a_course)  # run outside any course
    assert "is not an attnkit course" in attnkit_refuses("report", "--course", str(not_a_course))
    assert "is not an attnkit course" in attnkit_refuses("grade", "--submissions", str(folders), "--out",
                                                         str(tmp_path / "grades"), "--course", str(not_a_course))
    (not_a_course / "attnkit-course.json").write_text("{ cut short")
    assert "is not readable JSON" in attnkit_refuses("grade", "--course", str(not_a_course))
    assert "is a file: give a folder" in attnkit_refuses("grade", "--submissions", str(folders), "--out",
                                                         str(root / "attnkit-course.json"))
    assert "put the grades somewhere else" in attnkit_refuses("grade", "--submissions", str(folders), "--out",
                                                              str(folders / "grades"))
    assert "expected a number above 0" in attnkit_refuses("grade", "--course", str(root), "--test-timeout", "0")
    assert "must be at least the time limit of one check" in attnkit_refuses(
        "grade", "--submissions", str(folders), "--out", str(tmp_path / "grades"),
        "--test-timeout", "5", "--time-budget", "2")
    assert "no gradebook in" in attnkit_refuses("report", "--course", str(root))  # never generated
    assert not (tmp_path / "grades").exists() and not (folders / "grades").exists()


# ---------------------------------------------------------------- what a student controls, and quiet choices

@pytest.mark.slow
def test_hostile_student_ids_are_refused_and_the_others_graded(tmp_path):
    """Folders whose names cannot be safe student ids (a collision with grades.json, a formula, markup, control
    characters, an option, bytes that are not UTF-8) are refused one by one, saying why and what to do; the
    others are graded, what was graded before stays, and the terminal shows every name inert."""
    submissions, out = tmp_path / "submissions", tmp_path / "grades"
    for student in ("ada", "Zoë Ng"):  # one stage module each: quick to grade
        (submissions / student).mkdir(parents=True)
        shutil.copy(SOLUTIONS / "s01_attention_scores.py", submissions / student)
    args = ["grade", "attention", "--submissions", str(submissions), "--out", str(out), "--workers", "1"]
    attnkit(*args)
    before = snapshot(out)
    hostile = {"grades": "its record grades.json would be the run's own grades.json",
               '=HYPERLINK("evil.example","x")': "the name holds", "<img src=x onerror=alert(1)>": "the name holds",
               "evil\x1b]0;owned\x07": "control or invisible character", "-rf": "starts with '-'"}
    for student in hostile:
        by_student("reference").write(submissions / student)
    os.mkdir(os.fsencode(submissions) + b"/latin1-\xe9")  # not UTF-8
    by_student("reference").write(Path(os.fsdecode(os.fsencode(submissions) + b"/latin1-\xe9")))
    run = subprocess.run([*ATTNKIT, *args], capture_output=True, text=True, errors="surrogateescape")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "graded 0, already graded 2, errors 0, refused 6" in run.stdout
    refused = [line for line in run.stdout.splitlines() if line.startswith("  refused: ")]
    assert len(refused) == 6 and all(f"{ID_RULE}: rename the folder and run again" in line for line in refused)
    for student, why in hostile.items():
        assert any(printable(student) in line and why in line for line in refused), student
    assert any("latin1-\\udce9" in line and "not valid UTF-8" in line for line in refused)
    assert not any(c in run.stdout + run.stderr for c in "\x1b\x07\udce9")
    assert "grading attention" not in run.stderr  # nothing to grade: no progress bar
    assert {k: v for k, v in snapshot(out).items() if k not in ("grades.csv", "grades.json")} == \
        {k: v for k, v in before.items() if k not in ("grades.csv", "grades.json")}
    assert sorted(r["student"] for r in json.loads((out / "grades.json").read_text())["students"]) == ["Zoë Ng", "ada"]


def test_dask_not_installed_is_one_plain_line(tmp_path):
    """distributed is an extra ([dask]): without it, --executor dask says how to install it (exit 2)."""
    submissions, out = tmp_path / "submissions", tmp_path / "grades"
    by_student("reference").write(submissions / "ada")
    without = "import sys; sys.modules['distributed'] = None; from grader.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", without, "grade", "attention", "--submissions", str(submissions),
                          "--out", str(out), "--quiet", "--executor", "dask", "--scheduler", "tcp://127.0.0.1:1"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "pip install distributed (or, in the kit's folder, pip install -e '.[dask]')" in run.stderr, run.stderr
    assert not out.exists()


def test_install_hints_name_what_pip_can_install():
    """The kit is no package on PyPI: a hint `pip install 'attention-kit[...]'` fails with "No matching
    distribution found". Hints name the packages themselves, or the extra installed from the kit's folder."""
    from grader.course.gradebook import DRIVER_FIX

    texts = [path.read_text() for path in (KIT / "grader").rglob("*") if path.suffix in (".py", ".md", ".j2")]
    assert not [t for t in texts if "attention-kit[" in t]
    assert "pip install 'psycopg[binary]'" in DRIVER_FIX["psycopg"]


def test_an_unreachable_dask_scheduler_is_one_plain_line(tmp_path):
    """Nothing listens at the address: said at once, in one line (exit 2), before anything is written."""
    submissions, out = tmp_path / "submissions", tmp_path / "grades"
    by_student("reference").write(submissions / "ada")
    address = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    said = attnkit_refuses("grade", "attention", "--submissions", str(submissions), "--out", str(out), "--quiet",
                           "--executor", "dask", "--scheduler", address)
    assert time.monotonic() - start < 15  # distributed alone retried for 30 s, then printed 58 lines
    assert said.strip() == (f"attnkit grade: error: no Dask scheduler answers at {address} (Connection refused): "
                            "start one (`dask scheduler` prints its address) or give --scheduler the address of a "
                            "running one; nothing was graded or changed")
    assert not out.exists()


def test_with_no_assignment_named_the_one_submitted_is_graded_and_said(tmp_path):
    """A course with two assignments: the one its submitted/ folders hold is graded, saying so; both held: the
    command asks which. The same for a folder of submissions (by their modules) and for the report (by the grades
    there)."""
    root = tmp_path / "course"
    build(root)
    by_student("reference", "modern-attention").write(root / "submitted" / "ada" / "modern-attention")
    said = attnkit_refuses("grade", "--course", str(root), "--quiet")  # not generated yet: stops before grading
    assert ("grading modern-attention, the only assignment with submissions in "
            f"{shlex.quote(str(root / 'submitted'))} (of {', '.join(assignments())})") in said
    assert "nbgrader generate_assignment modern-attention" in said
    by_student("reference").write(root / "submitted" / "bob" / "attention")
    said = attnkit_refuses("grade", "--course", str(root), "--quiet")
    assert "of 2 assignments: attention (1), modern-attention (1); name the one to grade, e.g. " \
           "`attnkit grade attention`" in said
    folders = tmp_path / "folders"
    by_student("reference", "modern-attention").write(folders / "ada")
    said = attnkit_refuses("grade", "--submissions", str(folders), "--out", str(tmp_path / "grades"),
                           "--test-timeout", "5", "--time-budget", "2")  # refused after the choice, before grading
    assert "grading modern-attention, the only assignment with stage modules in" in said
    (root / R.GRADES_DIR / "modern-attention").mkdir(parents=True)
    R.write_record(root / R.GRADES_DIR / "modern-attention", R.build(
        student="ada", assignment="modern-attention", submission=folders / "ada", fingerprint="0" * 64, tests=[],
        points={"m01_pytorch_attention": 10.0}, seconds=1.0))
    said = attnkit_refuses("report", "--course", str(root))
    assert "reporting on modern-attention, the only assignment with grades in" in said


def test_the_progress_bar_lasts_from_the_workers_start_to_their_stop(tmp_path, monkeypatch):
    """The bar's time and rate include starting and stopping the grading workers, and the gradebook's writes
    (they once left out 38 s of a 69 s run)."""
    from grader.grading import run as G

    events = []

    class Workers:  # the workers of LocalResults, without grading: every job comes back with an error
        def __init__(self, jobs, limits, count, **confinement):
            self.jobs = jobs
            events.append("workers start")

        def __iter__(self):
            for job in self.jobs:
                events.append("result")
                yield job, {"error": "not graded here", "tests": [], "output_capped": [], "confinement": None,
                            "seconds": 0.0}

        def close(self):
            events.append("workers stop")

        def confinement(self):
            return None  # (no worker starts here)

    class Gradebook:
        def state(self):
            return None  # (a gradebook whose state cannot be known: always opened)

        def __getattr__(self, name):  # check, open, write, close
            return lambda *args, **kwargs: events.append(f"gradebook {name}")

    real = G.progress_bar

    def bar(quiet, **kwargs):
        shown = real(True, **kwargs)
        events.append("bar opens")
        shown.close = lambda close=shown.close: (events.append("bar closes"), close())
        return shown

    monkeypatch.setattr(G, "LocalResults", Workers)
    monkeypatch.setattr(G, "progress_bar", bar)
    by_student("reference").write(tmp_path / "submissions" / "ada")
    target = folder_target(tmp_path / "submissions", tmp_path / "grades", "attention")
    target.gradebook = Gradebook()
    outcome = grade(target, quiet=True)
    assert outcome.errors == {"ada": "not graded here"}
    assert events[events.index("bar opens"):] == ["bar opens", "gradebook check", "gradebook open", "result",
                                                   "workers stop", "bar closes", "gradebook close"]


def test_with_nothing_left_to_grade_no_worker_starts_and_an_unchanged_gradebook_is_not_opened(tmp_path, monkeypatch):
    """A course where every submission is graded answers at once: what is left is decided first, so no grading
    worker (nor sandbox) starts, and a gradebook nothing wrote since a run brought it in line with these records
    is not even opened (importing nbgrader's API alone took 5 of the 9-11 s such a run took). Anything that writes
    the gradebook since makes the run bring it in line again, still without a worker."""
    from grader.course.gradebook import GradebookSync
    from grader.grading import run as G

    events = []

    class Workers:  # LocalResults without grading: every job comes back graded, with no checks
        def __init__(self, jobs, limits, count, **confinement):
            self.jobs = jobs
            events.append("workers start")

        def __iter__(self):
            for job in self.jobs:
                yield job, {"error": None, "tests": [], "confinement": None, "seconds": 0.0}

        def close(self):
            events.append("workers stop")

        def confinement(self):
            return None

    class Gradebook:
        written = [1]  # what a real gradebook's state() gives: changes with every write

        def state(self):
            return list(self.written)

        def write(self, records, timestamps, progress=None):
            events.append("gradebook write")
            self.written[0] += 1

        def __getattr__(self, name):  # check, open, close
            return lambda *args, **kwargs: events.append(f"gradebook {name}")

    monkeypatch.setattr(G, "LocalResults", Workers)
    monkeypatch.setattr(G, "probe", lambda **kwargs: events.append("probe"))
    by_student("reference").write(tmp_path / "submissions" / "ada")
    by_student("untouched").write(tmp_path / "submissions" / "bob")

    def run():
        events.clear()
        target = folder_target(tmp_path / "submissions", tmp_path / "grades", "attention")
        target.gradebook = Gradebook()
        return grade(target, quiet=True)

    assert sorted(run().graded) == ["ada", "bob"] and "workers start" in events and "gradebook write" in events
    again = run()
    assert sorted(again.skipped) == ["ada", "bob"] and not again.graded and events == [], events
    assert sorted(again.records) == ["ada", "bob"]
    Gradebook.written[0] += 1  # e.g. nbgrader autograde wrote it since
    assert sorted(run().skipped) == ["ada", "bob"]
    assert "workers start" not in events and "probe" not in events and "gradebook write" in events, events
    assert run().skipped and events == []
    # A course's SQLite gradebook says when it was written; a server's cannot, so it is always opened.
    db = tmp_path / "gradebook.db"
    db.write_bytes(b"x")
    book = GradebookSync(f"sqlite:///{db}", "attention", "attention", {})
    before = book.state()
    db.write_bytes(b"xy")
    assert before is not None and book.state() != before
    assert GradebookSync("postgresql+psycopg://u@h/db", "attention", "attention", {}).state() is None


def test_gradescope_without_an_assignment_takes_the_course_s_only_one_or_asks(tmp_path, monkeypatch, capsys):
    """As grade and report do: the only assignment of the course in the current folder, said as a note (not an
    error); anywhere else a choice of several is asked for (exit 2), never chapter 3's zip built unasked."""
    from grader import cli
    from grader.outputs import gradescope

    built = []
    monkeypatch.setattr(gradescope, "build_zip", lambda out, name, *args: built.append(name) or Path(cli.__file__))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["gradescope"]) == 2 and not built
    assert (f"attnkit gradescope: error: name the assignment to build Gradescope's autograder of, one of "
            f"{', '.join(assignments())}: e.g. `attnkit gradescope attention --out autograder.zip`"
            in capsys.readouterr().err)
    build(tmp_path / "course", assignments=["modern-attention"])
    monkeypatch.chdir(tmp_path / "course")
    assert cli.main(["gradescope"]) == 0 and built == ["modern-attention"]
    err = capsys.readouterr().err
    assert err.startswith("building the autograder of modern-attention, the only assignment of the course in ") \
        and "error" not in err, err


def test_the_progress_bar_draws_on_a_terminal_only(monkeypatch):
    """Redirected to a log, stderr gets no progress-bar frames (each would be a line there); on a terminal the bar
    shows, unless --quiet."""
    import io

    from grader.grading.run import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_bar(False, total=1).disable
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert not progress_bar(False, total=1).disable and progress_bar(True, total=1).disable
