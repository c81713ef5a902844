"""The per-student grading record that ``attnkit grade`` writes (and ``attnkit report`` reads).

One JSON file per student, ``<out>/<student>.json`` (``<out>`` is
``COURSE/attnkit-grades/<assignment>/`` for an nbgrader course, or ``--out``)::

    {"schema": 1,
     "student": "alice", "assignment": "attention",
     "submission": "/abs/path/of/the/submission/folder",
     "fingerprint": "<sha256 hex of the graded modules' names and contents>",   # grader.submission
     "seed": 123,              # the seed of the randomized hidden cases (from the fingerprint)
     "graded_at": "2026-01-31T12:00:00+00:00",   # ISO 8601, UTC
     "seconds": 0.41,          # grading time of this submission in its worker
     "confinement": {"mode": "namespaces", "missing": []},   # how its code was kept apart (grader.sandbox.confinement)
     "total": 87.5, "max_total": 100.0,
     "stages": [               # teaching order
       {"stage": "s08_topic", "marker": "topic",
        "points": 9.0, "max_points": 12.0,       # points = max_points x passed / counted
        "passed": 9, "counted": 12,              # skipped tests (CUDA cases on a CPU) do not count
        "tests": [{"nodeid": "tests/test_s08_....py::test_x[cpu]", "label": "x / cpu",
                   "outcome": "passed" | "failed" | "skipped",
                   "message": "...",             # the failure (or skip) message, as in feedback
                   "mistakes": ["..."],          # what the suite's diagnosis found (its findings' words)
                   "limit": null | "time" | "budget" | "memory" | "crash" | "exit" | "output"}]}]}

``limit`` says which sandbox limit the test ran into, as the sandbox set it where it stopped the test
(grader.sandbox.limits.Limit): the time limit of one check (or a test not run because an earlier one of its
stage hit it), the time budget of the whole submission (this test and the rest were not run), the memory limit
(or a stage's memory ceiling), a crash (signal), an exit (``sys.exit``/``os._exit`` in learner code), or the
cap on an answer or on captured output (the output was truncated; the verdict stands on its own). The records'
types: grader.grading.contracts.

Beside the per-student files: ``grades.csv`` (one row per student: total and
points per stage; a cell a spreadsheet would run as a formula starts with ``'``) and
``grades.json`` (``{"schema": 1, "assignment", "max_total",
"stages": {marker: max_points}, "students": [{"student", "total", "points":
{marker: points}, "limits": [markers of stages that hit a limit], "fingerprint",
"graded_at"}]}``). Every file is written atomically (a temporary file renamed
over the old one), so a run killed at any moment leaves each file whole. A student id names a file
here, so it must be one that can (``student_problem``): a folder named ``grades`` or ``<b>`` is
refused before it is graded, never written.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

from ..kit import marker
from ..submission import seed_of
from ..untrusted import csv_cell, id_problem
from .contracts import ConfinementRecord, Record, StageRecord, Summary, SummaryRow, Verdict
from .scoring import stage_score

SCHEMA = 1
GRADES_DIR = "attnkit-grades"  # in an nbgrader course: GRADES_DIR/<assignment>/<student>.json
SUMMARY_FILES = ("grades.csv", "grades.json")  # the run's own files, beside the records


def results_dir(course_root, assignment: str) -> Path:
    """Where an nbgrader course's records of ``assignment`` live."""
    return Path(course_root) / GRADES_DIR / assignment


def build(*, student: str, assignment: str, submission: str | os.PathLike[str], fingerprint: str,
          tests: Sequence[Verdict], points: Mapping[str, float], seconds: float,
          confinement: ConfinementRecord | None = None) -> Record:
    """The record of one graded submission. ``tests`` are its checks' verdicts, each with the limit it hit
    (grader.grading.contracts.Verdict); ``points`` maps stage modules to their points, in order."""
    where = str(Path(submission).resolve())
    stages: list[StageRecord] = []
    for stage, max_points in points.items():
        mine = [t for t in tests if t["stage"] == stage]
        counted = [t for t in mine if t["outcome"] in ("passed", "failed")]
        stages.append({
            "stage": stage, "marker": marker(stage),
            "points": stage_score(mine, max_points), "max_points": max_points,
            "passed": sum(t["outcome"] == "passed" for t in counted), "counted": len(counted),
            "tests": [{
                "nodeid": t["nodeid"], "label": t["label"], "outcome": t["outcome"], "message": t["message"],
                "mistakes": list(t.get("mistakes") or []) if t["outcome"] == "failed" else [],
                "limit": t["limit"] if t["outcome"] != "skipped" else None,
            } for t in mine],
        })
    return {
        "schema": SCHEMA, "student": student, "assignment": assignment, "submission": where,
        "fingerprint": fingerprint,
        "seed": seed_of(fingerprint),
        "graded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
        "confinement": confinement,
        "total": round(sum(s["points"] for s in stages), 2),
        "max_total": round(sum(s["max_points"] for s in stages), 2),
        "stages": stages,
    }


