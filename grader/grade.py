"""``attnkit grade``: grade a whole class, fast, resumably, locally or on a Dask cluster.

Layout of a run::

    main process (trusted)                 grading workers (trusted), one per core
    ----------------------                 ---------------------------------------
    find submissions, fingerprints    -->  job: student, the stage modules' sources, seed
    skip those already graded              one pytest session, suite collected once;
    write <student>.json + gradebook  <--  per job: run every collected item again
    grades.csv, grades.json                (learner code only in the sandbox: one
                                           template per worker, a box of its own
                                           for each submission, killed with it)

A worker is a ``python -m grader.grade`` process that imports torch, pytest and
the test modules once, collects the suite once (the same files and options as
``grader.autograde.run_suite``: book tests deselected, the same per-test time
limit, the autograde plugin that records verdicts), and then grades job after
job by running the collected items again with ``--impl`` and ``--seed`` set to
the job's submission. Session fixtures (the ``impl`` backend) are torn down
after each submission (its boxes are killed); the worker's sandbox template stays
(``SuiteSession`` owns it), so a submission costs a fork, not a torch import. Its
results are exactly run_suite's: the same tests, options, seed and time limits.

Jobs carry the sources rather than a path, so the same job runs on a Dask
worker on another machine (``--executor dask``): there, each Dask worker process
starts its own grading worker process on first use and keeps it.

Resuming: a student whose record (see ``grader.results``) exists with the same
fingerprint and the same points is not graded again (``--force`` regrades). A
record is written atomically as soon as its submission is graded; the gradebook
gets the new records every couple of seconds (one transaction each time) and is
brought in line with every record at the end of the run (and of the next run, if
this one is killed), so a run killed at any moment loses at most the submissions
in flight.
"""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from . import results as R
from . import scratch
from .autograde import (TEST_TIMEOUT, GradingError, graded_sources, limits_of, seed_of, submission_fingerprint, suite_dir,
                        suite_timeout)
from .sandbox import ONE_THREAD, Limits, probe

START_SECONDS = 300  # a worker must be ready (torch, pytest, collection, its sandbox) within this
GRADEBOOK_SECONDS = 2.0  # results reach the gradebook in one transaction at least this often
ANSWER_BYTES = 256 << 20  # a worker's answer for one submission is far smaller


class GradeError(RuntimeError):
    """A problem with the grading setup (printed as a plain error by the CLI)."""


class WorkerError(RuntimeError):
    """A grading worker died or stopped answering (never the learner's doing: their code is boxed)."""


# ---------------------------------------------------------------- the worker process

class SuiteSession:
    """A pytest session with the stage suites collected once, run again for each submission.

    It owns the grading worker's sandbox (one template, torch imported once); each submission
    gets boxes of its own from it (see grader.sandbox)."""

    def __init__(self, work: Path, limits: Limits, isolate: bool = True):
        from _pytest.config import _prepareconfig
        from _pytest.main import Session

        from . import autograde

        self.autograde = autograde
        self.work = work
        self.staging = work / "submission"  # the trusted copy the sandbox copies from
        self.staging.mkdir()
        tests = suite_dir()
        files = sorted(str(p) for p in tests.glob("test_s[0-9][0-9]_*.py"))
        if not files:
            raise GradingError(f"no stage test files (test_sNN_*.py) in {tests}")
        # run_suite's options (output captured by nobody: no terminal, no capture)
        args = [*files, "--rootdir", str(tests.parent), *autograde.grading_options(self.staging, 0, limits, isolate),
                "--capture=no"]
        self.config = _prepareconfig(args)
        self.config._do_configure()
        # The grading plugin launched the sandbox as pytest started (torch's imports overlap): it
        # serves every submission of this worker, each in boxes of its own.
        self.sandbox = getattr(self.config, "attnkit_sandbox", None) if isolate else None
        # Nobody reads this session's terminal (the autograde plugin records the verdicts): without
        # the reporter's hooks, a test's reports are not formatted and written out three times over.
        # What asks for the terminal writer (pytest-timeout's stack dump) still gets the real one.
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            self.config.pluginmanager.unregister(reporter)
            self.config.pluginmanager.register(_TerminalWriterOnly(reporter._tw), "terminalreporter")
        self.session = Session.from_config(self.config)
        self.config.hook.pytest_sessionstart(session=self.session)
        self.config.hook.pytest_collection(session=self.session)
        self.items = list(self.session.items)
        self.entries = [e for e in (autograde._item_entry(i.nodeid) for i in self.items) if e]
        if not self.entries:
            raise GradingError("the grading session collected no tests")

    @property
    def confinement(self) -> dict | None:
        return self.sandbox.start().record() if self.sandbox is not None else None

    def grade(self, sources: dict[str, bytes], seed: int) -> dict:
        for old in self.staging.iterdir():
            old.unlink()
        for name, data in sources.items():
            (self.staging / name).write_bytes(data)
        self.config.impl_root = self.staging.resolve()
        self.config.case_seed = seed
        record = self.autograde._record
        path = self.work / "results.jsonl"
        record.update(file=open(path, "w", encoding="utf-8"), verdicts={}, infrastructure=None)
        capped = []
        started = time.monotonic()
        try:
            self.autograde._write({"collected": self.entries})
            for index, item in enumerate(self.items):
                following = self.items[index + 1] if index + 1 < len(self.items) else None
                dropped = self.sandbox.dropped_output if self.sandbox is not None else 0
                # nextitem=None after the last item tears the session fixtures down: the
                # submission's backend closes (its boxes are killed), the sandbox stays.
                # The hook (not runtestprotocol itself) so that pytest-timeout's per-test timer
                # and the warning filters apply exactly as in run_suite.
                self.config.hook.pytest_runtest_protocol(item=item, nextitem=following)
                if self.sandbox is not None and self.sandbox.dropped_output > dropped:
                    capped.append(item.nodeid)
                if record["infrastructure"]:
                    break
        finally:
            record["file"].close()
            record["file"] = None
        seconds = time.monotonic() - started
        recorded = self.autograde.read_results(path, cut_short=False)  # GradingError if the sandbox failed
        return {"tests": recorded["tests"], "output_capped": capped, "confinement": self.confinement,
                "seconds": round(seconds, 3)}

    def close(self):
        if self.sandbox is not None:
            self.sandbox.close()


