"""A PostgreSQL gradebook, on a real server the test starts on 127.0.0.1 (``servers.py``): a course
built with a plain ``postgresql://`` URL, graded by nbgrader and by ``attnkit grade``; URLs the
gradebook cannot open, refused at ``course build``; and writers that add the same new students at once.
"""
from __future__ import annotations

import csv
import importlib.util
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import servers

from grader.cli import main
from grader.course.build import build
from grader.course.demo import stage_scores
from grader.course.gradebook import CONNECT_SECONDS, GradebookSync
from grader.course.samples import samples, write_submission
from grader.course.settings import Course
from grader.grading import records as R
from grader.kit import assignments
from runs import Nbgrader

ASSIGNMENTS = list(assignments())  # the kit's assignments, in teaching order

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Four students of chapter 3 (its first four samples: the reference, the stubs, two with mistakes), and three late
# ones who each submit every assignment (the i-th of them each assignment's i-th sample) and are new to the
# gradebook when every assignment's attnkit grade runs at once.
PAIRED = list(zip(*(samples(name)[:4] for name in ASSIGNMENTS)))
STUDENTS = [pair[0].student for pair in PAIRED]
LATE = ["late-1", "late-2", "late-3"]


@pytest.fixture(scope="module")
def server(unavailable):
    reason = servers.why_no_postgres()
    if reason:
        unavailable(reason)
    with servers.running_postgres() as running:
        yield running


def submit(root: Path, student: str, pair):
    for sample in pair:
        write_submission(sample, root / "release" / sample.assignment, root / "submitted" / student / sample.assignment)


