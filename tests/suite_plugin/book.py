"""Book tests: the book's printed numbers from its seeds and creation order (no points)."""
from __future__ import annotations

import pytest

from suite_runtime.stage_names import stage_of

# ---------------------------------------------------------------- book tests
#
# A `book` test (no points) builds a module right after torch.manual_seed and expects the book's
# printed numbers. They come out only if the module computes right AND creates its weights in the
# book's order; the test's hint speaks of the order, which is the cause only when the stage's other
# tests (they give the weights by name) pass. So those run first, and a book test that gets other
# numbers while some of them failed says to fix those first. (Grading runs without book tests.)

FAILED_CHECKS = pytest.StashKey[dict]()  # stage (sNN_topic) -> names of its failed non-book checks in this run


def failed_checks(config) -> dict:
    return config.stash.setdefault(FAILED_CHECKS, {})


def _is_book(item) -> bool:
    return item.get_closest_marker("book") is not None


def pytest_collection_modifyitems(items):
    """Each stage's book tests run after its other tests (the order is otherwise kept)."""
    first = {}  # stage -> index of its first test
    for index, item in enumerate(items):
        first.setdefault(stage_of(item.nodeid), index)

    def place(numbered):
        index, item = numbered
        stage = stage_of(item.nodeid)
        return (first[stage] if stage else index, _is_book(item))

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]


def note_book_failure(item, call, report) -> bool:
    """Called for every failed report not explained by the time limit: remember a stage's failed
    non-book checks, and when a book test gets other numbers after some of them failed, say so in
    place of its message (its hint would send the student the wrong way). True when done here."""
    stage = stage_of(item.nodeid)
    if stage is None:
        return False
    failed = failed_checks(item.config).setdefault(stage, [])
    if not _is_book(item):
        failed.append(item.name)
        return False
    if not failed or call.when != "call" or not call.excinfo.errisinstance(AssertionError):
        return False  # an error (a stub, a crash) speaks for itself; after passing checks the hint holds
    numbers = str(call.excinfo.value).splitlines()[0]
    others = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    report.longrepr = (
        f"{stage}: not the book's numbers: {numbers}\n"
        f"Fix this stage's other failures first ({others}). This check (no points) builds the module after "
        "torch.manual_seed and expects the book's printed numbers: that needs a module that computes right "
        "with given weights, and only then does the order in which it creates its weights matter."
    )
    return True
