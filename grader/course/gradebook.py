"""attnkit grade's scores in nbgrader's gradebook, through nbgrader's own API, and the check of a gradebook
URL that `attnkit course build --db-url` makes (SQLite by default; PostgreSQL through the postgres extra)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import sys
import time
import warnings
from pathlib import Path

from ..errors import GradebookError, ReportError
from ..grading.records import results_dir
from ..outputs.report import ClassReport, build_report

# The fix for a gradebook URL whose Python driver is missing, by the module SQLAlchemy could not import. The kit is
# no package on PyPI: its extras install from its folder only (pip install -e '.[postgres]'), so the hint names the
# driver's own package first.
DRIVER_FIX = {
    "psycopg": "pip install 'psycopg[binary]' (or, in the kit's folder, pip install -e '.[postgres]')",
    "psycopg2": "write the URL as postgresql+psycopg://... and pip install 'psycopg[binary]' "
                "(or pip install psycopg2-binary)",
}
CONNECT_SECONDS = 10  # a database server that does not answer by then is reported, not waited for
FIRST_PAUSE, LONGEST_PAUSE = 0.1, 2.0  # between tries to reach it again (doubling)


def shown(db_url: str) -> str:
    """The URL as messages show it: its password hidden, also in a URL that does not parse."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(db_url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"^([\w+.-]+://[^:/@]*):.*@", r"\1:***@", db_url)


def has_password(db_url: str | None) -> bool:
    from sqlalchemy.engine import make_url

    return bool(db_url) and make_url(db_url).password is not None


def connectable(db_url: str) -> str:
    """The URL the kit connects with: a PostgreSQL server that does not answer fails the connection
    after CONNECT_SECONDS (libpq's connect_timeout, unless the URL sets its own) instead of hanging."""
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    if url.get_backend_name() != "postgresql" or "connect_timeout" in url.query:
        return db_url
    return url.update_query_dict({"connect_timeout": str(CONNECT_SECONDS)}).render_as_string(hide_password=False)


def sqlstate(exc) -> str | None:
    """The SQLSTATE code of a database error (psycopg 3 and psycopg2 name it differently), if any."""
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def unreadable(exc, assignment: str) -> str:
    """What to do when nbgrader's gradebook cannot be read: an SQLite file that is no database (damaged,
    or a wrong --db-url), or a database server that does not answer or refuses the course's URL."""
    reason = str(getattr(exc, "orig", None) or exc).strip()
    if sqlstate(exc) == "42501":  # insufficient privilege
        return (f"the gradebook's database user lacks a privilege ({reason}): use the URL of the user who "
                "created nbgrader's tables (generate_assignment), or have the database's owner grant it: "
                "GRANT ALL ON ALL TABLES IN SCHEMA public TO that_user; GRANT ALL ON ALL SEQUENCES IN SCHEMA "
                "public TO that_user;")
    if type(getattr(exc, "orig", None)).__module__.split(".")[0] not in ("sqlite3", "builtins"):
        return (f"the course's gradebook cannot be read ({reason}): check that its database server runs and "
                "takes the URL in the course's nbgrader_config.py; the records in attnkit-grades/ stand, and "
                "`attnkit grade` brings the gradebook in line with them once it can")
    return (f"the course's gradebook cannot be read ({reason}): restore it, or move it "
            f"aside and run `nbgrader generate_assignment {assignment}` in the course folder for a new one "
            "(`attnkit grade` then fills it from the records in attnkit-grades/)")


@contextlib.contextmanager
def reading(assignment: str):
    """A gradebook that cannot be read or written (SQLAlchemy's errors, after ``reconnecting``'s tries) as a
    GradebookError that says what to do."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except SQLAlchemyError as exc:
        raise GradebookError(unreadable(exc, assignment)) from None


def check_database(db_url: str):
    """Refuse, saying what to do, a gradebook URL nbgrader could not use: no URL SQLAlchemy knows, no
    driver installed for it, no database answering, or (PostgreSQL) a user who may not create the
    tables nbgrader makes at generate_assignment. An SQLite file need not exist yet (nbgrader
    creates it), only its folder."""
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError

    example = "for example postgresql://user:password@host/database or sqlite:////path/to/gradebook.db"
    try:
        url = make_url(db_url)
    except (ArgumentError, ValueError):  # (their text may quote a piece of the password)
        raise GradebookError(f"{shown(db_url)} is not a database URL; {example}. A password with @ : / or # "
                             "in it is written percent-encoded: urllib.parse.quote(password, safe='')") from None
    where = shown(db_url)
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError:
        raise GradebookError(f"SQLAlchemy knows no database {url.drivername!r} ({where}); {example}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        fix = DRIVER_FIX.get(exc.name, f"pip install the package that provides {exc.name!r}")
        raise GradebookError(f"the gradebook {where} needs the Python driver {exc.name!r}, which is not "
                             f"installed: {fix}") from None
    if url.get_backend_name() == "sqlite":
        folder = Path(url.database or ".").expanduser().resolve().parent
        if url.database and not folder.is_dir():
            raise GradebookError(f"the gradebook {where} is in a folder that does not exist: create {folder}")
        return
    engine = create_engine(connectable(db_url))
    try:
        with engine.connect() as conn:
            may_create = (url.get_backend_name() != "postgresql" or inspect(conn).has_table("assignment")
                          or conn.execute(text("SELECT has_schema_privilege(current_schema(), 'CREATE')")).scalar())
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise GradebookError(f"cannot open the gradebook {where} ({reason}): check that its server runs and "
                             "takes this user and password, and that the database exists "
                             "(PostgreSQL: createdb NAME)") from None
    finally:
        engine.dispose()
    if not may_create:
        raise GradebookError(f"the user {url.username!r} may not create tables in the gradebook {where}, and nbgrader "
                             "makes its tables there at generate_assignment: as the database's owner, run "
                             f'GRANT CREATE ON SCHEMA public TO "{url.username}"; (or make that user the owner: '
                             f'ALTER DATABASE "{url.database}" OWNER TO "{url.username}";)')


def lost_connection(exc) -> bool:
    """Whether a database error is a connection that was lost (the server restarted, or ended the session)
    or could not be made (refused, not started yet, shutting down), rather than an error in what was asked."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    # SQLAlchemy marks a connection it lost as invalidated, and wraps a failure to connect with no statement.
    return isinstance(exc, DBAPIError) and (exc.connection_invalidated
                                            or (isinstance(exc, OperationalError) and exc.statement is None))


def reconnecting(attempt, before_again=None):
    """``attempt()``, tried again while the gradebook's server cannot be reached, with pauses that double
    from FIRST_PAUSE to LONGEST_PAUSE, until CONNECT_SECONDS after the first failure: a server restart
    costs a pause, a server that stays away is reported (its last error raised). ``before_again()`` runs
    before each new try (a rollback of what the lost connection left)."""
    deadline, pause = None, FIRST_PAUSE
    while True:
        try:
            return attempt()
        except Exception as exc:
            if not lost_connection(exc):
                raise
            now = time.monotonic()
            deadline = deadline or now + CONNECT_SECONDS
            if now >= deadline:
                raise
            time.sleep(min(pause, deadline - now))  # (the last try comes at the deadline)
            pause = min(2 * pause, LONGEST_PAUSE)
            if before_again is not None:
                before_again()


class GradebookSync:
    """Writes attnkit's per-stage scores into nbgrader's gradebook, through nbgrader's own API:
    each stage's score becomes the auto score of its grade cell (``grade_<stage>``) in the
    course notebook, so that the formgrader and ``nbgrader export`` show it."""

    def __init__(self, db_url: str, assignment: str, notebook: str, points: dict[str, float],
                 course_id: str = "default_course", course_root: Path | None = None):
        self.db_url, self.assignment, self.notebook, self.points = db_url, assignment, notebook, points
        self.course_id = course_id  # (nbgrader adds a course row of this name if there is none)
        self.course_root = course_root  # where nbgrader's commands that fix it must run

    def _generate(self, force: bool = False) -> str:
        """The command that puts the assignment into the gradebook, run in the course's folder."""
        command = f"nbgrader generate_assignment {'--force ' * force}{self.assignment}"
        if self.course_root is None:
            return f"run `{command}` in the course folder"
        return f"run `cd {shlex.quote(str(self.course_root))} && {command}`"

    def _missing(self) -> GradebookError:
        return GradebookError(f"assignment {self.assignment!r} is not in the gradebook ({shown(self.db_url)}): "
                              f"{self._generate()} first")

    def check(self):
        """Fail early, and clearly, if the assignment or its grade cells are not in the gradebook (or its
        server cannot be reached for CONNECT_SECONDS)."""
        if self.db_url.startswith("sqlite:///") and not Path(self.db_url[len("sqlite:///"):]).is_file():
            raise self._missing()  # (opening it would create an empty gradebook)
        # nbgrader runs `alembic` when it opens a gradebook: find it next to this Python.
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        with reading(self.assignment):
            reconnecting(self._check)

    def _check(self):
        from nbgrader.api import Gradebook, MissingEntry

        with Gradebook(connectable(self.db_url), self.course_id) as gb:
            try:
                assignment = gb.find_assignment(self.assignment)
            except MissingEntry:
                raise self._missing() from None
            notebooks = {nb.name: nb for nb in assignment.notebooks}
            if self.notebook not in notebooks:
                raise GradebookError(f"the gradebook's assignment {self.assignment!r} "
                                     f"has no notebook {self.notebook!r}: {self._generate(force=True)}")
            cells = {cell.name: cell.max_score for cell in notebooks[self.notebook].grade_cells}
            missing = [s for s in self.points if f"grade_{s}" not in cells]
            if missing:
                raise GradebookError(f"the gradebook has no grade cell for {', '.join(missing)}: "
                                     f"the course was rebuilt after generate_assignment; {self._generate(force=True)}")
            differ = [s for s, p in self.points.items() if abs(cells[f"grade_{s}"] - p) > 1e-9]
            if differ:
                raise GradebookError(f"points in the gradebook differ from the course's for {', '.join(differ)}: "
                                     f"{self._generate(force=True)}")

    def open(self):
        from nbgrader.api import Gradebook

        with reading(self.assignment):
            self.gb = reconnecting(lambda: Gradebook(connectable(self.db_url), self.course_id))
        return self

    def close(self):
        if getattr(self, "gb", None) is not None:
            self.gb.close()
            self.gb = None

    def state(self) -> list | None:
        """What changes whenever anything writes the gradebook: a SQLite file's size and time of change (None for
        a server's gradebook, whose changes cannot be seen from here)."""
        if not self.db_url.startswith("sqlite:///"):
            return None
        try:
            stat = os.stat(self.db_url[len("sqlite:///"):])
        except OSError:
            return None
        return [stat.st_size, stat.st_mtime_ns]

    def write(self, records: list[dict], timestamps: dict[str, str] | None = None, progress=None) -> int:
        """Bring the gradebook in line with ``records``; returns how many grades changed.

        Another ``attnkit grade`` may write the same gradebook at the same time (another assignment,
        other students): a student or submission it adds between our look-up and our insert is a
        unique violation in PostgreSQL, which is taken as the row being there, never a second row.
        A connection the server dropped or refused (a restart) is tried again (``reconnecting``): the
        write brings the gradebook in line with the records, so writing it again from the start is safe."""
        from sqlalchemy.exc import DBAPIError

        def again():
            with contextlib.suppress(DBAPIError):
                self.gb.db.rollback()  # (SQLAlchemy opens a new connection next)
            if progress is not None:
                progress.reset()

        with reading(self.assignment):
            return reconnecting(lambda: self._write(records, timestamps or {}, progress), again)

    def _write(self, records: list[dict], timestamps: dict[str, str], progress) -> int:
        from nbgrader.api import MissingEntry

        # Every run takes the rows in the same order (by student), so two runs lock them in one order:
        # one may wait for the other, never both for each other (no deadlock).
        records = sorted(records, key=lambda record: record["student"])
        gb = self.gb
        submitted = {submission.student_id for submission in gb.find_assignment(self.assignment).submissions}
        for record in records:  # new students' rows first, each committed by nbgrader as it adds it
            student = record["student"]
            if student not in submitted:
                extra = {"timestamp": timestamps[student]} if timestamps.get(student) else {}
                _added(gb.add_student, gb.find_student, student)
                _added(gb.add_submission, gb.find_submission, self.assignment, student, **extra)
        changed = 0
        try:  # then every score in one transaction
            for record in records:
                try:  # one query for the notebook and its grades (not one per grade cell)
                    notebook = gb.find_submission_notebook(self.notebook, self.assignment, record["student"])
                except MissingEntry:
                    raise GradebookError(f"{record['student']}'s submission of {self.assignment} left the "
                                         "gradebook while attnkit wrote it; run `attnkit grade` again") from None
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


def _added(add, find, *key, **extra):
    """``find(*key)``'s row, added by ``add(*key, **extra)`` when missing. When another process adds it between the two,
    nbgrader's add fails on the unique key and rolls back: the row is then theirs, found again."""
    from nbgrader.api import InvalidEntry, MissingEntry

    try:
        return find(*key)
    except MissingEntry:
        pass
    try:
        with _quiet_rollbacks(), warnings.catch_warnings():
            # nbgrader's add_submission links each new row before the session holds it, and SQLAlchemy 2's
            # autoflush warns "... not in session, add operation ... will not proceed" (several lines per
            # new student, on the instructor's terminal). add_submission adds them all itself.
            warnings.filterwarnings("ignore", message=r".* not in session, add operation along ")
            return add(*key, **extra)
    except InvalidEntry as exc:
        if lost_connection(exc.__context__):  # (nbgrader turns every database error of an add into InvalidEntry)
            raise exc.__context__ from None
        try:
            return find(*key)
        except MissingEntry:
            raise GradebookError(f"the gradebook refused a new row for {key}: {exc}") from None


@contextlib.contextmanager
def _quiet_rollbacks():
    """nbgrader logs every failed add with its traceback ("Rolling back session due to database error")
    to tornado's application log before it raises InvalidEntry; ``_added`` handles that error, so
    its traceback is no news."""
    app_log = logging.getLogger("tornado.application")  # tornado.log.app_log, which nbgrader.api logs to

    def drop(record):
        return not record.getMessage().startswith("Rolling back session due to database error")

    app_log.addFilter(drop)
    try:
        yield
    finally:
        app_log.removeFilter(drop)


# ---------------------------------------------------------------- the class report

def stage_grades(db_url: str, course_id: str, assignment: str) -> dict:
    """{student: {stage: (score, max_score)}} from nbgrader's gradebook, for the autograded cells
    named ``grade_<stage>`` of the assignment's notebooks."""
    from nbgrader.api import Gradebook, MissingEntry

    from ..course.gradebook import connectable

    scores = {}
    with reading(assignment), Gradebook(connectable(db_url), course_id) as gb:
        try:
            gb.find_assignment(assignment)
        except MissingEntry:
            held = sorted(a.name for a in gb.assignments)
            raise GradebookError(
                f"the gradebook has no assignment {assignment!r}"
                + (f"; its assignments: {', '.join(held)} (e.g. `attnkit report {shlex.quote(held[0])}`)" if held
                   else " (nor any other)")
                + f". To report on {assignment}: `nbgrader generate_assignment {shlex.quote(assignment)}` in the "
                "course folder, then grade it (`attnkit grade`)") from None
        for submission in gb.assignment_submissions(assignment):
            row = scores.setdefault(submission.student_id, {})
            for notebook in submission.notebooks:
                for grade in notebook.grades:
                    stage = grade.name.removeprefix("grade_")
                    row[stage] = (grade.score, grade.max_score)
    return scores


def class_report(course, assignment: str | None = None, out=None) -> tuple[Path, ClassReport]:
    """The class report of ``course``'s assignment (a grader.course.settings.Course; default: the one it describes):
    its records in attnkit-grades/, with the points nbgrader's gradebook holds. Returns (index.html, the report)."""
    assignment = assignment or course.assignment
    if not course.db_url and not (course.root / "gradebook.db").is_file():
        raise ReportError(f"no gradebook in {course.root}: grade the class first (`attnkit grade`)")
    gradebook = stage_grades(course.gradebook_url, course.course_id, assignment)
    return build_report(results_dir(course.root, assignment), assignment, out, gradebook, "the nbgrader gradebook")
