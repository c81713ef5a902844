"""``attnkit report``: a class report as a self-contained folder (index.html + PNG plots).

It reads what ``attnkit grade`` leaves behind:

    COURSE/gradebook.db                          nbgrader's gradebook: one grade cell per stage
    COURSE/attnkit-grades/<assignment>/<student>.json   per student: stages, tests, messages, limits

and writes ``COURSE/attnkit-grades/<assignment>/report/index.html`` with

- the score distribution per stage (histograms of points / max points, one small plot per stage),
- the most frequent diagnosed mistakes per stage (the "Likely mistake:" lines of failed tests),
  apart from the stages students left as stubs (a stub is not a mistake, and one untouched
  submission would otherwise top every stage's chart),
- the modules that could not be run at all (a syntax error, an import that fails, a missing file),
- the students whose code hit a limit (time, memory, crash, exit, output, the submission's budget), with
  the stage: one hit per student, stage and kind (one check runs out of time, and the rest of its stage
  is not run: one hit, its checks counted beside it).

Every plot has a table next to it with the same numbers, so the page is readable without the images.
Points come from the gradebook when there is one (it is what ``nbgrader export`` shows); the JSON
files supply the details. Where the two disagree, the page says so.

Everything in a record a student controls (their id, messages, mistakes) is inert here: escaped in the
HTML, and drawn as plain text in the plots (no mathtext or TeX: ``plain_text``), with control characters
shown as escapes (``grader.untrusted``).
"""
from __future__ import annotations

import contextlib
import json
import re
import statistics
import textwrap
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

import jinja2

from suite_runtime.stage_names import teaching_order

from ..errors import ReportError
from ..grading import records as R
from ..grading.contracts import Record, TestRecord
from ..sandbox.limits import LIMITS
from ..untrusted import printable

TOP_MISTAKES = 8  # mistakes listed per stage
STUB = re.compile(r"\bNotImplementedError\b")  # what a stub raises (grader/authoring/stubs.py writes them)
# What the suite's adapters say when a stage module cannot be run at all (tests/adapters.py, SubmissionError):
COULD_NOT_RUN = re.compile(r"\S+\.py (has a syntax error on line|is missing from )|\S+ contains null bytes|"
                           r"importing \S+\.py failed with ")
BINS = 10  # histogram bins over 0..100 %



# ---------------------------------------------------------------- reading the results

def load_results(folder) -> list[Record]:
    """The per-student JSON files of ``folder`` (grades.json and other files are skipped), by student. (Typed as
    records once their schema is known; what follows reads them with care all the same: a missing part is
    left out of the report, not an error.)"""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} does not exist: grade the class first (`attnkit grade`)")
    students = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ReportError(f"{path}: not readable JSON ({exc})") from None
        if not isinstance(data, dict) or "stages" not in data or "student" not in data:
            continue  # grades.json, or anything else that is not one student's record
        if data.get("schema") != R.SCHEMA:
            raise ReportError(f"{path}: schema {data.get('schema')!r}, this report reads schema {R.SCHEMA}")
        students.append(cast(Record, data))
    if not students:
        raise ReportError(f"no student results (<student>.json) in {folder}")
    return sorted(students, key=lambda s: s["student"])


# ---------------------------------------------------------------- the numbers

@dataclass
class StageSummary:
    stage: str
    marker: str
    max_points: float
    points: dict = field(default_factory=dict)  # student -> points
    mistakes: Counter = field(default_factory=Counter)  # mistake text -> tests that named it
    mistake_students: dict = field(default_factory=lambda: defaultdict(set))  # mistake -> students
    stubs: set = field(default_factory=set)  # students with a check that ran into a stub of this stage
    could_not_run: dict = field(default_factory=dict)  # student -> why the stage's module could not be run (first line)

    @property
    def students_with_mistakes(self) -> set:
        """Students with at least one named mistake in this stage (stubs are not mistakes)."""
        return set().union(*self.mistake_students.values())

    @property
    def fractions(self) -> list[float]:
        m = self.max_points
        return [p / m if m else 0.0 for p in self.points.values()]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.points.values()) if self.points else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.points.values()) if self.points else 0.0

    @property
    def full_marks(self) -> int:
        return sum(p >= self.max_points - 1e-9 for p in self.points.values())

    @property
    def zero(self) -> int:
        return sum(p <= 1e-9 for p in self.points.values())


