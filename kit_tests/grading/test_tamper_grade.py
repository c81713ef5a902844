"""The tamper and fault corpus (kit_tests/tamper.py) graded by ``attnkit grade``, on a loaded machine.

One nbgrader course. The honest bystanders (the reference, and a submission with one real mistake) are graded
first, alone. Then the corpus joins: attackers, and the victims and late copies of the bystanders that are named
to be graded after every attacker (students are graded in the order of their names). One ``attnkit grade`` run
with one worker grades them all, so that a single sandbox template serves everybody (what an attack on later
submissions needs), on a loaded machine (two CPU-bound processes alongside, or the other pytest-xdist worker:
kit_tests/load.py). The tests check that the run completed; that each entry got exactly the grade its honest
work deserves, with the reason in its feedback; that the late bystanders' records are byte-identical to the
early ones; that nothing outside the records changed, in the course, the gradebook or the kit; and that the run
left nothing behind: no process, nothing in TMPDIR.

The same again in a container as Docker makes one (root, Docker's default capabilities, no cgroups:
kit_tests/docker_default.sh), where the kit grades with its ``container`` confinement: every entry must get the
same grade there.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from verdicts import verdicts

from grader.course.build import build
from grader.course.samples import by_student, write_submission
from grader.grading import records as R
from grader.kit import KIT, marker, stages
from load import DEFAULT_HOGS, cpu_hogs
from runs import (
    Nbgrader,
    attnkit_grade,
    expected_scores,
    feedback,
    file_hashes,
    gradebook_rows,
    graded_content,
    hidden_quotes,
    kit_modes_kept,
)
from tamper import BYSTANDERS, LATE, REDACTED, Context, corpus, write_entry

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ASSIGNMENT = "attention"
TEST_TIMEOUT = 3.0  # CPU seconds per check: the learner's own time, so a loaded machine needs no more
CORPUS = corpus()


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return grade_the_corpus(tmp_path_factory, tmp_path_factory.mktemp("tmpdir"))


@pytest.fixture(scope="module")
def graded_in_a_container(tmp_path_factory, unavailable):
    if os.geteuid() != 0:
        unavailable("a container as Docker makes one needs root here (unshare, setpriv)")
    # The boxes are other users there: TMPDIR must let them through (pytest's own folders do not).
    tmpdir = Path(tempfile.mkdtemp(prefix="tamper-container-", dir="/tmp"))
    tmpdir.chmod(0o711)
    try:
        with kit_modes_kept():  # (the container confinement makes them private to root)
            yield grade_the_corpus(tmp_path_factory, tmpdir, container=True)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def grade_the_corpus(tmp_path_factory, tmpdir, container=False) -> dict:
    start = time.monotonic()
    root = tmp_path_factory.mktemp("tamper-grade") / "course"
    c = build(root, test_timeout=TEST_TIMEOUT)
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    release = root / "release" / ASSIGNMENT
    out = R.results_dir(root, ASSIGNMENT)

    # 1. The bystanders, graded alone.
    for student in BYSTANDERS:
        write_submission(by_student(student), release, root / "submitted" / student / ASSIGNMENT)
    attnkit_grade(root, tmpdir, container=container)
    alone = {s: R.read_record(R.record_path(out, s)) for s in BYSTANDERS}

    # 2. The corpus joins, with late copies of the bystanders; everything that exists now is recorded.
    ctx = Context(course=root, assignment=ASSIGNMENT, bystanders=BYSTANDERS)
    for entry in CORPUS:
        write_entry(entry, ctx, release, root / "submitted" / entry.name / ASSIGNMENT)
    for student in BYSTANDERS:
        write_submission(by_student(student), release, root / "submitted" / (LATE + student) / ASSIGNMENT)
    targets_before = {p: p.read_bytes() if p.is_file() else None for p in ctx.target_files()}
    files_before = file_hashes(root, skip=[R.results_dir(root, ASSIGNMENT).relative_to(root), Path("gradebook.db")])
    rows_before = gradebook_rows(root / "gradebook.db")

    # 3. One run for everybody (the early bystanders are skipped: already graded), on a loaded machine.
    t = time.monotonic()
    with cpu_hogs():
        run = attnkit_grade(root, tmpdir, container=container)
    seconds = time.monotonic() - t
    records = R.read_records(out)
    print(f"\ntamper corpus through attnkit grade{' in a container' if container else ''}: "
          f"{len(CORPUS) + len(BYSTANDERS)} submissions in {seconds:.0f} s ({DEFAULT_HOGS} CPU hogs alongside); "
          f"whole fixture {time.monotonic() - start:.0f} s")
    return dict(course=c, root=root, out=out, tmpdir=tmpdir, ctx=ctx, alone=alone, records=records, run=run,
                targets_before=targets_before, files_before=files_before, rows_before=rows_before)


# ---------------------------------------------------------------- grades

@pytest.mark.parametrize("entry", CORPUS, ids=lambda e: e.name)
def test_entry_gets_its_honest_grade(graded, entry):
    record = graded["records"][entry.name]
    got = {s["stage"]: s["points"] for s in record["stages"]}
    assert got == pytest.approx(expected_scores(graded["course"], entry), abs=1e-6), \
        f"{entry.name} ({entry.description})"


@pytest.mark.parametrize("entry", CORPUS, ids=lambda e: e.name)
def test_feedback_gives_the_reason(graded, entry):
    text = feedback(graded["records"][entry.name])
    for reason in entry.reasons:
        assert reason in text, f"{entry.name}: {reason!r} not in its feedback"
    assert "all checks pass" not in text and "SHADOW-RAN" not in text


def test_grades_are_the_ones_on_record(graded, snapshot):
    """Every check's verdict for every corpus entry and late bystander, as kept in __snapshots__/
    (see verdicts.py)."""
    names = [entry.name for entry in CORPUS] + [LATE + student for student in BYSTANDERS]
    assert {name: verdicts(graded["records"][name]) for name in sorted(names)} == snapshot


def test_late_bystanders_are_graded_byte_for_byte_as_alone(graded):
    """Graded after every attacker, by the same sandbox template: the same record, check by check,
    message by message, as when they were graded alone."""
    for student, alone in graded["alone"].items():
        late = graded["records"][LATE + student]
        assert late["fingerprint"] == alone["fingerprint"]
        assert graded_content(late) == graded_content(alone), student
    reference = graded["alone"]["reference"]
    assert reference["total"] == reference["max_total"]


def test_a_wrong_module_that_patches_the_libraries_scores_like_the_honest_mistake(graded):
    """patch-wrong is tril-for-triu plus torch/numpy patches: the same s06 verdicts as the bystander."""
    def s06(record):
        return [t for s in record["stages"] if s["stage"] == "s06_causal_mask" for t in s["tests"]]

    wrong, honest = s06(graded["records"]["patch-wrong"]), s06(graded["alone"]["tril-for-triu"])
    assert [(t["nodeid"], t["outcome"]) for t in wrong] == [(t["nodeid"], t["outcome"]) for t in honest]


def test_every_record_says_how_its_submission_was_confined(graded):
    expected = {"mode": "namespaces", "missing": []} if os.geteuid() == 0 else {"mode": "userns", "missing": ["uid"]}
    assert {json.dumps(r["confinement"], sort_keys=True) for r in graded["records"].values()} == \
        {json.dumps(expected, sort_keys=True)}


# ---------------------------------------------------------------- nothing else changed

def test_no_file_outside_the_records_changed(graded):
    root = graded["root"]
    after = file_hashes(root, skip=[R.results_dir(root, ASSIGNMENT).relative_to(root), Path("gradebook.db")])
    changed = sorted(k for k in graded["files_before"] if after.get(k) != graded["files_before"][k])
    added = sorted(k for k in after if k not in graded["files_before"])
    assert not changed, f"files changed: {changed[:10]}"
    assert not added, f"files appeared: {added[:10]}"
    for path, content in graded["targets_before"].items():
        if path.name != "gradebook.db":  # attnkit grade writes it; test_no_gradebook_row_changed checks it
            assert (path.read_bytes() if path.is_file() else None) == content, path


def test_no_gradebook_row_changed(graded):
    lost = graded["rows_before"] - gradebook_rows(graded["root"] / "gradebook.db")
    assert not lost, f"rows changed or removed: {sorted(lost, key=str)[:5]}"


def test_the_kit_is_untouched(graded):
    for folder in (KIT, KIT / "solutions", KIT / "fixtures", KIT / "fixtures" / "hidden", KIT / "tests"):
        assert not (folder / "pwned.txt").exists(), folder


def test_the_run_leaves_nothing_behind(graded):
    assert list(graded["tmpdir"].iterdir()) == [], "files left in TMPDIR"
    leftover = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(graded["tmpdir"]) in command or "attnkit-loot" in command:
            leftover.append(command[:200])
    assert not leftover, leftover


def test_every_stage_of_the_corpus_is_attacked():
    """The corpus covers every stage module, so that a channel left open in any stage would show."""
    attacked = {marker(stage) for entry in CORPUS for stage in entry.modules(Context(KIT, ASSIGNMENT, ()))}
    assert attacked == {marker(s) for s in stages(ASSIGNMENT)}


# ---------------------------------------------------------------- the same in a container

def test_in_a_container_every_entry_gets_the_same_grade(graded_in_a_container):
    """The container confinement gives every entry its honest grade, the one it gets here, with the reason."""
    records = graded_in_a_container["records"]
    for entry in CORPUS:
        got = {s["stage"]: s["points"] for s in records[entry.name]["stages"]}
        assert got == pytest.approx(expected_scores(graded_in_a_container["course"], entry), abs=1e-6), entry.name
        text = feedback(records[entry.name])
        assert all(reason in text for reason in entry.reasons), entry.name


def test_in_a_container_late_bystanders_are_graded_byte_for_byte_as_alone(graded_in_a_container):
    for student, alone in graded_in_a_container["alone"].items():
        assert graded_content(graded_in_a_container["records"][LATE + student]) == graded_content(alone), student


def test_in_a_container_every_record_says_so(graded_in_a_container):
    expected = {"mode": "container", "missing": ["mount", "pid", "cgroup", "cgroup limits"]}
    assert {json.dumps(r["confinement"], sort_keys=True) for r in graded_in_a_container["records"].values()} == \
        {json.dumps(expected, sort_keys=True)}


def test_in_a_container_the_run_announces_what_its_records_say(graded_in_a_container):
    """Said once the first worker's sandbox started: the confinement the records name, and why the stronger one
    failed (no namespaces can be made there)."""
    said = graded_in_a_container["run"].stderr
    assert "sandbox: container, WEAKER than full confinement" in said and "[namespaces: " in said, said[-2000:]


def test_in_a_container_nothing_else_changed_and_nothing_is_left(graded_in_a_container):
    test_no_file_outside_the_records_changed(graded_in_a_container)
    test_no_gradebook_row_changed(graded_in_a_container)
    test_the_kit_is_untouched(graded_in_a_container)
    test_the_run_leaves_nothing_behind(graded_in_a_container)


@pytest.mark.parametrize("where", ["here", "in a container"])
def test_no_feedback_quotes_hidden_material(request, where):
    """No record shows a line of a reference's solution regions or of a hidden test that its submission does not
    hold itself, however it is dressed (the read-dependency entry looks for the reference stage 9 builds on, the
    leak-dressed entry shows hidden material with separators, invisible characters, case and width)."""
    run = request.getfixturevalue("graded" if where == "here" else "graded_in_a_container")
    for student, record in run["records"].items():
        folder = run["root"] / "submitted" / student / ASSIGNMENT
        own = "\n".join(p.read_text(errors="replace") for p in folder.glob("s*.py") if p.is_file())
        leaked = hidden_quotes(json.dumps(record, ensure_ascii=False), own)
        assert not leaked, f"{student}: {leaked[:2]}"
    assert REDACTED in feedback(run["records"]["leak-dressed"])  # (it was there to remove)