class _TerminalWriterOnly:
    """Stands in for pytest's terminal reporter: its writer, none of its hooks."""

    def __init__(self, writer):
        self._tw = writer


def _die_with_parent():
    """Linux: SIGKILL this process when the process (thread) that started it dies."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(options: dict) -> int:
    """The worker's main loop: one JSON job per line on stdin, one JSON answer per line out."""
    _die_with_parent()
    # Private copies of the job pipes: whatever pytest or torch print goes to the worker's log.
    jobs = os.fdopen(os.dup(0), "r", encoding="utf-8")
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    started = time.monotonic()
    import torch

    # One thread per worker, as in the boxes: workers share the cores; pinning them to cores
    # (sched_setaffinity) measured no better, and worse on a busy machine.
    torch.set_num_threads(1)
    with scratch.Folder("worker") as work:
        suite = SuiteSession(work.path, limits_of(options["test_timeout"], options.get("time_budget")))
        try:
            answers.write(json.dumps({"ready": True, "seconds": round(time.monotonic() - started, 3),
                                      "confinement": suite.confinement}) + "\n")
            for line in jobs:
                job = json.loads(line)
                sources = {name: base64.b64decode(data) for name, data in job["sources"].items()}
                try:
                    answer = suite.grade(sources, job["seed"])
                except GradingError as exc:
                    answers.write(json.dumps({"error": str(exc)}) + "\n")
                    return 1  # a fresh worker (and sandbox) for whatever comes next
                answers.write(json.dumps(answer) + "\n")
            return 0
        finally:
            suite.close()


