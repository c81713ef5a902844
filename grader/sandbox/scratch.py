"""Private working folders in TMPDIR that do not outlive the process that made them.

Grading makes folders (a worker's copy of the submission it grades, a sandbox's runtime and
the submissions it hands to its boxes, a grading run's results file). Each is named
``attnkit-<what>-<random>`` and holds a lock file that its owner keeps locked (``flock``) for
as long as it lives. The owner removes the folder when it is done; if it is killed first (a
worker stopped with SIGKILL, ``kill -9`` of a whole run), the kernel still drops the lock, so the
next run can tell a dead process's folder from a live one and remove it: ``sweep()``.

A folder is the kit's only by its lock file: whatever else is named ``attnkit-...`` in TMPDIR (a test's database
server, a benchmark's course, another tool's) is never touched, however old. Removal renames a folder first (to a
name only removal uses), so that one whose owner was killed while removing it is still known for the kit's.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

PREFIX = "attnkit-"
STAGING = ".new-attnkit-"  # a folder's name until its lock is held
REMOVING = ".old-attnkit-"  # a folder's name once its owner removes it
LOCK = ".owner.lock"
GRACE_SECONDS = 600  # a folder left in staging (its maker killed before it locked it) is removed once this old


class Folder:
    """``TMPDIR/attnkit-<what>-<random>``, locked while this object lives; ``remove()`` (or the
    interpreter's exit) deletes it."""

    def __init__(self, what: str):
        # Made under a name sweep() passes over, locked, then renamed (atomically): a sweep never
        # sees the folder before its lock is held.
        while True:
            staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{what}-"))
            self._lock = os.open(staging / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = staging.with_name(staging.name[len(STAGING) - len(PREFIX):])
            try:
                os.rename(staging, self.path)  # fails on an existing folder (they all hold a lock file)
                break
            except OSError:
                _remove(staging, self._lock)
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock)

    def remove(self):
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _remove(path: Path, lock: int):
    # Renamed first, then emptied: killed at any point after the rename, its owner leaves a folder whose name says
    # it was being removed, which sweep() finishes; killed before it, the folder still holds its lock file.
    doomed = path.with_name(REMOVING + path.name[len(PREFIX):])
    with contextlib.suppress(OSError):
        os.rename(path, doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(lock)


def sweep(root: Path | None = None) -> list[Path]:
    """Remove the folders that dead processes left in TMPDIR (or ``root``); returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = [p for p in root.iterdir()
                   if p.name.startswith((PREFIX, STAGING, REMOVING)) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for folder in entries:
        if folder.name.startswith(STAGING):
            abandoned = _old(folder)  # being made: its lock comes next, unless its maker died first
        elif folder.name.startswith(REMOVING):
            abandoned = True  # its owner was removing it (if it still is, both removals end in the same place)
        else:
            abandoned = _owner_lives(folder) is False
        if abandoned:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def held(prefix: str, root: Path | None = None) -> bool:
    """Whether a folder named ``prefix...`` in TMPDIR (or ``root``) is still held by a living process."""
    root = Path(root or tempfile.gettempdir())
    try:
        return any(p.name.startswith(prefix) and p.is_dir() and _owner_lives(p) for p in root.iterdir())
    except OSError:
        return False


def _owner_lives(folder: Path) -> bool | None:
    """Whether the process that made ``folder`` still holds its lock; None for a folder without a lock file (not
    the kit's: the kit's hold one from before they get their name)."""
    try:
        lock = os.open(folder / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        return True
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(lock)
    return False


def _old(folder: Path) -> bool:
    try:
        return time.time() - folder.stat().st_mtime > GRACE_SECONDS
    except OSError:
        return False