@dataclass
class Limit:
    """One limit hit: a student's stage ran into a limit of one kind (the submission's time budget: once in all);
    ``test`` is the first check that did, ``checks`` how many failed by it (the ones not run after it too)."""
    student: str
    stage: str
    kind: str
    test: str
    message: str
    checks: int = 1


@dataclass
class ClassReport:
    assignment: str | None  # (None: not given, and the records do not say)
    source: str  # where the numbers came from, for the page
    stages: dict  # stage -> StageSummary, teaching order
    students: dict  # student -> {"total", "max_total", "seconds"}
    limits: list  # [Limit]
    mismatches: list = field(default_factory=list)  # gradebook vs JSON disagreements, as text
    unconfined: list = field(default_factory=list)  # students graded unconfined (plain: the instructor allowed it)

    def limit_summary(self) -> str:
        """The limit hits in words: "2 limit hits (6 checks failed by them)"."""
        hits, checks = len(self.limits), sum(x.checks for x in self.limits)
        if not hits:
            return "no limit hit"
        return (f"{hits} limit hit{'s' * (hits > 1)} ({checks} check{'s' * (checks > 1)} failed by "
                f"{'them' if hits > 1 else 'it'})")


def first_line(text: str) -> str:
    return " ".join(text.strip().split("\n")[0].split())


def is_stub(test: TestRecord) -> bool:
    """A failed check that ran into code not written yet: the stub's NotImplementedError."""
    return bool(STUB.search(test.get("message") or ""))


def could_not_run(test: TestRecord) -> str | None:
    """Why a failed check's stage module could not be run at all (the first line of the message), or None."""
    message = (test.get("message") or "").strip()
    return first_line(message) if COULD_NOT_RUN.match(message) else None


def summarize(results: Sequence[Record], gradebook: dict | None = None, assignment: str | None = None,
              source: str = "") -> ClassReport:
    """The report's numbers. ``gradebook`` ({student: {stage: (score, max)}}), when given, supplies
    the points; the JSON results supply mistakes and limits (and the points otherwise)."""
    stages: dict[str, StageSummary] = {}
    students, limits, mismatches = {}, [], []
    for record in results:
        student = record["student"]
        hits: dict[tuple[str, ...], Limit] = {}  # (stage, kind), or ("budget",) once for all stages -> its Limit
        book = (gradebook or {}).get(student) if gradebook is not None else None
        if gradebook is not None and book is None:
            mismatches.append(f"{student}: has a result file but no submission in the gradebook")
        total = 0.0
        for entry in record["stages"]:
            stage = entry["stage"]
            s = stages.get(stage)
            if s is None:
                s = stages[stage] = StageSummary(stage, entry.get("marker") or stage.split("_", 1)[-1],
                                                 float(entry["max_points"]))
            points = float(entry["points"])
            if book is not None:
                if stage not in book:
                    mismatches.append(f"{student}: stage {stage} is not in the gradebook")
                else:
                    score, max_score = book[stage]
                    score = float(score or 0.0)
                    if abs(score - points) > 0.005:
                        mismatches.append(f"{student}: {stage} has {score:g} points in the gradebook, "
                                          f"{points:g} in {student}.json (the gradebook's figure is used)")
                    points = score
                    if max_score is not None:
                        s.max_points = float(max_score)
            s.points[student] = points
            total += points
            for test in entry.get("tests", []):
                if test.get("outcome") == "failed" and is_stub(test):
                    s.stubs.add(student)
                elif test.get("outcome") == "failed" and could_not_run(test):
                    s.could_not_run.setdefault(student, could_not_run(test))
                elif test.get("outcome") == "failed":
                    for mistake in test.get("mistakes") or []:
                        text = first_line(mistake)
                        if text:
                            s.mistakes[text] += 1
                            s.mistake_students[text].add(student)
                kind = test.get("limit")
                if kind:
                    key = ("budget",) if kind == "budget" else (stage, kind)
                    if key in hits:  # a check not run because of it, or the same limit again
                        hits[key].checks += 1
                    else:
                        hits[key] = Limit(student, stage, kind, test.get("label") or test.get("nodeid", ""),
                                          first_line(test.get("message") or ""))
                        limits.append(hits[key])
        students[student] = {"total": round(total, 2), "max_total": record.get("max_total"),
                             "seconds": record.get("seconds")}
    if gradebook is not None:
        for student in sorted(set(gradebook) - set(students)):
            mismatches.append(f"{student}: in the gradebook but has no result file")
    order = sorted(stages, key=teaching_order)
    unconfined = sorted(r["student"] for r in results
                        if (confinement := r.get("confinement")) and confinement.get("mode") == "plain")
    return ClassReport(assignment or (results[0].get("assignment") if results else ""), source,
                       {k: stages[k] for k in order}, students, limits, mismatches, unconfined)