class WorkerProcess:
    """The trusted side's handle on one grading worker process: start, send a job, wait, restart."""

    def __init__(self, options: dict):
        self.options = dict(options)  # {"test_timeout", "time_budget"}
        self.proc = None
        self.log = None
        self.start_seconds = None  # how long the last start took (torch, pytest, collection, sandbox)
        self.confinement = None  # what its sandbox confines (grader.sandbox.Confinement.record())
        self._buffer = bytearray()

    def start(self):
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, **ONE_THREAD)
        env.pop("NBGRADER_EXECUTION", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grader.grade", json.dumps(self.options)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, cwd=tempfile.gettempdir(), env=env,
        )
        self._buffer = bytearray()
        answer = self._answer(time.monotonic() + START_SECONDS)
        self.start_seconds, self.confinement = answer.get("seconds"), answer.get("confinement")

    def grade(self, job: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.start()
        line = json.dumps({"seed": job["seed"], "sources": {
            name: base64.b64encode(data).decode() for name, data in job["sources"].items()}})
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            raise self._failed("the grading worker stopped reading") from None
        limits = limits_of(self.options["test_timeout"], self.options.get("time_budget"))
        answer = self._answer(time.monotonic() + suite_timeout(limits))
        if "error" in answer:
            raise self._failed(answer["error"])
        return answer

    def _answer(self, deadline) -> dict:
        """The worker's next answer: one JSON line (read in linear time; the messages in it are capped
        where they come from, so a line beyond ANSWER_BYTES means a broken worker)."""
        fd = self.proc.stdout.fileno()
        searched = 0
        while (end := self._buffer.find(b"\n", searched)) < 0:
            searched = len(self._buffer)
            if searched > ANSWER_BYTES:
                raise self._failed(f"the grading worker's answer exceeds {ANSWER_BYTES >> 20} MiB")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._failed("the grading worker did not answer in time")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise self._failed("the grading worker died")
                self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        return json.loads(line)

    def _failed(self, what) -> WorkerError:
        tail = ""
        if self.log is not None:
            self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, self.log.tell() - 3000))
            tail = self.log.read().decode("utf-8", "replace").strip()
        self.close()
        return WorkerError(what + (f"; its log ends with:\n{tail}" if tail else ""))

    def close(self):
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.kill()  # its sandbox children follow (parent-death signal)
                except ProcessLookupError:
                    pass
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


# ---------------------------------------------------------------- jobs (local threads or Dask tasks)

_local = threading.local()  # this thread's WorkerProcess
_handles: list[WorkerProcess] = []  # every handle of this process, to close them all
_handles_lock = threading.Lock()


def run_job(job: dict, options: dict, stop: threading.Event | None = None) -> dict:
    """Grade one submission in this thread's warm worker process (started on first use).

    ``job``: {"student", "sources": {module file name: bytes}, "seed"}; ``options``:
    {"test_timeout", "time_budget"}. Returns {"student", "tests", "output_capped", "confinement",
    "seconds", "error"}; never raises for a grading failure (the worker is
    restarted and the job tried once more first). ``stop``: once set (an interrupted run), no
    worker is started any more.
    """
    handle = getattr(_local, "handle", None)
    if handle is None or handle.options != options:
        if handle is not None:
            handle.close()
        handle = _local.handle = WorkerProcess(options)
        with _handles_lock:
            _handles.append(handle)
    error = "the run was interrupted"
    for _ in range(2):
        if stop is not None and stop.is_set():
            break
        try:
            answer = handle.grade(job)
            return {"student": job["student"], "tests": answer["tests"], "output_capped": answer["output_capped"],
                    "confinement": answer.get("confinement"), "seconds": answer["seconds"],
                    "error": None}
        except (WorkerError, ValueError, KeyError) as exc:  # ValueError/KeyError: a garbled answer
            handle.close()
            error = f"{type(exc).__name__}: {exc}"
    return {"student": job["student"], "tests": [], "output_capped": [], "confinement": None, "seconds": 0.0,
            "error": error}


def close_workers():
    """Stop every grading worker process this process started."""
    with _handles_lock:
        handles, _handles[:] = list(_handles), []
    for handle in handles:
        handle.close()


class _LocalResults:
    """(job, result) as they complete, on ``workers`` local threads, each with its worker process.
    The workers start at once (torch, pytest, the sandbox's zygote: a second or so), while the
    caller goes on (opening the gradebook)."""

    def __init__(self, jobs, options, workers):
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnkit-grade")
        self.stop = threading.Event()
        self.futures = {self.pool.submit(run_job, job, options, self.stop): job for job in jobs}

    def __iter__(self):
        for future in as_completed(self.futures):
            yield self.futures[future], future.result()

    def close(self):
        self.stop.set()
        close_workers()  # also unblocks threads still waiting on a worker (interrupted run)
        self.pool.shutdown(wait=True, cancel_futures=True)


def _dask_results(jobs, options, scheduler):
    """The same jobs on an existing Dask distributed cluster (the workers need this kit installed)."""
    try:
        from distributed import Client, as_completed as dask_completed
    except ImportError:
        raise GradeError("--executor dask needs the 'distributed' package (pip install distributed)") from None
    with Client(scheduler, timeout="30s") as client:
        futures = {}
        for job in jobs:
            key = f"attnkit-grade-{job['student']}-{job['fingerprint'][:16]}-{os.urandom(4).hex()}"
            futures[client.submit(run_job, job, options, key=key, pure=False)] = job
        try:
            for future in dask_completed(list(futures)):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()
            try:
                client.run(close_workers)  # leave no grading processes behind on the cluster
            except Exception:
                pass


