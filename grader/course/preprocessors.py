"""The course's own steps in nbgrader's autograde (named in the nbgrader_config.py that
``attnkit course build`` writes). Kept apart from ``grader.course.build`` so that what only reads a
course (``attnkit grade``) does not import nbgrader's whole application."""
from __future__ import annotations

from nbformat import NotebookNode
from nbgrader.api import Gradebook, MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, Execute, NbGraderPreprocessor
from nbgrader.utils import setenv


class KeepCourseCells(NbGraderPreprocessor):
    """Autograde (first sanitize step): the notebook's cells as the course made them.

    The course notebook carries no student code, so a code cell a student added can only be an
    attempt to run something in the grading kernel (patching the grader, printing a score): every
    code cell the source notebook does not have is dropped, and so is every second copy of a
    known cell. The nbgrader metadata of the cells that stay is rebuilt from the gradebook (a
    student may have edited it: flipped ``grade``, ``locked`` or ``points``, borrowed another
    cell's id); other cells lose theirs. nbgrader's own sanitizers then see a well-formed notebook
    (edited metadata otherwise makes them fail on the whole submission, e.g. a duplicated
    grade_id: KeyError in OverwriteCells) and restore the locked sources and the cell types.

    A locked cell that is exactly as the release has it gets its source from the gradebook here,
    hidden tests included. nbgrader's OverwriteCells would do the same, but it compares checksums
    taken before and after ``generate_assignment`` removed the hidden tests, so it warns
    "Attribute 'checksum' for cell ... has changed!" for every autograder cell of every untouched
    submission (nbgrader issue #1961). After this step that warning means what it says: the
    student edited a locked cell (nbgrader then restores it).
    """

    def preprocess(self, nb, resources):
        info = resources["nbgrader"]
        with Gradebook(info["db_url"]) as gb:
            try:
                source = gb.find_notebook(info["notebook"], info["assignment"])
            except MissingEntry:
                return nb, resources
            cells = {cell.name: cell for cell in source.source_cells}
            points = {cell.name: cell.max_score for cell in source.grade_cells}
            solutions = {cell.name for cell in source.solution_cells}
            tasks = {cell.name for cell in source.task_cells}
        kept, seen = [], set()
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader")
            grade_id = meta.get("grade_id") if isinstance(meta, dict) else None
            if isinstance(grade_id, str) and grade_id in cells and grade_id not in seen:
                seen.add(grade_id)
                restored = {"grade_id": grade_id, "locked": bool(cells[grade_id].locked),
                            "grade": grade_id in points, "solution": grade_id in solutions,
                            "task": grade_id in tasks, "schema_version": 3}
                if grade_id in points:
                    restored["points"] = points[grade_id]
                if restored != {k: meta.get(k) for k in restored}:
                    self.log.warning("Restoring the nbgrader metadata of cell %s", grade_id)
                cell.metadata["nbgrader"] = restored
                if restored["locked"] and cell.source == without_hidden_tests(cells[grade_id].source, self):
                    cell.source = cells[grade_id].source
                kept.append(cell)
            elif cell.cell_type == "code":
                self.log.warning("Dropping a code cell that is not part of the assignment: %r", cell.source[:60])
            else:
                cell.metadata.pop("nbgrader", None)
                kept.append(cell)
        nb.cells = kept
        return nb, resources


def without_hidden_tests(source: str, parent) -> str:
    """A cell's source as ``generate_assignment`` releases it: without its hidden tests (nbgrader's
    ClearHiddenTests, configured like ``parent``, the preprocessor asking)."""
    cell = NotebookNode(cell_type="code", source=source, metadata={})
    ClearHiddenTests(parent=parent, enforce_metadata=False).preprocess_cell(cell, {}, 0)
    return cell.source


class SafePathExecute(Execute):
    """nbgrader's Execute with PYTHONSAFEPATH=1 for the kernel: the submission folder (the kernel's
    working directory) is not put on sys.path, so a student's ``grader/`` or ``json.py`` cannot
    replace what the kernel imports.

    A grader failure is never a grade: no learner code runs in the kernel (grader.course.cells grades in a sandbox),
    and the course's cells are the course's own (``KeepCourseCells``), so an autograder cell that raised (the grader
    failed twice, the kernel could not import it) or a kernel that died says nothing of the student's work. nbgrader
    would score such a cell 0 and go on; here the submission's autograde fails instead: nbgrader reports the reason,
    removes the autograded copy, grades the other submissions and exits non-zero. A submission that had no grade
    before keeps none (the rows nbgrader made for it this run are removed); one graded before keeps its grades."""

    def preprocess(self, nb, resources, *args, **kwargs):
        try:
            with setenv(PYTHONSAFEPATH="1"):
                nb, resources = super().preprocess(nb, resources, *args, **kwargs)
            failed = grader_failures(nb)
            if failed:
                info = resources["nbgrader"]
                raise GraderFailure(
                    f"attention-kit could not grade {info['student']}'s {info['assignment']}: the grader failed, not "
                    f"the student's work, so no grade was recorded. {failed[0]}\nFix the cause and run nbgrader "
                    "autograde again for this student (see the kit's README, \"When the grader fails\").")
        except Exception:
            forget_ungraded(resources["nbgrader"])
            raise
        return nb, resources


class GraderFailure(RuntimeError):
    """An autograde that graded nothing because the grader failed (nbgrader reports it and exits non-zero)."""


def grader_failures(nb) -> list[str]:
    """What each autograder cell of the executed notebook ``nb`` raised (its error's name and message)."""
    found = []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader") or {}
        if cell.cell_type == "code" and meta.get("grade"):
            for output in cell.get("outputs", []):
                if output.get("output_type") == "error":
                    found.append(f"{meta.get('grade_id')}: {output.get('ename')}: {output.get('evalue')}")
    return found


def forget_ungraded(info: dict):
    """Remove the submission nbgrader recorded for this autograde (student ``info["student"]``) when none of its
    grades has a score: it was made by this run, which graded nothing. A submission with grades keeps them."""
    with Gradebook(info["db_url"]) as gb:
        try:
            submission = gb.find_submission(info["assignment"], info["student"])
        except MissingEntry:
            return
        if all(g.auto_score is None and g.manual_score is None for nb in submission.notebooks for g in nb.grades):
            gb.remove_submission(info["assignment"], info["student"])