def limits_hit(record: Record) -> list[str]:
    """Markers of the stages where some test ran into a sandbox limit."""
    return [s["marker"] for s in record["stages"] if any(t["limit"] for t in s["tests"])]


# ---------------------------------------------------------------- files

def write_atomic(path: Path, text: str):
    """Replace ``path`` with ``text`` in one step: readers (and a rerun after a crash) see the old
    file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with_suppressed(os.unlink, tmp)
        raise


def with_suppressed(func, *args):
    try:
        func(*args)
    except OSError:
        pass


def _own_file(student: str) -> str | None:
    """The run's own file that ``student``'s record would be (on any file system, case-insensitive ones too)."""
    return next((name for name in SUMMARY_FILES if name.casefold() == f"{student}.json".casefold()), None)


def student_problem(student: str) -> str | None:
    """Why ``student`` cannot have a record (None: it can): not a safe student id (``grader.untrusted``), or
    one whose record would be one of the run's own files (``grades`` -> grades.json). Refused before grading."""
    own = _own_file(student)
    return id_problem(student) or (own and f"its record {student}.json would be the run's own {own}")


def record_path(out: Path, student: str) -> Path:
    if Path(student).name != student or student in ("", ".", "..") or _own_file(student):
        raise ValueError(f"{student!r} cannot name a record in {out}: it would be another file")
    return Path(out) / f"{student}.json"


def write_record(out: Path, record: Record) -> Path:
    path = record_path(out, record["student"])
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return path


def read_record(path: Path) -> Record | None:
    """A record, or None if the file is missing, unreadable or of another schema. (Typed as a Record once its schema
    is known: records are the trusted side's own files, written whole by ``write_record``.)"""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA or not isinstance(record.get("stages"), list):
        return None
    return cast(Record, record)


def read_records(out: Path, students: Collection[str] | None = None) -> dict[str, Record]:
    """student -> record for the records in ``out`` (only ``students`` if given)."""
    found: dict[str, Record] = {}
    for path in sorted(Path(out).glob("*.json")):
        if path.name in SUMMARY_FILES or (students is not None and path.stem not in students):
            continue
        record = read_record(path)
        if record is not None and record.get("student") == path.stem:
            found[path.stem] = record
    return found


def write_summary(out: Path, assignment: str, records: Sequence[Record]) -> tuple[Path, Path]:
    """grades.csv and grades.json in ``out`` for ``records`` (sorted by student)."""
    records = sorted(records, key=lambda r: r["student"])
    stages: dict[str, float] = {}  # marker -> max_points
    for record in records:
        for s in record["stages"]:
            stages.setdefault(s["marker"], s["max_points"])
    rows: list[SummaryRow] = []
    for record in records:
        points = {s["marker"]: s["points"] for s in record["stages"]}
        rows.append({"student": record["student"], "total": record["total"], "points": points,
                     "limits": limits_hit(record), "fingerprint": record["fingerprint"],
                     "graded_at": record["graded_at"]})
    summary: Summary = {"schema": SCHEMA, "assignment": assignment,
                        "max_total": round(sum(stages.values()), 2), "stages": stages, "students": rows}
    buffer = io.StringIO()
    # Every text cell quoted (OWASP: a tab, CR or quote in a student id stays inside its cell), numbers as they are.
    writer = csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writerow(["student", "total", "max_total", *stages, "limits", "graded_at"])
    for row in rows:
        writer.writerow([csv_cell(cell) for cell in (
            row["student"], row["total"], summary["max_total"], *(row["points"].get(m, "") for m in stages),
            " ".join(row["limits"]), row["graded_at"])])
    csv_path, json_path = Path(out) / "grades.csv", Path(out) / "grades.json"
    write_atomic(csv_path, buffer.getvalue())
    write_atomic(json_path, json.dumps(summary, indent=1) + "\n")
    return csv_path, json_path
