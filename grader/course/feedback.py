"""The feedback nbgrader makes: its page, and ``attnkit grade --notebooks``.

**The feedback page.** ``nbgrader generate_feedback`` renders each autograded notebook with its
``feedback`` template, which calls every grade cell "Test cell" in the page's index, heads it with
its grade_id and shows its whole source, hidden tests and their markers included. The course's
nbgrader_config.py adds two steps of its own: ``FeedbackCells`` takes the hidden region out of the
autograder cells again (as the release had them) and drops their value (the score, already in the
heading), and ``FeedbackPage`` is nbgrader's template with each autograder cell named by its first
line, the stage's heading ("Stage 8: Causal attention, batched", grader.course.notebook).

**attnkit grade --notebooks.** After ``attnkit grade`` the gradebook holds every score, but
``autograded/`` is empty: the formgrader has no notebook to show and ``nbgrader generate_feedback``
nothing to render. This runs nbgrader's own autograde for each graded student, with the course's
configuration and one change: ``RecordedResults`` stands in for the step that executes the notebook
in a kernel. It gives each autograder cell the output that cell prints when it runs (the stage's
verdicts, then its score as the cell's value), taken from the student's record; the other code cells
(setup, demos, checks) print nothing when nbgrader runs them (they do nothing under NBGRADER_EXECUTION,
grader.course.notebook), so they get no output, and every code cell its execution count, in order, and the
notebook the kernel's ``language_info`` (IPython highlighting), as after a run. Everything else is
nbgrader's: it copies the submission, sanitises the notebook and restores the locked cells, reads
the scores back from the outputs, saves them to the gradebook and applies late penalties, exactly as
after a real run, in a fraction of a second per student instead of a kernel start and a suite run.
"""
from __future__ import annotations

from pathlib import Path
from shlex import quote

from nbconvert.exporters import HTMLExporter
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from nbgrader.utils import is_grade, is_solution
from traitlets import Unicode, default
from traitlets.utils.importstring import import_item

from ..errors import GradeError
from ..grading import records as R
from ..grading.run import progress_bar
from ..grading.scoring import stage_report
from ..grading.targets import Target
from ..submission import defuse_links
from .preprocessors import without_hidden_tests

# ---------------------------------------------------------------- the feedback page

HEADINGS = "attnkit_headings"  # resources key: {grade_id: the cell's heading}


def heading(source: str) -> str | None:
    """An autograder cell's name: its first line when that is a comment ('# Stage 1: ...'), else None."""
    first = source.lstrip().partition("\n")[0]
    if not first.startswith("#"):
        return None
    return first.lstrip("#").strip() or None


class FeedbackCells(NbGraderPreprocessor):
    """generate_feedback: the autograder cells as students saw them (hidden tests out), their
    verdicts, and no value (the score is in the cell's heading); each cell's heading for the page."""

    def preprocess(self, nb, resources):
        headings = resources.setdefault(HEADINGS, {})
        for cell in nb.cells:
            if cell.cell_type != "code" or not is_grade(cell) or is_solution(cell):
                continue
            cell.source = without_hidden_tests(cell.source, self).rstrip()
            cell.outputs = [o for o in cell.outputs if o.output_type != "execute_result"]
            name = heading(cell.source)
            if name:
                headings[cell.metadata.nbgrader["grade_id"]] = name
        return nb, resources


# templates/feedback.html.j2: nbgrader's feedback template
# (server_extensions/formgrader/templates/feedback/index.html.j2), two parts changed: the index and each grade
# cell's heading name the cell by its heading (FeedbackCells), where nbgrader says "Test cell" and shows the
# grade_id; and long lines of verdicts wrap. The index lists grade cells only: the course notebook has no
# solution, task or manually graded cells.
FEEDBACK_TEMPLATE = (Path(__file__).parent / "templates" / "feedback.html.j2").read_text().replace(
    "__HEADINGS__", HEADINGS)


class FeedbackPage(HTMLExporter):
    """The exporter of ``nbgrader generate_feedback`` in the course (``GenerateFeedback.exporter_class``):
    nbgrader's, with FEEDBACK_TEMPLATE over its feedback template."""

    @default("raw_template")
    def _raw_template_default(self):
        return FEEDBACK_TEMPLATE


# ---------------------------------------------------------------- attnkit grade --notebooks

