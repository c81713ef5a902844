"""The side of grading that nbgrader's autograder cells run, in the notebook's kernel.

The course notebook's first autograder cell grades the submission, and every autograder cell
reports one stage of it:

    from grader.course.cells import Grading
    grading = Grading("ASSIGNMENT", test_timeout=10.0)   # the first autograder cell only
    grading.stage("MARKER", points=12)                   # a stage's marker, and its points

In a course that counts the speed checks that cannot run (grader.course.settings.Course), the first cell
also says ``speed_checks="count"``.

``Grading`` grades the folder nbgrader runs the notebook in (the autograded copy of the
submission) once, through a grading worker (``grader.grading.worker``): the same suite, sandbox and seed as
``attnkit grade``. The kernel never imports learner code. Each ``stage`` call prints the stage's
verdicts and failure messages (never test code) and returns its score, which nbgrader takes as
partial credit. Nothing here writes to stderr: nbgrader zeroes a grade cell with stderr output,
so a correct submission that emits a warning would lose its points.

When the grader fails (its worker or sandbox, twice: ``grade_folder`` tries a fresh one), every stage's cell raises
``GradingFailed`` instead of returning a score, and the course's autograde step (grader.course.preprocessors) turns
that into a failure of nbgrader's autograde for this submission: no grade, the reason on the terminal.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks

from .. import submission as S
from ..grading.scoring import stage_report, stage_score
from ..grading.worker import WorkerError, grade_folder
from ..kit import stages
from ..sandbox.limits import TEST_TIMEOUT, Limits

RECORD_FILE = "attnkit-grading.json"  # the submission's record, beside it, for the instructor (never read back)


class GradingFailed(RuntimeError):
    """The grader could not grade this submission (its own failure, never the student's work): no score."""


class Grading:
    """The grades of the submission in ``folder`` (default: the working folder, where nbgrader runs
    the notebook). ``test_timeout``: CPU seconds per check; ``time_budget``: for the whole submission;
    ``speed_checks``: the course's choice for speed checks that cannot run here ("skip" or "count")."""

    def __init__(self, assignment: str, test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None,
                 folder=None, speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS):
        self.folder = Path(folder or os.getcwd()).resolve()
        self.error: WorkerError | None = None
        course = course_of(self.folder)
        with _no_stderr():
            with contextlib.suppress(OSError):
                S.defuse_links(self.folder)  # before any feedback is made from this folder
            try:
                self.graded = grade_folder(self.folder, Limits(check_seconds=test_timeout, budget_seconds=time_budget),
                                           stages(assignment), allow_plain=course.allow_plain if course else False,
                                           private=[course.root] if course else [], speed_checks=speed_checks)
            except WorkerError as exc:
                self.error = exc  # every stage's cell fails the same way, without grading again
            else:
                with contextlib.suppress(OSError):
                    (self.folder / RECORD_FILE).write_text(json.dumps(self.graded, indent=1))

    def stage(self, marker: str, points: float) -> float:
        """Print this stage's verdicts and return its score (the autograder cell's partial credit)."""
        if self.error is not None:
            raise GradingFailed(str(self.error))
        with _no_stderr():
            tests = [t for t in self.graded["tests"] if t["marker"] == marker]
            if not tests:
                raise WorkerError(f"the suite has no graded tests for stage {marker!r}")
            report, score = stage_report(tests[0]["stage"], points, tests), stage_score(tests, points)
        print(report)
        return score


def course_of(folder: Path):
    """The attnkit course whose autograded/<student>/<assignment>/ ``folder`` is (its settings: whether plain
    confinement is allowed; its root: what boxes must not reach), or None."""
    from ..errors import CourseError
    from .settings import MARKER_FILE, Course

    root = folder.parents[2] if len(folder.parents) > 2 else None
    if root is None or folder.parents[1].name != "autograded" or not (root / MARKER_FILE).is_file():
        return None
    try:
        return Course.load(root)
    except CourseError:
        return None


@contextlib.contextmanager
def _no_stderr():
    """Keep anything this process would write to stderr out of the cell's outputs."""
    sink = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.redirect_stderr(sink):
            yield sink
