"""Work that several test files read, done once per test run however pytest-xdist spreads the files over its
workers: in a folder of the run's own temporary folder (the one every worker's folder is in), made under a file
lock by the first worker that needs it; a worker that needs it meanwhile waits, then reads what was made.

What it makes is said in a JSON file written last, so a folder whose making failed midway is made again from
scratch by the next one to ask (and fails again, with its own error, where the failure is real).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

DONE = "made.json"


def run_folder(tmp_path_factory) -> Path:
    """The run's temporary folder that every worker's own folder is in (under xdist: their parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def once(tmp_path_factory, name: str, make: Callable[[Path], dict]) -> dict:
    """``make(folder)``'s result (a JSON-able dict), made once in this test run in the folder ``name``."""
    top = run_folder(tmp_path_factory)
    folder, done = top / name, top / name / DONE
    with locked(top / f"{name}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            made = make(folder)
            done.write_text(json.dumps(made))
        return json.loads(done.read_text())
