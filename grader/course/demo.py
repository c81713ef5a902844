"""``attnkit demo``: nbgrader's grading round and ``attnkit grade`` on the built-in sample submissions.

Builds a course with every assignment of the kit this Python can grade (one whose packages are missing, Triton for
the kernels off Linux, is left out, saying what to install); releases each with ``generate_assignment`` and puts one
submission per sample (grader/course/samples.py) in ``submitted/``. One assignment (chapter 3's, or those asked for)
goes through nbgrader's own round, autograde and generate_feedback, and then through ``attnkit grade``, whose stage
scores must equal nbgrader's; the others are graded by ``attnkit grade`` alone, in a thread (its grading workers are
processes) while nbgrader's round runs (its autograde takes one core: a notebook at a time). Every assignment gets
its class report; then nbgrader export, and a table of students x stages per assignment from the gradebook.

nbgrader's autograde (seconds per submission: a kernel each) is most of the time, so that a first command shows
the whole kit in a couple of minutes with one assignment's round; ``--nbgrader NAME`` or ``--all`` ask for more.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from shlex import quote

from .. import kit
from ..errors import CourseError
from ..kit import marker
from .build import build
from .samples import load_into, samples
from .settings import Course

DEMO_FILE = ".attnkit-demo"  # marks a directory the demo may wipe and rebuild
NBGRADER_OUTPUTS = ("release", "submitted", "autograded", "feedback", "exchange", "gradebook.db", "grades.csv",
                    "nbgrader.log", "attnkit-grades")  # (attnkit grade's records too: a demo run grades afresh)


def load_api(root: Path):
    """nbgrader's Python API, configured by the course's own nbgrader_config.py."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    api = NbGraderAPI(config=config)
    api.log.setLevel("ERROR")
    return api


def check(result: dict, what: str):
    if not result.get("success"):
        raise RuntimeError(f"nbgrader {what} failed:\n{result.get('error') or result.get('log')}")


def stage_scores(c: Course, students) -> dict:
    """{student: {stage module: score}} of ``c``'s assignment, read from the course's gradebook (nbgrader's
    Gradebook API)."""
    from nbgrader.api import Gradebook

    scores = {}
    with Gradebook(c.gradebook_url, c.course_id) as gb:
        for student in students:
            scores[student] = {
                stage: gb.find_grade(f"grade_{stage}", c.notebook, c.assignment, student).score
                for stage in c.points
            }
    return scores


def prepare(root: Path):
    """Make ``root`` ready for a fresh demo: new or empty, or a previous demo (wiped)."""
    if root.exists() and any(root.iterdir()):
        if not (root / DEMO_FILE).is_file():
            raise CourseError(
                f"{root} is not empty and was not made by `attnkit demo`; choose another --dir"
            )
        for name in NBGRADER_OUTPUTS:
            path = root / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    root.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def stderr_to(path: Path):
    """Send this process's stderr (and its children's: the kernels) to a log file meanwhile: nbgrader's
    harmless noise (SQLAlchemy warnings, "kernel running over TCP") would bury the progress lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a") as log, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def run(root="attnkit-demo", out=print, nbgrader=None) -> dict:
    """The demo in ``root``; ``nbgrader``: the assignments to put through nbgrader's round too ("all", or names;
    default: the kit's first, chapter 3's)."""
    root = Path(root).expanduser().resolve()
    start = time.monotonic()
    prepare(root)
    out(f"[  0.0s] building the course in {quote(str(root))}", flush=True)
    gradable = []
    for name in kit.assignments():
        lacking = kit.assignment(name).missing()
        if lacking:  # (Triton, for the kernels: its wheels are for Linux)
            out(f"[  0.0s] {name} left out: this Python lacks {', '.join(lacking)} (pip install "
                f"{' '.join(quote(line) for line in lacking)}, then run the demo again to grade it too)", flush=True)
        else:
            gradable.append(name)
    rounds = nbgrader_rounds(gradable, nbgrader)
    c = build(root, assignments=gradable)
    (root / DEMO_FILE).write_text("made by `attnkit demo`; the demo may wipe and rebuild this directory\n")
    with stderr_to(root / "nbgrader.log"):
        result = _run(root, c, rounds, start, out)
    out(f"nbgrader's own log output: {quote(str(root / 'nbgrader.log'))}")
    return result


def nbgrader_rounds(gradable: list[str], asked=None) -> list[str]:
    """The assignments of ``gradable`` that go through nbgrader's round: those ``asked`` ("all", or names; one this
    Python cannot grade is left out, as said), by default the kit's first."""
    if asked == "all":
        return list(gradable)
    wanted = set(asked or [next(iter(kit.assignments()))])
    return [name for name in gradable if name in wanted]