class RecordedResults(NbGraderPreprocessor):
    """The notebook as nbgrader's Execute leaves it, from the student's attnkit record: each autograder
    cell with the output it prints, the other code cells with none (what they print when graded),
    execution counts in order, the kernel's language_info. Nothing of the submission runs here."""

    records = Unicode("", help="the folder of attnkit grade's <student>.json records").tag(config=True)

    def preprocess(self, nb, resources):
        import nbformat

        student = resources["nbgrader"]["student"]
        record = R.read_record(R.record_path(Path(self.records), student))
        if record is None:
            raise RuntimeError(f"no attnkit grade record for {student} in {self.records}: run `attnkit grade` first")
        stages = {f"grade_{stage['stage']}": stage for stage in record["stages"]}
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        for count, cell in enumerate(code, start=1):
            cell.execution_count = count
            stage = stages.get(cell.metadata.get("nbgrader", {}).get("grade_id"))
            cell.outputs = [] if stage is None else [
                nbformat.v4.new_output("stream", name="stdout",
                                       text=stage_report(stage["stage"], stage["max_points"], stage["tests"]) + "\n"),
                nbformat.v4.new_output("execute_result", data={"text/plain": repr(stage["points"])},
                                       execution_count=count),
            ]
        nb.metadata["language_info"] = kernel_language_info()
        return nb, resources


def kernel_language_info() -> dict:
    """The language_info the python3 kernel (ipykernel, this Python) reports, which the notebook gets when it
    runs: the formgrader and the feedback page highlight the code as IPython by it."""
    from ipykernel.ipkernel import IPythonKernel

    return dict(IPythonKernel.language_info)


def stale(course_root: Path, assignment: str, notebook: str, records: dict[str, dict], out: Path) -> list[str]:
    """The students whose autograded notebook is missing or older than their record."""
    found = []
    for student in records:
        path = Path(course_root) / "autograded" / student / assignment / f"{notebook}.ipynb"
        record = R.record_path(out, student)
        if not path.is_file() or path.stat().st_mtime < record.stat().st_mtime:
            found.append(student)
    return found


def write_course_notebooks(course_root: Path, assignment: str, students: list[str], out: Path, progress=None,
                    notebook: str | None = None) -> dict:
    """nbgrader's autograde for ``students``, the notebook's execution replaced by their records in
    ``out``. Returns {student: why there is no notebook, and what to do, in one line} (empty when all
    went through). nbgrader makes the autograded notebook from the one the student submitted
    (``notebook``.ipynb): a submission without it is reported as such, not tried."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course_root)).load_config()
    # A step is a class or its import string (as nbgrader_config.py names them, grader.course.build).
    steps = [import_item(step) if isinstance(step, str) else step for step in config.Autograde.autograde_preprocessors]
    config.Autograde.autograde_preprocessors = [
        RecordedResults if isinstance(step, type) and issubclass(step, Execute) else step for step in steps]
    if RecordedResults not in config.Autograde.autograde_preprocessors:
        raise RuntimeError("the course's nbgrader_config.py has no Execute step "
                           "in c.Autograde.autograde_preprocessors: rebuild it with `attnkit course build`")
    config.RecordedResults.records = str(out)
    api = NbGraderAPI(config=config)
    api.log.setLevel("ERROR")
    failed = {}
    for student in students:
        submitted = Path(course_root) / "submitted" / student / assignment
        if notebook and not (submitted / f"{notebook}.ipynb").is_file():
            release = Path(course_root) / "release" / assignment / f"{notebook}.ipynb"
            failed[student] = (f"their submission has no {notebook}.ipynb, which nbgrader makes the autograded "
                               f"notebook and the feedback from (their grade stands): copy {quote(str(release))} into "
                               f"{quote(str(submitted))}/ or have them submit it, then run again")
            if progress is not None:
                progress.update(1)
            continue
        result = api.autograde(assignment, student, force=True, create=True)
        if not result.get("success"):
            why = (result.get("error") or result.get("log") or "nbgrader autograde failed").strip().splitlines()[-1]
            failed[student] = f"{why} (nbgrader's autograde failed; run again to retry)"
        else:  # as the autograder cells do: nothing reaches the feedback through a link
            defuse_links(Path(course_root) / "autograded" / student / assignment)
        if progress is not None:
            progress.update(1)
    return failed


# ---------------------------------------------------------------- for attnkit grade's target

def check_notebooks_possible(target: Target):
    """``--notebooks`` writes nbgrader's autograded/ notebooks: only a course has them."""
    if target.course_root is None or target.gradebook is None:
        raise GradeError("--notebooks needs an nbgrader course (autograded/ notebooks), not --submissions")


def write_notebooks(target: Target, students=None, quiet=False) -> tuple[list[str], dict[str, str]]:
    """``autograded/`` notebooks for the graded students whose notebook is missing or older than their
    record (``students``: only those), through nbgrader's autograde (see ``grader.course.feedback``), so that
    the formgrader shows them and ``nbgrader generate_feedback`` works. Returns (written, {student: why none
    was written, and what to do})."""
    check_notebooks_possible(target)
    records = R.read_records(target.out, set(students) if students else set(target.submissions))
    todo = stale(target.course_root, target.assignment, target.gradebook.notebook, records, target.out)
    with progress_bar(quiet, total=len(todo), desc="autograded notebooks", unit="nb") as bar:
        failed = write_course_notebooks(target.course_root, target.assignment, todo, target.out, progress=bar,
                                        notebook=target.gradebook.notebook)
    return [s for s in todo if s not in failed], failed
