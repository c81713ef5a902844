"""What the grading engine's parts hand each other, typed: a job, each check's verdict, a worker's messages, the
result a dispatcher gives back, and the record ``attnkit grade`` writes. All plain JSON-able data (a job's
sources aside, which travel base64-encoded): they cross process boundaries (a grading worker's pipes, a Dask
cluster) and lie in files (records). mypy checks them where they are made and read ([tool.mypy] in
pyproject.toml; kit_tests/test_kit.py runs it).

    submission ──Job──> worker (pytest + GradingPlugin) ──Ready, then WorkerAnswer{tests: [Verdict]} per job,
        or Stopped──> dispatch ──Result──> run ──Record (records.build)──> <student>.json, gradebook, report, Gradescope
"""
from __future__ import annotations

from typing import Literal, TypedDict

from ..sandbox.confinement import ConfinementRecord
from ..sandbox.limits import Limit

Outcome = Literal["passed", "failed", "skipped"]


class Job(TypedDict):
    """One submission to grade: its stage modules (file name -> source), the seed of its randomized cases (drawn
    from its fingerprint, grader.submission) and the stages it is graded on (None: every stage)."""
    sources: dict[str, bytes]
    seed: int
    stages: list[str] | None


class ClassJob(Job):
    """A job of ``attnkit grade``: whose submission, and what it is (its fingerprint names its record)."""
    student: str
    fingerprint: str


class Check(TypedDict):
    """A graded check of the suite, as records name it: its test, its stage and the stage's marker, its label."""
    nodeid: str
    stage: str
    marker: str
    label: str


class Ran(TypedDict):
    """What a check gave on one submission: its outcome, the failure (or skip) message a student may read, the
    sandbox limit it ran into (set by the sandbox where it stopped the check, grader.sandbox.limits.Limit), if any,
    and the mistakes the suite's diagnosis found (the words of its findings, diagnosis.FindingRecord's text)."""
    outcome: Outcome
    message: str
    limit: Limit | None
    mistakes: list[str]


class Verdict(Check, Ran):
    """A check on one submission: the check, and what it gave. (It holds every key of a TestRecord: what scores
    and reports a stage, grader.grading.scoring, takes either.)"""


class Ready(TypedDict):
    """A grading worker's first message: its session is collected and its sandbox started and proven, in
    ``seconds``; how that sandbox confines (what every record of this worker states, said before any learner
    code ran), and the same in words (Confinement.summary()); both None where the learner's code is not isolated
    (measurements only)."""
    ready: Literal[True]
    seconds: float
    confinement: ConfinementRecord | None
    summary: str | None


class Stopped(TypedDict):
    """A grading worker's last message, instead of an answer: why it cannot grade (its own failure, never the
    learner's); ``refused``: no confinement holds where it runs (the same for every submission)."""
    error: str
    refused: bool


class WorkerAnswer(TypedDict):
    """A grading worker's answer to a job: every graded check's verdict, the checks during which the learner's
    output was cut, how the learner's code was confined (grader.sandbox.confinement.Confinement.record()), and
    how long the job took."""
    tests: list[Verdict]
    output_capped: list[str]
    confinement: ConfinementRecord | None
    seconds: float


class Graded(WorkerAnswer):
    """One submission graded by a worker of its own (grader.grading.worker.grade_folder: nbgrader's autograder
    cells, Gradescope): the worker's answer, and the submission's fingerprint and the seed drawn from it."""
    fingerprint: str
    seed: int


class Result(WorkerAnswer):
    """What a dispatcher gives back for a ClassJob: the worker's answer, or why there is none (``error``; the
    submission is tried again by the next run); ``refused``: no confinement holds where the workers run."""
    student: str
    error: str | None
    refused: bool


class TestRecord(TypedDict):
    """A check in a record (grader.grading.records): its verdict and the mistakes the suite's diagnosis found."""
    nodeid: str
    label: str
    outcome: Outcome
    message: str
    mistakes: list[str]
    limit: Limit | None


class StageRecord(TypedDict):
    stage: str
    marker: str
    points: float
    max_points: float
    passed: int
    counted: int
    tests: list[TestRecord]


class Record(TypedDict):
    """One graded submission, ``<student>.json`` (schema 1: see grader.grading.records)."""
    schema: int
    student: str
    assignment: str
    submission: str
    fingerprint: str
    seed: int
    graded_at: str
    seconds: float
    confinement: ConfinementRecord | None
    total: float
    max_total: float
    stages: list[StageRecord]


class SummaryRow(TypedDict):
    """A student in ``grades.json``: their total, points per stage marker, the markers of the stages that hit a
    limit, and which record these come from."""
    student: str
    total: float
    points: dict[str, float]
    limits: list[str]
    fingerprint: str
    graded_at: str


class Summary(TypedDict):
    """``grades.json``: the records of a run's folder, one row each (grader.grading.records.write_summary)."""
    schema: int
    assignment: str
    max_total: float
    stages: dict[str, float]  # marker -> max_points
    students: list[SummaryRow]
