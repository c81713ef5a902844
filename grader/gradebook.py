"""attnkit grade's scores in nbgrader's gradebook, through nbgrader's own API."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path


class GradebookError(RuntimeError):
    """The gradebook cannot take this course's grades (printed as a plain error by the CLI)."""


class GradebookSync:
    """Writes attnkit's per-stage scores into nbgrader's gradebook, through nbgrader's own API:
    each stage's score becomes the auto score of its grade cell (``grade_<stage>``) in the
    course notebook, so that the formgrader and ``nbgrader export`` show it."""

    def __init__(self, db_url: str, assignment: str, notebook: str, points: dict[str, float]):
        self.db_url, self.assignment, self.notebook, self.points = db_url, assignment, notebook, points

    def _missing(self) -> GradebookError:
        return GradebookError(
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
                raise GradebookError(f"the gradebook's assignment {self.assignment!r} "
                                     f"has no notebook {self.notebook!r}: "
                                     f"run `nbgrader generate_assignment --force {self.assignment}`")
            cells = {cell.name: cell.max_score for cell in notebooks[self.notebook].grade_cells}
            missing = [s for s in self.points if f"grade_{s}" not in cells]
            if missing:
                raise GradebookError(f"the gradebook has no grade cell for {', '.join(missing)}: "
                                     f"the course was rebuilt after generate_assignment; "
                                     f"run `nbgrader generate_assignment --force {self.assignment}`")
            differ = [s for s, p in self.points.items() if abs(cells[f"grade_{s}"] - p) > 1e-9]
            if differ:
                raise GradebookError(f"points in the gradebook differ from the course's for {', '.join(differ)}: "
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
                    with warnings.catch_warnings():
                        # nbgrader's add_submission links each new row before the session holds it, and
                        # SQLAlchemy 2's autoflush warns "... not in session, add operation ... will not
                        # proceed" (several lines per new student, on the instructor's terminal). The rows
                        # are all added by add_submission itself: the find below reads them back.
                        warnings.filterwarnings("ignore", message=r".* not in session, add operation along ")
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