def _run(root: Path, course: Course, nbgrader: list[str], start: float, out) -> dict:
    """Every assignment of the course released with samples; those of ``nbgrader`` through nbgrader's round and then
    ``attnkit grade`` (the scores must be equal), the others through ``attnkit grade`` alone, meanwhile."""
    lock = threading.Lock()

    def step(message):
        with lock:  # (two threads say what they did)
            out(f"[{time.monotonic() - start:5.1f}s] {message}", flush=True)

    def release(names):
        for name in names:
            t = time.monotonic()
            check(api.generate_assignment(name, force=True), "generate_assignment")
            step(f"nbgrader generate_assignment {name}: {time.monotonic() - t:.1f} s")
            step(f"{len(load_into(root, name, force=True))} sample submissions of {name} in submitted/")

    api = load_api(root)
    reporting = threading.Lock()
    graded_alone = [name for name in course.assignments if name not in nbgrader]
    release(graded_alone)  # (first: their grading starts while nbgrader's round is prepared)
    others = Others(course, graded_alone, step, reporting)
    try:
        release(nbgrader)
        rounds = {name: _nbgrader_round(api, course.of(name), step) for name in nbgrader}
    finally:
        others.nbgrader_done.set()  # (the rest of the others' grading may take both cores)

    # The same classes through the fast path (same suite and sandbox), whose records feed the class reports.
    from ..grading.run import grade
    from .gradebook import class_report
    from .targets import course_target

    differ, reports = [], {}
    for name, (_, scores, _) in rounds.items():
        t = time.monotonic()
        outcome = grade(course_target(root, name), quiet=True)
        if outcome.errors:
            raise RuntimeError(f"attnkit grade {name} failed for {sorted(outcome.errors)}")
        different = sorted(student for student, record in outcome.records.items()
                           if any(abs(s["points"] - scores[student][s["stage"]]) > 1e-6 for s in record["stages"]))
        differ += [f"{name}/{student}" for student in different]
        step(f"attnkit grade {name}: {len(outcome.records)} in {time.monotonic() - t:.1f} s, "
             + (f"DIFFERENT from nbgrader's autograde for {', '.join(different)}" if different else
                "every stage score equal to nbgrader's autograde"))
        t = time.monotonic()
        with reporting:
            reports[name], _ = class_report(course, name)
        step(f"attnkit report {name}: {time.monotonic() - t:.1f} s")
    reports.update(others.finish())
    reports = {name: reports[name] for name in course.assignments}

    t = time.monotonic()
    grades_csv = root / "grades.csv"
    export = subprocess.run(
        [sys.executable, "-m", "nbgrader", "export", "--to", str(grades_csv)],
        cwd=root, capture_output=True, text=True,
    )
    if export.returncode != 0 or not grades_csv.is_file():
        raise RuntimeError(f"nbgrader export failed:\n{export.stderr[-3000:]}")
    step(f"nbgrader export: {time.monotonic() - t:.1f} s")

    samples_of = {name: [s.student for s in samples(name)] for name in course.assignments}
    scores = {name: rounds[name][1] if name in rounds else stage_scores(course.of(name), samples_of[name])
              for name in course.assignments}
    for name in course.assignments:
        out("")
        out(f"{name} (" + ("nbgrader's autograde, and attnkit grade the same" if name in rounds else
                           "attnkit grade; nbgrader's round too with --nbgrader " + name) + "):")
        out(table(course.of(name), scores[name]))
    out("")
    out(f"grades.csv:     {quote(str(grades_csv))}")
    for report in reports.values():
        out(f"class report:   {quote(str(report))}")
    timings = [seconds for _, _, times in rounds.values() for seconds in times.values()]
    if rounds:
        name = next(iter(rounds))
        example = next(s.student for s in samples(name) if s.breaks and "*" not in s.breaks)
        out(f"feedback HTML:  {quote(str(root / 'feedback'))}/<student>/<assignment>/<notebook>.html, e.g.")
        out(f"                {quote(str(root / 'feedback' / example / name / (course.of(name).notebook + '.html')))}")
    out((f"nbgrader's autograde: {sum(timings) / len(timings):.1f} s per submission on average; " if timings else "")
        + f"whole demo {time.monotonic() - start:.0f} s")
    return {"course": course, "rounds": rounds, "scores": scores, "grades_csv": grades_csv, "reports": reports,
            "fast_path_differs": differ}