# ---------------------------------------------------------------- the nbgrader gradebook

class GradebookSync:
    """Writes attnkit's per-stage scores into nbgrader's gradebook, through nbgrader's own API:
    each stage's score becomes the auto score of its grade cell (``grade_<stage>``) in the
    course notebook, so that the formgrader and ``nbgrader export`` show it."""

    def __init__(self, db_url: str, assignment: str, notebook: str, points: dict[str, float]):
        self.db_url, self.assignment, self.notebook, self.points = db_url, assignment, notebook, points

    def _missing(self) -> GradeError:
        return GradeError(
            f"assignment {self.assignment!r} is not in the gradebook ({self.db_url}): run "
            f"`nbgrader generate_assignment {self.assignment}` in the course directory first"
        )

    def check(self):
        """Fail early, and clearly, if the assignment or its grade cells are not in the gradebook."""
        from nbgrader.api import Gradebook, MissingEntry

        if self.db_url.startswith("sqlite:///") and not Path(self.db_url[len("sqlite:///"):]).is_file():
            raise self._missing()  # (opening it would create an empty gradebook)
        # nbgrader runs `alembic` when it opens a gradebook: find it next to this Python.
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        with Gradebook(self.db_url) as gb:
            try:
                assignment = gb.find_assignment(self.assignment)
            except MissingEntry:
                raise self._missing() from None
            notebooks = {nb.name: nb for nb in assignment.notebooks}
            if self.notebook not in notebooks:
                raise GradeError(f"the gradebook's assignment {self.assignment!r} has no notebook {self.notebook!r}: "
                                 f"run `nbgrader generate_assignment --force {self.assignment}`")
            cells = {cell.name: cell.max_score for cell in notebooks[self.notebook].grade_cells}
            missing = [s for s in self.points if f"grade_{s}" not in cells]
            if missing:
                raise GradeError(f"the gradebook has no grade cell for {', '.join(missing)}: the course was rebuilt "
                                 f"after generate_assignment; run `nbgrader generate_assignment --force {self.assignment}`")
            differ = [s for s, p in self.points.items() if abs(cells[f"grade_{s}"] - p) > 1e-9]
            if differ:
                raise GradeError(f"points in the gradebook differ from the course's for {', '.join(differ)}: "
                                 f"run `nbgrader generate_assignment --force {self.assignment}`")

    def open(self):
        from nbgrader.api import Gradebook

        self.gb = Gradebook(self.db_url)
        return self

    def close(self):
        if getattr(self, "gb", None) is not None:
            self.gb.close()
            self.gb = None

    def write(self, records: list[dict], timestamps: dict[str, str] | None = None, progress=None) -> int:
        """Bring the gradebook in line with ``records`` (one transaction); returns how many grades changed."""
        from nbgrader.api import MissingEntry

        timestamps = timestamps or {}
        changed = 0
        gb = self.gb
        try:
            students = {student.id for student in gb.students}
            for record in records:
                student = record["student"]
                if student not in students:
                    gb.add_student(student)
                    students.add(student)
                try:  # one query for the notebook and its grades (not one per grade cell)
                    notebook = gb.find_submission_notebook(self.notebook, self.assignment, student)
                except MissingEntry:
                    extra = {"timestamp": timestamps[student]} if timestamps.get(student) else {}
                    gb.add_submission(self.assignment, student, **extra)
                    notebook = gb.find_submission_notebook(self.notebook, self.assignment, student)
                grades = {grade.name: grade for grade in notebook.grades}
                for stage in record["stages"]:
                    grade = grades[f"grade_{stage['stage']}"]
                    if grade.auto_score != stage["points"]:
                        grade.auto_score = stage["points"]
                        changed += 1
                    # as nbgrader's SaveAutoGrades: a grader's manual score still wants a look
                    grade.needs_manual_grade = grade.manual_score is not None
                if progress is not None:
                    progress.update(1)
            gb.db.commit()
        except BaseException:
            gb.db.rollback()
            raise
        return changed


# ---------------------------------------------------------------- a grading run

@dataclass
class Target:
    """Where the submissions are and where their grades go."""
    submissions: dict[str, Path]  # student -> submission folder
    assignment: str
    out: Path  # the per-student records, grades.csv, grades.json
    points: dict[str, float]  # stage module -> points, teaching order
    test_timeout: float = TEST_TIMEOUT  # CPU seconds per check
    time_budget: float | None = None  # CPU seconds per submission (None: derived from test_timeout)
    gradebook: GradebookSync | None = None
    timestamps: dict[str, str] = field(default_factory=dict)
    course_root: Path | None = None  # the nbgrader course (None: a plain folder of submissions)


