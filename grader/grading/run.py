"""``attnkit grade``: grade a whole class, fast, resumably, locally or on a Dask cluster.

    main process (trusted)                       grading workers (grader.grading.worker), one per core
    ----------------------                       ---------------------------------------------
    read each submission's sources          -->  job: the sources and the seed drawn from them
    skip those already graded                    (a pytest session of the suite, collected once;
    write <student>.json + gradebook        <--  learner code only in its sandbox's boxes)
    grades.csv, grades.json

Resuming: a student whose record (see ``grader.grading.records``) exists with the same fingerprint and the
same points is not graded again (``--force`` regrades). A record is written atomically as soon as
its submission is graded; the gradebook gets the new records every couple of seconds (one
transaction each time) and is brought in line with every record at the end of the run (and of the
next run, if this one is killed), so a run killed at any moment loses at most the submissions in
flight.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .. import submission as S
from ..errors import GradeError
from ..sandbox import scratch
from ..sandbox.confinement import ConfinementRefused, probe
from ..sandbox.limits import Limits
from ..untrusted import printable
from . import records as R
from .contracts import ClassJob, Record, Result
from .dispatch import LocalResults, Results
from .targets import Target

GRADEBOOK_SECONDS = 2.0  # results reach the gradebook in one transaction at least this often



@dataclass
class Outcome:
    graded: list[str] = field(default_factory=list)  # graded in this run
    skipped: list[str] = field(default_factory=list)  # already graded (same fingerprint and points)
    errors: dict[str, str] = field(default_factory=dict)  # student -> why grading failed (retried next run)
    refused: dict[str, str] = field(default_factory=dict)  # student -> why the id cannot be graded (rename it)
    seconds: float = 0.0
    first_result_seconds: float | None = None  # latency of the first graded submission
    records: dict[str, Record] = field(default_factory=dict)  # every student's current record
    files: tuple = ()
    confinement: str = ""  # what the sandbox confines, as announced once the first worker's sandbox started


def _up_to_date(record: Record | None, fp: str, points: Mapping[str, float]) -> bool:
    if record is None or record.get("fingerprint") != fp:
        return False
    return [(s["stage"], s["max_points"]) for s in record["stages"]] == list(points.items())


def progress_bar(quiet, **kwargs):
    """A tqdm progress bar on stderr where it is a terminal (none with ``quiet``; none in a log that stderr was
    redirected to, where each of its frames would be a line: tqdm's disable=None)."""
    from tqdm import tqdm

    return tqdm(disable=True if quiet else None, file=sys.stderr, dynamic_ncols=True, **kwargs)


def grade(target: Target, *, students=None, force=False, executor="local", scheduler=None,
          workers=None, quiet=False) -> Outcome:
    """Grade ``target``'s submissions (those of ``students`` if given) that need it. A student whose id
    cannot be a safe file name is refused (``outcome.refused``, why), and the others are graded."""
    if not target.submissions:  # refused before anything is written: it would empty grades.csv and grades.json
        raise GradeError(f"no submissions to grade: {target.where}. Nothing was graded or changed.")
    if executor not in ("local", "dask"):
        raise GradeError(f"unknown executor {executor!r} (local or dask)")
    if executor == "dask" and not scheduler:
        raise GradeError("--executor dask needs --scheduler ADDRESS (e.g. tcp://host:8786)")
    started = time.monotonic()
    outcome = Outcome()
    wanted = dict(target.submissions)
    if students:
        unknown = sorted(set(students) - set(wanted))
        if unknown:
            raise GradeError(f"no submission for {', '.join(map(printable, unknown))} "
                             f"(found {len(wanted)} submissions)")
        wanted = {s: wanted[s] for s in students}
    jobs: list[ClassJob] = []
    for student, folder in wanted.items():
        problem = R.student_problem(student)
        if problem is not None:
            outcome.refused[student] = problem
            continue
        sources = S.sources(folder, expected=target.points)
        fp = S.fingerprint(sources)
        if not force and _up_to_date(R.read_record(R.record_path(target.out, student)), fp, target.points):
            outcome.skipped.append(student)
            continue
        jobs.append({"student": student, "fingerprint": fp, "seed": S.seed_of(fp), "sources": sources,
                     "stages": list(target.points)})

    scratch.sweep()  # what killed runs left in TMPDIR
    if not jobs and _gradebook_holds(target):  # nothing left to do: no worker, no gradebook (seconds to open)
        target.out.mkdir(parents=True, exist_ok=True)
        outcome.records = R.read_records(target.out, set(target.submissions))
        outcome.files = R.write_summary(target.out, target.assignment, list(outcome.records.values()))
        outcome.seconds = round(time.monotonic() - started, 3)
        return outcome
    stream, bar = _start(jobs, Limits(check_seconds=target.test_timeout, budget_seconds=target.time_budget),
                         target, executor, scheduler, workers, outcome, quiet), None
    try:
        # The bar lasts as long as the workers: their start and stop are part of the run's time, and of its rate.
        bar = progress_bar(quiet or not jobs, total=len(jobs), desc=f"grading {target.assignment} (starting)",
                           unit="sub")
        if target.gradebook is not None:  # while the workers start
            target.gradebook.check()
            target.gradebook.open()
        target.out.mkdir(parents=True, exist_ok=True)
        for stale in target.out.glob(".*.tmp"):  # a write cut short by a killed run
            stale.unlink(missing_ok=True)
        synced = _collect(target, jobs, stream, outcome, started, bar)
        # Bring every file and the gradebook in line with the records (also those of earlier runs).
        bar.set_description(f"grading {target.assignment} (writing grades)")
        outcome.records = R.read_records(target.out, set(target.submissions))
        outcome.files = R.write_summary(target.out, target.assignment, list(outcome.records.values()))
        behind = [r for student, r in outcome.records.items() if synced.get(student) != r["fingerprint"]]
        if target.gradebook is not None and behind:
            if len(behind) < 50:
                target.gradebook.write(behind, target.timestamps)
            else:
                bar.close()
                with progress_bar(quiet, total=len(behind), desc="gradebook", unit="student") as books:
                    target.gradebook.write(behind, target.timestamps, progress=books)
        bar.set_description(f"grading {target.assignment} (stopping the workers)")
    finally:
        if stream is not None:
            stream.close()  # stops the workers now, also when interrupted
        if bar is not None:
            bar.set_description(f"grading {target.assignment}", refresh=False)
            bar.close()
        if target.gradebook is not None:
            target.gradebook.close()
        _sweep_workers()  # the workers' folders (they are killed, so they cannot remove them)
    if target.gradebook is not None:  # (only once every record is in it: a run cut short leaves no note)
        _note_gradebook(target, outcome.records)
    outcome.seconds = round(time.monotonic() - started, 3)
    return outcome


# A note beside the records of what the gradebook holds once a run has brought it in line with them: the next run
# with nothing to grade finds it true and need not open the gradebook at all (nbgrader's API takes seconds to
# import). It names the gradebook's state then (a SQLite file's size and time of change): anything that writes
# the gradebook since (nbgrader's autograde, the formgrader, a rebuild) makes the note stale, and the run brings
# the gradebook in line again, as every run did before. A gradebook whose state cannot be read (a server's) is
# always opened.
GRADEBOOK_NOTE = ".gradebook-in-line"  # (no .json: the records are the folder's *.json)


def _gradebook_holds(target: Target) -> bool:
    """Whether the target's gradebook (if any) is known to hold its records as they are now."""
    if target.gradebook is None:
        return True
    try:
        note = json.loads((target.out / GRADEBOOK_NOTE).read_text())
    except (OSError, ValueError):
        return False
    state = target.gradebook.state()
    records = R.read_records(target.out, set(target.submissions))
    return state is not None and note == {"state": state, "records": {s: r["fingerprint"] for s, r in records.items()}}


def _sweep_workers(seconds: float = 3.0):
    """Remove the folders of the workers this run stopped. A killed worker's lock is dropped only once the last of
    its processes has gone (its sandbox follows it by a parent-death signal, a moment later): sweep again for a few
    seconds while a folder of this run's workers (named after this process) is still held, so that none is left
    behind for the next run to find. Another run's workers, which may grade on for long, are not waited for."""
    deadline = time.monotonic() + seconds
    scratch.sweep()
    while time.monotonic() < deadline and scratch.held(f"{scratch.PREFIX}worker-{os.getpid()}-"):
        time.sleep(0.05)
        scratch.sweep()


def _note_gradebook(target: Target, records: Mapping[str, Record]):
    note = target.out / GRADEBOOK_NOTE
    state = target.gradebook.state() if target.gradebook is not None else None
    if state is None:
        note.unlink(missing_ok=True)
        return
    R.write_atomic(note, json.dumps({"state": state, "records": {s: r["fingerprint"] for s, r in records.items()}}))


def _start(jobs: list[ClassJob], limits: Limits, target: Target, executor: str, scheduler, workers,
           outcome: Outcome, quiet: bool) -> Results | None:
    """The stream of (job, result) of ``jobs`` (None if there are none), its workers starting; says first how
    well submissions are kept apart where they run (on stderr, also with ``quiet`` when that is weaker than it
    should be). Nothing is graded where nothing confines, unless the instructor allowed plain confinement."""
    if not jobs:
        return None
    stream: Results
    if executor == "dask":
        try:
            from . import on_dask
        except ModuleNotFoundError as exc:
            if exc.name not in ("distributed", "dask"):
                raise
            raise GradeError("--executor dask needs Dask's distributed: pip install distributed (or, in the kit's "
                             "folder, pip install -e '.[dask]'); nothing was graded or changed") from None
        try:
            cluster = on_dask.DaskResults(jobs, limits, scheduler, target.allow_plain, target.speed_checks)
        except on_dask.SchedulerError as exc:
            raise GradeError(str(exc)) from None
        stream = cluster
        lines, weaker = cluster.confinement, cluster.weaker
    else:
        try:
            probe(allow_plain=target.allow_plain)  # where nothing can confine, refused at once
        except ConfinementRefused as exc:
            raise GradeError(str(exc)) from None
        local = LocalResults(jobs, limits, max(1, min(workers or os.cpu_count() or 1, len(jobs))),
                             allow_plain=target.allow_plain, private=target.private,
                             speed_checks=target.speed_checks)
        stream = local
        # Announced once a worker's sandbox has started and proven its confinement: the one records will name.
        summary, record = local.confinement() or (None, None)
        lines, weaker = ([summary], bool(record and record.get("missing"))) if summary else ([], False)
    outcome.confinement = "\n".join(lines)
    if not quiet or weaker:
        print(outcome.confinement, file=sys.stderr)
    return stream


def _collect(target: Target, jobs: list[ClassJob], stream: Results | None, outcome: Outcome, started: float,
             bar) -> dict[str, str]:
    """Record each result as it arrives: the student's JSON at once, the gradebook every few seconds.
    Returns student -> fingerprint of the records this run wrote to the gradebook."""
    failing = limited = 0
    pending: list[Record] = []
    synced: dict[str, str] = {}  # student -> the fingerprint of the record the gradebook has
    flushed = time.monotonic()

    def flush():
        nonlocal pending, flushed
        if target.gradebook is not None and pending:
            target.gradebook.write(pending, target.timestamps)
            synced.update((r["student"], r["fingerprint"]) for r in pending)
        pending, flushed = [], time.monotonic()

    arriving: Iterable[tuple[ClassJob, Result]] = ()  # (no stream: no jobs)
    if stream is not None:
        arriving = stream
    for job, result in arriving:
        student = job["student"]
        if result.get("refused"):  # no confinement holds where the workers run: the same for everyone
            raise GradeError(result["error"])
        if result["error"]:
            outcome.errors[student] = result["error"]
        else:
            folder = target.submissions[student]
            if S.fingerprint(S.sources(folder, expected=target.points)) != job["fingerprint"]:  # changed
                outcome.errors[student] = "the submission changed while it was graded; run again"
            else:
                record = R.build(student=student, assignment=target.assignment, submission=folder,
                                 fingerprint=job["fingerprint"], tests=result["tests"], points=target.points,
                                 seconds=result["seconds"],
                                 confinement=result["confinement"])
                R.write_record(target.out, record)
                pending.append(record)
                if time.monotonic() - flushed >= GRADEBOOK_SECONDS:
                    flush()
                outcome.graded.append(student)
                failing += record["total"] < record["max_total"]
                limited += bool(R.limits_hit(record))
        if outcome.first_result_seconds is None:
            outcome.first_result_seconds = round(time.monotonic() - started, 3)
            bar.set_description(f"grading {target.assignment}")
        bar.set_postfix(not_full=failing, limits=limited, errors=len(outcome.errors), refresh=False)
        bar.update(1)
    flush()
    return synced
