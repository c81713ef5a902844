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
    replace what the kernel imports."""

    def preprocess(self, nb, resources, *args, **kwargs):
        with setenv(PYTHONSAFEPATH="1"):
            return super().preprocess(nb, resources, *args, **kwargs)
