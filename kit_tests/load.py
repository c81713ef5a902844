"""A loaded machine for the kit's own tests: CI machines are busy, and grades must not notice.

``with cpu_hogs(): ...`` runs the block while two processes keep a core busy each (the machine this kit is
developed on has two). Under pytest-xdist with several workers (the README's test command), the other workers'
tests load the machine too: one hog then, so that a loaded machine does not become a crawling one. Set
ATTNKIT_TEST_HOGS to change how many (0: none).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

SIDE_BY_SIDE = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
DEFAULT_HOGS = int(os.environ.get("ATTNKIT_TEST_HOGS", "1" if SIDE_BY_SIDE else "2"))


@contextlib.contextmanager
def cpu_hogs(count: int = DEFAULT_HOGS):
    """``count`` CPU-bound processes for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