@pytest.fixture(scope="module")
def course(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("pg") / "course"
    url = server.create_database("course")
    assert url.startswith("postgresql://")  # the plain scheme, no driver named
    build(root, db_url=url)
    for name in ASSIGNMENTS:  # (the scores below are read from the gradebook the course names)
        assert Course.load(root, name).gradebook_url == url
    nbgrader = Nbgrader(root)
    for name in ASSIGNMENTS:
        nbgrader("generate_assignment", name)
    for student, pair in zip(STUDENTS, PAIRED):
        submit(root, student, pair[:1])  # chapter 3's alone
    return dict(root=root, url=url, nbgrader=nbgrader)


def record_scores(root: Path, assignment: str, students) -> dict:
    records = R.read_records(R.results_dir(root, assignment), set(students))
    assert sorted(records) == sorted(students), \
        f"records of {assignment}: expected {sorted(students)}, got {sorted(records)}"
    return {s: {stage["stage"]: stage["points"] for stage in r["stages"]} for s, r in records.items()}


def rows(server, sql: str) -> list[tuple]:
    return server.query("course", sql)


def test_nbgrader_and_attnkit_grade_share_a_postgresql_gradebook(course, server, tmp_path):
    root, nbgrader = course["root"], course["nbgrader"]
    nbgrader("autograde", "attention", "--student", STUDENTS[0])  # nbgrader's own path on PostgreSQL
    by_nbgrader = stage_scores(Course.load(root, "attention"), STUDENTS[:1])

    assert main(["grade", "attention", "--course", str(root), "--notebooks", "--quiet"]) == 0
    recorded = record_scores(root, "attention", STUDENTS)
    assert stage_scores(Course.load(root, "attention"), STUDENTS) == recorded
    assert by_nbgrader == {STUDENTS[0]: recorded[STUDENTS[0]]}, "nbgrader's autograde and attnkit grade differ"
    assert sum(recorded["untouched"].values()) == 0 and sum(recorded["reference"].values()) == 100
    for student in STUDENTS:
        assert (root / "autograded" / student / "attention" / "attention.ipynb").is_file()

    nbgrader("export", "--to", str(tmp_path / "grades.csv"))
    exported = {(row["assignment"], row["student_id"]): float(row["raw_score"])
                for row in csv.DictReader((tmp_path / "grades.csv").open())}
    for student, scores in recorded.items():
        assert exported[("attention", student)] == pytest.approx(sum(scores.values()), abs=1e-6), student
    assert rows(server, "SELECT count(*) FROM submitted_assignment sa JOIN assignment a ON a.id = sa.assignment_id "
                        "WHERE a.name = 'attention'") == [(len(STUDENTS),)]
    assert main(["report", "attention", "--course", str(root)]) == 0  # reads the gradebook too


def test_a_gradebook_server_that_stays_down_stops_attnkit_grade_after_the_connect_timeout(server, tmp_path, capsys):
    root = tmp_path / "course"
    with servers.running_postgres() as short_lived:
        build(root, assignments=["attention"], db_url=short_lived.create_database("gone"))
        Nbgrader(root)("generate_assignment", "attention")
        submit(root, STUDENTS[0], PAIRED[0][:1])
    began = time.monotonic()
    assert main(["grade", "attention", "--course", str(root), "--quiet"]) == 2  # its server has stopped
    waited = time.monotonic() - began
    err = capsys.readouterr().err
    assert "check that its database server runs" in err and "Traceback" not in err, err
    assert servers.PASSWORD not in err, f"the error shows the password:\n{err}"
    # Refused connections are tried again for the connect timeout, not reported at once (a server restart
    # must not end a run); the upper bound only says it was not waited for much longer.
    assert CONNECT_SECONDS <= waited < CONNECT_SECONDS + 30, f"reported after {waited:.1f} s"
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"takes no connection for {CONNECT_SECONDS} s is reported" in readme, \
        "the README gives another time than the gradebook's CONNECT_SECONDS"


def test_two_grade_runs_at_once_add_the_same_new_students_without_a_crash_or_a_second_row(course, server):
    root = course["root"]
    for student, pair in zip(LATE, PAIRED):
        submit(root, student, pair)
    attnkit = Path(sys.executable).parent / "attnkit"
    runs = [subprocess.Popen([attnkit, "grade", name, "--course", root, "--quiet", "--workers", "1"], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in ASSIGNMENTS]
    for name, run in zip(ASSIGNMENTS, runs):
        out, err = run.communicate(timeout=400)
        assert run.returncode == 0 and "Traceback" not in err, \
            f"attnkit grade {name} failed:\n{out[-2000:]}\n{err[-4000:]}"

    everyone = STUDENTS + LATE
    for name in ASSIGNMENTS:
        graded = everyone if name == ASSIGNMENTS[0] else LATE
        assert stage_scores(Course.load(root, name), graded) == record_scores(root, name, graded), name
    assert rows(server, "SELECT count(*), count(DISTINCT id) FROM student") == [(len(everyone), len(everyone))]
    submitted = len(STUDENTS) + len(LATE) * len(ASSIGNMENTS)
    assert rows(server, "SELECT count(*) FROM submitted_assignment") == [(submitted,)]


RACERS = [f"racer-{i:02d}" for i in range(40)]


def race_write(url: str, assignment: str, notebook: str, points: dict, records: list, start) -> None:
    sync = GradebookSync(url, assignment, notebook, points).open()
    try:
        start.wait(60)  # every writer at once: all of them add the same new students
        sync.write(records)
    finally:
        sync.close()


def racer_records(points: dict) -> list[dict]:
    return [{"student": student, "stages": [{"stage": stage, "points": p * (i % 3) / 2} for stage, p in points.items()]}
            for i, student in enumerate(RACERS)]


def test_gradebook_writers_racing_to_add_the_same_new_students_each_keep_one_row(course, server):
    """Two writers per assignment add the same 40 new students at the same moment: each
    insert that loses a race is a unique violation in PostgreSQL, which must be taken as the row
    being there. Two runs of one assignment also race on the same submissions and grades."""
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(2 * len(ASSIGNMENTS))
    expected, writers = {}, []
    for name in ASSIGNMENTS:
        c = Course.load(course["root"], name)
        records = racer_records(dict(c.points))
        expected[name] = {r["student"]: {s["stage"]: s["points"] for s in r["stages"]} for r in records}
        writers += [spawn.Process(target=race_write, args=(course["url"], name, c.notebook, dict(c.points),
                                                            records[::step], start)) for step in (1, -1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(300)
    assert [w.exitcode for w in writers] == [0] * len(writers), "a gradebook writer failed (its traceback is above)"
    for name in ASSIGNMENTS:
        assert stage_scores(Course.load(course["root"], name), RACERS) == expected[name], name
    assert rows(server, "SELECT count(*) FROM student WHERE id LIKE 'racer-%'") == [(len(RACERS),)]
    assert rows(server, "SELECT count(*) FROM submitted_assignment WHERE student_id LIKE 'racer-%'") == \
        [(len(RACERS) * len(ASSIGNMENTS),)]


def test_a_rebuild_keeps_the_course_s_postgresql_gradebook(server, tmp_path):
    url = server.create_database("rebuilt")
    build(tmp_path / "course", db_url=url)
    build(tmp_path / "course", assignments=["modern-attention"])  # without --db-url
    assert Course.load(tmp_path / "course").db_url == url
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(tmp_path / "course")).load_config()
    assert config.CourseDirectory.db_url == url  # (nbgrader's config reads it from the course's settings)
    assert (tmp_path / "course" / "attnkit-course.json").stat().st_mode & 0o777 == 0o600  # it holds the password
    assert servers.PASSWORD not in (tmp_path / "course" / "nbgrader_config.py").read_text()


REFUSED = ["no such database", "wrong password", "driver not installed", "not a URL", "password not encoded",
           "user may not create tables"]


@pytest.mark.parametrize("case", REFUSED)
def test_course_build_refuses_a_gradebook_it_cannot_use_and_names_the_fix(case, server, tmp_path, capsys):
    url, fix = {
        "no such database": (server.url("no_such_db"), "the database exists (PostgreSQL: createdb NAME)"),
        "wrong password": (server.url("course").replace(servers.PASSWORD, "not-the-password"),
                           "takes this user and password"),
        "driver not installed": (server.url("course", scheme="postgresql+pg8000"), "pg8000"),
        "not a URL": (server.url("course", scheme="postgres"), "postgresql://user:password@host/database"),
        "password not encoded": (server.url("course").replace(servers.PASSWORD, "not-the@pass:w/rd"),
                                 "percent-encoded: urllib.parse.quote(password, safe='')"),
        "user may not create tables": (None, 'GRANT CREATE ON SCHEMA public TO "limited"'),
    }[case]
    if case == "driver not installed" and importlib.util.find_spec("pg8000"):
        pytest.skip("pg8000 is installed here")
    if case == "user may not create tables":  # PostgreSQL 15 on: only a database's owner may, by default
        server.create_database("not_theirs")
        server.query("postgres", "CREATE ROLE limited LOGIN PASSWORD 'not-the-password'")
        url = server.url("not_theirs").replace(f"{servers.USER}:{servers.PASSWORD}", "limited:not-the-password")
    root = tmp_path / "course"
    assert main(["course", "build", str(root), "--db-url", url]) == 2
    err = capsys.readouterr().err
    assert fix in err, f"{case}: the error does not name the fix {fix!r}:\n{err}"
    for secret in ("not-the-password", "not-the@pass", "pass:w", servers.PASSWORD):
        assert secret not in err, f"the error shows the password:\n{err}"
    assert not root.exists(), "a refused build left a course behind"


def test_a_course_not_yet_generated_gets_a_message_without_the_password(server, tmp_path, capsys):
    root = tmp_path / "course"
    build(root, assignments=["attention"], db_url=server.create_database("not_generated"))
    write_submission(PAIRED[0][0], root / "source" / "attention", root / "submitted" / STUDENTS[0] / "attention")
    assert main(["grade", "attention", "--course", str(root), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "nbgrader generate_assignment attention" in err and servers.PASSWORD not in err, err


def opened(course) -> tuple[Course, GradebookSync]:
    c = Course.load(course["root"], "attention")
    sync = GradebookSync(course["url"], "attention", c.notebook, dict(c.points), c.course_id).open()
    sync.check()
    return c, sync


def one_record(c: Course, student: str, scale: float = 1.0) -> list[dict]:
    return [{"student": student, "stages": [{"stage": s, "points": p * scale} for s, p in c.points.items()]}]


def test_a_write_after_the_server_dropped_the_connection_goes_through(course, server):
    """A server that ends a session (pg_terminate_backend): the next write opens a new connection."""
    c, sync = opened(course)
    try:
        records = one_record(c, "dropped")
        sync.write(records)  # the connection is open now
        dropped = server.query("postgres", "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                           "WHERE datname = 'course' AND pid <> pg_backend_pid()")
        assert dropped[0][0] >= 1, "no session of the gradebook was open to drop"
        records[0]["stages"][0]["points"] = 0
        sync.write(records)
    finally:
        sync.close()
    assert stage_scores(c, ["dropped"]) == \
        {"dropped": {s["stage"]: s["points"] for s in records[0]["stages"]}}


def test_writes_go_through_a_pg_ctl_restart_of_the_server(course, server):
    """``pg_ctl restart`` (fast: every session ends, the server is down a moment, then starts again) while
    the gradebook is written as ``attnkit grade`` writes it, again and again: every write goes through,
    also those that find the server down or starting (tried again with growing pauses)."""
    c, sync = opened(course)
    restart = threading.Thread(target=server.pg_ctl, args=("restart",))
    writes = 0
    try:
        sync.write(one_record(c, "restarted"))
        restart.start()
        while restart.is_alive():  # (each write changes every score, so each one commits)
            writes += 1
            sync.write(one_record(c, "restarted", scale=(writes % 2) / 2))
        sync.write(one_record(c, "restarted", scale=0.25))
    finally:
        restart.join()
        sync.close()
    assert writes >= 1, "the restart was over before the writes began"
    assert stage_scores(c, ["restarted"]) == {"restarted": {s: p * 0.25 for s, p in c.points.items()}}


def test_a_write_while_the_server_is_down_waits_for_it_to_come_back(course, server):
    c, sync = opened(course)
    try:
        server.pg_ctl("stop")
        start = threading.Timer(1.0, server.pg_ctl, args=("start",))
        start.start()
        began = time.monotonic()
        sync.write(one_record(c, "waited"))  # refused at first
        waited = time.monotonic() - began
    finally:
        sync.close()
        start.join()  # (the server is up again for the other tests)
    assert waited >= 1.0, f"the write went through in {waited:.2f} s while the server was down"
    assert stage_scores(c, ["waited"]) == {"waited": dict(c.points)}