class Others:
    """``attnkit grade`` and ``attnkit report`` of the assignments that skip nbgrader's round, one after another in a
    thread while nbgrader's round goes on: one grading worker while nbgrader's autograde holds the other core, a
    worker per core once it is done. (In this process: nbgrader's API and matplotlib, seconds to import, are here
    already; the grading workers are processes of their own in any case.)"""

    def __init__(self, course: Course, names: list[str], step, reporting: threading.Lock):
        self.course, self.names, self.step, self.reporting = course, names, step, reporting
        self.nbgrader_done = threading.Event()
        self.reports: dict[str, Path] = {}
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._grade_all, name="attnkit-demo-others", daemon=True)
        if names:
            self.thread.start()

    def _grade_all(self):
        from ..grading.run import grade
        from .gradebook import class_report
        from .targets import course_target

        try:
            for name in self.names:
                beside = not self.nbgrader_done.is_set()
                t = time.monotonic()
                outcome = grade(course_target(self.course.root, name), workers=1 if beside else None, quiet=True)
                if outcome.errors:
                    raise RuntimeError(f"attnkit grade {name} failed for {sorted(outcome.errors)}")
                self.step(f"attnkit grade {name}: {len(outcome.records)} in {time.monotonic() - t:.1f} s "
                          f"({'one worker, beside nbgrader' if beside else 'a worker per core'})")
                t = time.monotonic()
                with self.reporting:  # (matplotlib's pyplot: one report at a time)
                    self.reports[name], _ = class_report(self.course, name)
                self.step(f"attnkit report {name}: {time.monotonic() - t:.1f} s")
        except BaseException as exc:  # raised again in the main thread, by finish()
            self.failed = exc

    def finish(self) -> dict[str, Path]:
        """Their class reports, once every one is done; what failed, raised again."""
        if self.names:
            self.thread.join()
        if self.failed is not None:
            raise self.failed
        return self.reports


def _nbgrader_round(api, c: Course, step) -> tuple:
    """nbgrader's autograde and generate_feedback of one generated assignment on its samples: (the course describing
    it, {student: {stage: score}}, {student: autograde seconds})."""
    students = samples(c.assignment)
    timings = {}
    for i, sample in enumerate(students, start=1):
        t = time.monotonic()
        check(api.autograde(c.assignment, sample.student, force=True), f"autograde {sample.student}")
        timings[sample.student] = time.monotonic() - t
        step(f"autograde {c.assignment} {i}/{len(students)} {sample.student:<18} {timings[sample.student]:5.1f} s  "
             f"({sample.description})")

    t = time.monotonic()
    check(api.generate_feedback(c.assignment, force=True), "generate_feedback")
    step(f"nbgrader generate_feedback {c.assignment}: {time.monotonic() - t:.1f} s")
    return c, stage_scores(c, [s.student for s in students]), timings


def table(c: Course, scores: dict) -> str:
    """Students x stages with totals; the last column says whether the sample lost points exactly
    on the stages it was written to break."""
    stages = list(c.points)
    width = max([18, *(len(student) + 2 for student in scores)])
    head = f"{'student':<{width}}" + "".join(f"{s[:3]:>7}" for s in stages) + f"{'total':>8}  as expected?"
    lines = [head, f"{'(max)':<{width}}" + "".join(f"{c.points[s]:>7g}" for s in stages) + f"{c.total:>8g}"]
    by_id = {s.student: s for s in samples(c.assignment)}
    for student, row in scores.items():
        sample = by_id.get(student)
        lost = {marker(s) for s in stages if (row[s] or 0) < c.points[s] - 1e-9}
        if sample and "*" in sample.breaks:
            expected = set(marker(s) for s in stages)
        else:
            expected = set(sample.breaks if sample else ())
        verdict = "yes" if lost == expected else f"NO (lost points on: {', '.join(sorted(lost)) or 'nothing'})"
        total = sum(v or 0 for v in row.values())
        cells = "".join(f"{(v or 0):>7g}" for v in row.values())
        lines.append(f"{student:<{width}}{cells}{total:>8.2f}  {verdict}")
    legend = "stages: " + ", ".join(f"{s[:3]} {marker(s)}" for s in stages)
    return "\n".join(lines + ["", legend])
