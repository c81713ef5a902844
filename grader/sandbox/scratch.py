"""Private working folders in TMPDIR that do not outlive the process that made them.

Grading makes folders (a worker's copy of the submission it grades, a sandbox's runtime and
the submissions it hands to its boxes, a grading run's results file). Each is named
``attnkit-<what>-<random>`` and holds a lock file that its owner keeps locked (``flock``) for
as long as it lives. The owner removes the folder when it is done; if it is killed first (a
worker stopped with SIGKILL, ``kill -9`` of a whole run), the kernel still drops the lock, so the
next run can tell a dead process's folder from a live one and remove it: ``sweep()``.
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
LOCK = ".owner.lock"
GRACE_SECONDS = 600  # a folder without its lock file is only removed once it is this old


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
    # The lock file goes last: an owner killed while it removes its folder (a worker stopped in its last moments)
    # leaves a folder whose lock file is still there, unlocked, which sweep() removes; never one without it, which
    # would pass for a folder of an older version and be kept for GRACE_SECONDS.
    with contextlib.suppress(OSError):
        for entry in path.iterdir():
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock)
    except OSError:
        pass


def sweep(root: Path | None = None) -> list[Path]:
    """Remove the folders that dead processes left in TMPDIR (or ``root``); returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = [p for p in root.iterdir()
                   if p.name.startswith((PREFIX, STAGING)) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for folder in entries:
        if folder.name.startswith(STAGING) and not _old(folder):
            continue  # being made: its lock comes next
        if _abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def held(prefix: str, root: Path | None = None) -> bool:
    """Whether a folder named ``prefix...`` in TMPDIR (or ``root``) is still held by a living process."""
    root = Path(root or tempfile.gettempdir())
    try:
        return any(p.name.startswith(prefix) and p.is_dir() and not _abandoned(p) for p in root.iterdir())
    except OSError:
        return False


def _abandoned(folder: Path) -> bool:
    try:
        lock = os.open(folder / LOCK, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:  # made by an older version, or emptied by its owner, which died before removing it
        return _old(folder) or _empty(folder)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # its owner lives
    finally:
        os.close(lock)
    return True


def _empty(folder: Path) -> bool:
    try:
        return not any(folder.iterdir())
    except OSError:
        return False


def _old(folder: Path) -> bool:
    try:
        return time.time() - folder.stat().st_mtime > GRACE_SECONDS
    except OSError:
        return False
