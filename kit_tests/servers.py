"""Servers the kit's deployment tests start on the loopback interface: a free port for any of them, and a
throwaway PostgreSQL server from the server binaries of Debian's ``postgresql`` package (or any
``initdb``, ``pg_ctl`` and ``postgres`` found as below), started and restarted with ``pg_ctl``.

Why not pytest-postgresql: it runs the server as the current user, and PostgreSQL refuses to run as
root, which CI and containers often are. Here, under root, the server runs as ``nobody``.
"""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

USER, PASSWORD = "attnkit", "gradebook-test"  # a password, as a real server wants one
READY_SECONDS = 30  # pg_ctl's wait for a start or stop


def postgres_binaries() -> Path | None:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``: $ATTNKIT_PG_BIN, then PATH, then Debian's place."""
    candidates = [os.environ.get("ATTNKIT_PG_BIN", "")]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    for folder in filter(None, candidates):
        if all(os.access(Path(folder) / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return Path(folder)
    return None


def why_no_postgres() -> str | None:
    """Why no test server can start here (for pytest.skip), or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no PostgreSQL driver: pip install -e '.[postgres]'"
    if postgres_binaries() is None:
        return ("no PostgreSQL server binaries (initdb, pg_ctl, postgres): install Debian's postgresql package "
                "(apt-get install postgresql) or set ATTNKIT_PG_BIN to their folder")
    return None


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    port: int
    data: Path | None = None  # its data folder, for pg_ctl
    as_user: dict | None = None  # subprocess arguments that run pg_ctl as the server's owner

    def options(self) -> str:
        """The server's own options: loopback only and no Unix socket (unix_socket_directories empty);
        fsync off, as a test's data is thrown away anyway."""
        return f"-h 127.0.0.1 -p {self.port} -k '' -c fsync=off"

    def url(self, database: str, scheme: str = "postgresql") -> str:
        return f"{scheme}://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def query(self, database: str, sql: str) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url(database)) as conn:
            cursor = conn.execute(sql)
            return cursor.fetchall() if cursor.description else []  # (a command returns no rows)

    def pg_ctl(self, action: str, *options: str):
        """``pg_ctl ACTION`` on this server, waiting until it is done (``restart``: stop, then start again;
        ``stop`` and ``restart`` in "fast" mode, which ends every session at once)."""
        mode = {"start": ["-o", self.options()], "stop": ["-m", "fast"], "restart": ["-m", "fast"]}.get(action, [])
        subprocess.run([postgres_binaries() / "pg_ctl", action, "-D", self.data, "-l", self.data.parent / "log",
                        "-w", "-t", str(READY_SECONDS), *mode, *options],
                       check=True, capture_output=True, cwd=self.data.parent, **(self.as_user or {}))


@contextlib.contextmanager
def running_postgres():
    """Start a server in a new temporary folder (with pg_ctl, as an administrator would), yield it, then
    stop it and remove the folder."""
    binaries = postgres_binaries()
    as_user = {}
    folder = Path(tempfile.mkdtemp(prefix="kit-tests-pg-"))
    if os.geteuid() == 0:  # "initdb: cannot be run as root"
        nobody = pwd.getpwnam("nobody")
        as_user = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    server = Server(free_port(), folder / "data", as_user)
    started = False
    try:
        (folder / "pw").write_text(PASSWORD)
        if as_user:
            os.chown(folder / "pw", as_user["user"], as_user["group"])
        subprocess.run([binaries / "initdb", "-D", server.data, "-U", USER, "--pwfile", folder / "pw",
                        "--auth", "scram-sha-256", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, **as_user)
        try:
            server.pg_ctl("start")
        except subprocess.CalledProcessError:
            log = folder / "log"
            raise RuntimeError(f"the test's PostgreSQL server did not start:\n"
                               f"{log.read_text()[-2000:] if log.exists() else ''}") from None
        started = True
        yield server
    finally:
        if started:
            with contextlib.suppress(subprocess.CalledProcessError):
                server.pg_ctl("stop")
        pid_file = server.data / "postmaster.pid"  # still there: pg_ctl could not stop it
        if pid_file.exists():
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