def course_target(course_dir, assignment: str | None) -> Target:
    """nbgrader's layout: COURSE/submitted/<student>/<assignment>/."""
    from .course import Course, CourseError

    try:
        course = Course.load(course_dir)
    except CourseError as exc:
        raise GradeError(str(exc)) from None
    assignment = assignment or course.assignment
    submitted = course.root / "submitted"
    found = {}
    if submitted.is_dir():
        for student in sorted(p for p in submitted.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (student / assignment).is_dir():
                found[student.name] = student / assignment
    timestamps = {}
    for student, folder in found.items():
        stamp = folder / "timestamp.txt"
        if stamp.is_file():
            timestamps[student] = stamp.read_text().strip()
    db_url = course.db_url or f"sqlite:///{course.root / 'gradebook.db'}"
    return Target(submissions=found, assignment=assignment, out=R.results_dir(course.root, assignment),
                  points=dict(course.points), test_timeout=course.test_timeout, time_budget=course.time_budget,
                  timestamps=timestamps,
                  gradebook=GradebookSync(db_url, assignment, course.notebook, dict(course.points)),
                  course_root=course.root)


def folder_target(submissions_dir, out, assignment: str | None = None, points=None,
                  test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None) -> Target:
    """A folder of submission folders, one per student (named after the student)."""
    from .course import ASSIGNMENT, plan_points

    root = Path(submissions_dir).resolve()
    if not root.is_dir():
        raise GradeError(f"{root} is not a folder of submissions")
    found = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    return Target(submissions=found, assignment=assignment or ASSIGNMENT, out=Path(out).resolve(),
                  points=dict(points or plan_points()), test_timeout=test_timeout, time_budget=time_budget)


@dataclass
class Outcome:
    graded: list[str] = field(default_factory=list)  # graded in this run
    skipped: list[str] = field(default_factory=list)  # already graded (same fingerprint and points)
    errors: dict[str, str] = field(default_factory=dict)  # student -> why grading failed (retried next run)
    seconds: float = 0.0
    first_result_seconds: float | None = None  # latency of the first graded submission
    records: dict[str, dict] = field(default_factory=dict)  # every student's current record
    files: tuple = ()
    confinement: str = ""  # what the sandbox confines, as announced at the start


def _up_to_date(record: dict | None, fp: str, points: dict[str, float]) -> bool:
    if record is None or record.get("fingerprint") != fp:
        return False
    return [(s["stage"], s["max_points"]) for s in record["stages"]] == list(points.items())


def _bar(quiet, **kwargs):
    from tqdm import tqdm

    return tqdm(disable=quiet, file=sys.stderr, dynamic_ncols=True, **kwargs)


def grade(target: Target, *, students=None, force=False, executor="local", scheduler=None,
          workers=None, quiet=False) -> Outcome:
    """Grade ``target``'s submissions (those of ``students`` if given) that need it."""
    started = time.monotonic()
    outcome = Outcome()
    wanted = dict(target.submissions)
    if students:
        unknown = sorted(set(students) - set(wanted))
        if unknown:
            raise GradeError(f"no submission for {', '.join(unknown)} (found {len(wanted)} submissions)")
        wanted = {s: wanted[s] for s in students}
    jobs = []
    for student, folder in wanted.items():
        fp = submission_fingerprint(folder)
        if not force and _up_to_date(R.read_record(R.record_path(target.out, student)), fp, target.points):
            outcome.skipped.append(student)
            continue
        jobs.append({"student": student, "fingerprint": fp, "seed": seed_of(fp),
                     "sources": graded_sources(folder)})

    options = {"test_timeout": target.test_timeout, "time_budget": target.time_budget}
    scratch.sweep()  # what killed runs left in TMPDIR
    if executor == "local" and jobs:
        # Before any submission is graded: how well are they kept apart on this machine?
        announced = probe()
        outcome.confinement = announced.summary()
        if not quiet or announced.missing:
            print(outcome.confinement, file=sys.stderr)
    if executor == "dask":
        if not scheduler:
            raise GradeError("--executor dask needs --scheduler ADDRESS (e.g. tcp://host:8786)")
        stream = _dask_results(jobs, options, scheduler)
    elif executor == "local":
        workers = workers or os.cpu_count() or 1
        stream = _LocalResults(jobs, options, max(1, min(workers, len(jobs) or 1)))
    else:
        raise GradeError(f"unknown executor {executor!r} (local or dask)")

    try:
        if target.gradebook is not None:  # while the workers start
            target.gradebook.check()
            target.gradebook.open()
        target.out.mkdir(parents=True, exist_ok=True)
        for stale in target.out.glob(".*.tmp"):  # a write cut short by a killed run
            stale.unlink(missing_ok=True)
        synced = _collect(target, jobs, stream, outcome, started, quiet)
        # Bring every file and the gradebook in line with the records (also those of earlier runs).
        outcome.records = R.read_records(target.out, set(target.submissions))
        outcome.files = R.write_summary(target.out, target.assignment, list(outcome.records.values()))
        behind = [r for student, r in outcome.records.items() if synced.get(student) != r["fingerprint"]]
        if target.gradebook is not None and behind:
            with _bar(quiet or len(behind) < 50, total=len(behind), desc="gradebook", unit="student") as bar:
                target.gradebook.write(behind, target.timestamps, progress=bar)
    finally:
        stream.close()  # stops the workers now, also when interrupted
        if target.gradebook is not None:
            target.gradebook.close()
        scratch.sweep()  # the workers' folders (they are killed, so they cannot remove them)
    outcome.seconds = round(time.monotonic() - started, 3)
    return outcome


def check_notebooks_possible(target: Target):
    """``--notebooks`` writes nbgrader's autograded/ notebooks: only a course has them."""
    if target.course_root is None or target.gradebook is None:
        raise GradeError("--notebooks needs an nbgrader course (autograded/ notebooks), not --submissions")


def write_notebooks(target: Target, students=None, quiet=False) -> tuple[list[str], dict[str, str]]:
    """``autograded/`` notebooks for the graded students whose notebook is missing or older than their
    record (``students``: only those), through nbgrader's autograde (see ``grader.feedback``), so that
    the formgrader shows them and ``nbgrader generate_feedback`` works. Returns (written, {student: why
    nbgrader failed})."""
    from . import feedback

    check_notebooks_possible(target)
    records = R.read_records(target.out, set(students) if students else set(target.submissions))
    todo = feedback.stale(target.course_root, target.assignment, target.gradebook.notebook, records, target.out)
    with _bar(quiet, total=len(todo), desc="autograded notebooks", unit="nb") as bar:
        failed = feedback.write_notebooks(target.course_root, target.assignment, todo, target.out, progress=bar)
    return [s for s in todo if s not in failed], failed


def _collect(target: Target, jobs, stream, outcome: Outcome, started: float, quiet: bool) -> dict[str, str]:
    """Record each result as it arrives: the student's JSON at once, the gradebook every few seconds.
    Returns student -> fingerprint of the records this run wrote to the gradebook."""
    failing = limited = 0
    pending, synced, flushed = [], {}, time.monotonic()

    def flush():
        nonlocal pending, flushed
        if target.gradebook is not None and pending:
            target.gradebook.write(pending, target.timestamps)
            synced.update((r["student"], r["fingerprint"]) for r in pending)
        pending, flushed = [], time.monotonic()

    with _bar(quiet, total=len(jobs), desc=f"grading {target.assignment}", unit="sub") as bar:
        if jobs:
            for job, result in stream:
                student = job["student"]
                if result["error"]:
                    outcome.errors[student] = result["error"]
                else:
                    record = R.build(student=student, assignment=target.assignment,
                                     submission=target.submissions[student], tests=result["tests"],
                                     points=target.points, seconds=result["seconds"],
                                     output_capped=result["output_capped"], seed=job["seed"],
                                     confinement=result["confinement"])
                    if record["fingerprint"] != job["fingerprint"]:  # changed while being graded
                        outcome.errors[student] = "the submission changed while it was graded; run again"
                    else:
                        R.write_record(target.out, record)
                        pending.append(record)
                        if time.monotonic() - flushed >= GRADEBOOK_SECONDS:
                            flush()
                        outcome.graded.append(student)
                        failing += record["total"] < record["max_total"]
                        limited += bool(R.limits_hit(record))
                if outcome.first_result_seconds is None:
                    outcome.first_result_seconds = round(time.monotonic() - started, 3)
                bar.set_postfix(not_full=failing, limits=limited, errors=len(outcome.errors), refresh=False)
                bar.update(1)
        flush()
    return synced


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
