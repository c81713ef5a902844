"""``attnkit grade --notebooks``: nbgrader's autograded notebooks from ``attnkit grade``'s records.

After ``attnkit grade`` the gradebook holds every score, but ``autograded/`` is empty: the
formgrader has no notebook to show and ``nbgrader generate_feedback`` nothing to render. This
runs nbgrader's own autograde for each graded student, with the course's configuration and one
change: ``RecordedResults`` stands in for the step that executes the notebook in a kernel. It
gives each autograder cell the output that cell prints when it runs (the stage's verdicts, then
its score as the cell's value), taken from the student's record. Everything else is nbgrader's:
it copies the submission, sanitises the notebook and restores the locked cells, reads the scores
back from the outputs, saves them to the gradebook and applies late penalties, exactly as after
a real run, in a fraction of a second per student instead of a kernel start and a suite run.
"""
from __future__ import annotations

from pathlib import Path

from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Unicode

from . import results as R
from .scoring import stage_report
from .submission import defuse_links


class RecordedResults(NbGraderPreprocessor):
    """Fill each autograder cell with the output it prints, from the student's attnkit record."""

    records = Unicode("", help="the folder of attnkit grade's <student>.json records").tag(config=True)

    def preprocess(self, nb, resources):
        import nbformat

        student = resources["nbgrader"]["student"]
        record = R.read_record(R.record_path(Path(self.records), student))
        if record is None:
            raise RuntimeError(f"no attnkit grade record for {student} in {self.records}: run `attnkit grade` first")
        stages = {f"grade_{stage['stage']}": stage for stage in record["stages"]}
        count = 0
        for cell in nb.cells:
            stage = stages.get(cell.metadata.get("nbgrader", {}).get("grade_id"))
            if cell.cell_type != "code" or stage is None:
                continue
            count += 1
            cell.execution_count = count
            cell.outputs = [
                nbformat.v4.new_output("stream", name="stdout",
                                       text=stage_report(stage["marker"], stage["max_points"], stage["tests"]) + "\n"),
                nbformat.v4.new_output("execute_result", data={"text/plain": repr(stage["points"])},
                                       execution_count=count),
            ]
        return nb, resources


def stale(course_root: Path, assignment: str, notebook: str, records: dict[str, dict], out: Path) -> list[str]:
    """The students whose autograded notebook is missing or older than their record."""
    found = []
    for student in records:
        path = Path(course_root) / "autograded" / student / assignment / f"{notebook}.ipynb"
        record = R.record_path(out, student)
        if not path.is_file() or path.stat().st_mtime < record.stat().st_mtime:
            found.append(student)
    return found


def write_notebooks(course_root: Path, assignment: str, students: list[str], out: Path, progress=None) -> dict:
    """nbgrader's autograde for ``students``, the notebook's execution replaced by their records in
    ``out``. Returns {student: why nbgrader failed} (empty when all went through)."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(course_root)).load_config()
    steps = list(config.Autograde.autograde_preprocessors)
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
        result = api.autograde(assignment, student, force=True, create=True)
        if not result.get("success"):
            failed[student] = (result.get("error") or result.get("log") or "nbgrader autograde failed").strip()[-2000:]
        else:  # as the autograder cells do: nothing reaches the feedback through a link
            defuse_links(Path(course_root) / "autograded" / student / assignment)
        if progress is not None:
            progress.update(1)
    return failed