# ---------------------------------------------------------------- plots

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def plain_text():
    """Text drawn as it is written: no mathtext (``$...$`` in a student's text would be parsed, and a bad
    expression fails the whole figure) and no TeX (an instructor's matplotlibrc may turn it on)."""
    import matplotlib

    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        yield


def _whole_numbers(axis):
    """Ticks at whole numbers only: the axis counts students."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def plot_scores(report: ClassReport, path: Path) -> Path:
    """Small multiples: one histogram of points/max per stage, plus the totals."""
    plt = _pyplot()
    fig = scores_figure(report)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scores_figure(report: ClassReport):
    """The figure of ``plot_scores``: a panel per stage, then the totals' panel; each panel at the bottom of
    its column says what its x axis counts."""
    plt = _pyplot()
    panels = list(report.stages.values())
    n = len(panels) + 1
    cols = 4
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False, layout="constrained")
    bins = [i / BINS * 100 for i in range(BINS + 1)]
    for ax, s in zip(axes.flat, panels):
        ax.hist([f * 100 for f in s.fractions], bins=bins, color="#4c72b0", edgecolor="white")
        ax.axvline(s.mean / s.max_points * 100 if s.max_points else 0, color="#c44e52", lw=1.5)
        ax.set_title(f"{s.stage}\nmean {s.mean:.2f} / {s.max_points:g}", fontsize=9)
        ax.set_xlim(0, 100)
        _whole_numbers(ax.yaxis)
        ax.tick_params(labelsize=8)
    totals = [v["total"] / v["max_total"] * 100 if v.get("max_total") else 0 for v in report.students.values()]
    ax = axes.flat[len(panels)]
    ax.hist(totals, bins=bins, color="#55a868", edgecolor="white")
    ax.set_title(f"total\nmean {statistics.fmean(totals) if totals else 0:.1f} %", fontsize=9)
    ax.set_xlim(0, 100)
    _whole_numbers(ax.yaxis)
    ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("students", fontsize=8)
    for i, ax in enumerate(list(axes.flat)[:n]):
        if i + cols >= n:  # nothing below it
            ax.set_xlabel("% of the total points" if i == len(panels) else "% of the stage's points", fontsize=8)
    fig.suptitle(f"Score distribution per stage ({len(report.students)} students; red line: mean)", fontsize=11)
    return fig


def plot_mistakes(report: ClassReport, path: Path) -> Path | None:
    """One horizontal bar chart per stage that has diagnosed mistakes: students per mistake."""
    plt = _pyplot()
    panels = [s for s in report.stages.values() if s.mistakes]
    if not panels:
        return None
    heights = [min(len(s.mistakes), TOP_MISTAKES) for s in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(0.45 * h + 0.8 for h in heights)),
                             gridspec_kw={"height_ratios": [h + 1 for h in heights]}, squeeze=False,
                             layout="constrained")
    for ax, s in zip(axes[:, 0], panels):
        top = top_mistakes(s)
        labels = ["\n".join(textwrap.wrap(printable(text), 70, max_lines=2, placeholder=" …")) for text, _, _ in top]
        counts = [len(students) for _, _, students in top]
        ax.barh(range(len(top)), counts, color="#dd8452")
        ax.set_yticks(range(len(top)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(s.stage, fontsize=9, loc="left")
        ax.set_xlim(0, len(report.students))  # the whole class: a bar's length is its share of the class
        _whole_numbers(ax.xaxis)
        ax.tick_params(axis="x", labelsize=8)
    axes[-1, 0].set_xlabel(f"students (of {len(report.students)})", fontsize=8)
    fig.suptitle("Most frequent diagnosed mistakes per stage (students; stubs not counted)", fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_limits(report: ClassReport, path: Path) -> Path | None:
    """Stacked bars: students per stage that hit each kind of limit."""
    plt = _pyplot()
    if not report.limits:
        return None
    pairs = {(lim.student, lim.stage, lim.kind) for lim in report.limits}
    stages = [s for s in report.stages if any(p[1] == s for p in pairs)]
    kinds = [k for k in LIMITS if k != "budget" and any(p[2] == k for p in pairs)]
    kinds += sorted({p[2] for p in pairs} - set(kinds))
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(stages) + 1.5), layout="constrained")
    left = [0] * len(stages)
    for kind in kinds:
        counts = [sum(1 for p in pairs if p[1] == s and p[2] == kind) for s in stages]
        ax.barh(range(len(stages)), counts, left=left, label=kind)
        left = [a + b for a, b in zip(left, counts)]
    ax.set_yticks(range(len(stages)), stages, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, len(report.students))  # the whole class, as in the mistakes chart
    _whole_numbers(ax.xaxis)
    ax.set_xlabel(f"students (of {len(report.students)})", fontsize=8)
    ax.legend(title="limit", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Students whose code hit a limit, per stage", fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def top_mistakes(s: StageSummary, n: int = TOP_MISTAKES) -> list[tuple[str, int, list[str]]]:
    """[(mistake, failed tests naming it, students)] by number of students, then tests."""
    rows = [(text, count, sorted(s.mistake_students[text])) for text, count in s.mistakes.items()]
    rows.sort(key=lambda r: (-len(r[2]), -r[1], r[0]))
    return rows[:n]


# ---------------------------------------------------------------- the page

# The page is a template, grader/outputs/templates/report.html.j2: autoescaped, every value shown through `text`.
PAGE = jinja2.Environment(loader=jinja2.PackageLoader("grader.outputs", "templates"), autoescape=True,
                          undefined=jinja2.StrictUndefined, trim_blocks=True)
PAGE.filters["text"] = printable


def render_html(report: ClassReport, images: dict) -> str:
    stages = list(report.stages.values())
    scores = [[s.stage, f"{s.max_points:g}", f"{s.mean:.2f}",
               f"{(s.mean / s.max_points * 100) if s.max_points else 0:.0f} %", f"{s.median:g}", s.full_marks, s.zero,
               len(s.students_with_mistakes), len(s.stubs), len(s.could_not_run)] for s in stages]
    tops = [(s.stage, top_mistakes(s)) for s in stages]
    mistakes = [(stage, [[text, len(who), count, ", ".join(who[:10]) + (" …" if len(who) > 10 else "")]
                         for text, count, who in top]) for stage, top in tops if top]
    stubs = [[s.stage, len(s.stubs), ", ".join(sorted(s.stubs))] for s in stages if s.stubs]
    not_run = [[s.stage, who, why[:300]] for s in stages for who, why in sorted(s.could_not_run.items())]
    limits = [[x.student, x.stage, x.kind, x.test, x.checks, x.message[:200]]
              for x in sorted(report.limits, key=lambda x: (x.student, x.stage, x.test))]
    students_head = ["student"] + [s.stage[:3] for s in stages] + ["total", "seconds"]
    students = [["(max)"] + [f"{s.max_points:g}" for s in stages] + [f"{sum(s.max_points for s in stages):g}", ""]]
    students += [[name] + [f"{s.points.get(name, 0):g}" for s in stages]
                 + [f"{info['total']:g}", "" if info.get("seconds") is None else f"{info['seconds']:.1f}"]
                 for name, info in sorted(report.students.items())]
    return PAGE.get_template("report.html.j2").render(
        report=report, n=len(report.students), images=images,
        written=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), scores=scores, mistakes=mistakes,
        stubs=stubs, not_run=not_run, limits=limits, students_head=students_head, students=students)


def write_report(report: ClassReport, out_dir) -> Path:
    """Write out_dir/index.html and its PNGs; returns the HTML path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.png"):
        old.unlink()
    images = {}
    with plain_text():
        for name, plot in (("scores", plot_scores), ("mistakes", plot_mistakes), ("limits", plot_limits)):
            if plot(report, out_dir / f"{name}.png"):
                images[name] = f"{name}.png"
    index = out_dir / "index.html"
    index.write_text(render_html(report, images), encoding="utf-8")
    return index


def build_report(results, assignment: str | None = None, out=None, gradebook: dict | None = None,
                 source: str | None = None) -> tuple[Path, ClassReport]:
    """The class report of the records in the folder ``results``, written into ``out`` (default: its report/).
    ``gradebook`` ({student: {stage: (score, max)}}), when given, supplies the points (``source`` says whose:
    an nbgrader course's, grader.course.gradebook.class_report)."""
    folder = Path(results)
    report = summarize(load_results(folder), gradebook, assignment, source or f"the result files in {folder}")
    index = write_report(report, Path(out) if out else folder / "report")
    return index, report
