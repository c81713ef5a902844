"""A loaded machine for the kit's own tests: CI machines are busy, and grades must not notice.

``with cpu_hogs(): ...`` runs the block while two processes keep a core busy each (the machine this kit is
developed on has two). Under pytest-xdist with several workers (the README's test command: two), the other
worker runs the kit's other tests meanwhile, which grade classes of their own in several processes: that is
the load then, and no hog is added (one there made the whole suite minutes longer). ATTNKIT_TEST_HOGS sets
how many; a serial run keeps two.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

SIDE_BY_SIDE = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
DEFAULT_HOGS = int(os.environ.get("ATTNKIT_TEST_HOGS", "0" if SIDE_BY_SIDE else "2"))


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
