"""The kit's own tests: the reference passes, the stubs fail, fixtures reproduce, grading holds.

    pytest kit_tests                 # all of them (pytest -n 2 --dist loadfile kit_tests: side by side)
    pytest kit_tests -m "not slow"   # without the runs that grade whole classes or drive nbgrader
    pytest kit_tests/grading/test_catalogue.py -k s05_self_attention   # one stage's catalogue entries alone

They test the grading engine (grader/) and the graded suite (tests/) from outside: through
``attnkit``, nbgrader's own commands, and the suite's adapter.
"""
import os

import pytest

from grader.kit import SOLUTIONS, SUITE
from suite_runtime.adapters import Implementation, LocalBackend
from suite_runtime.stage_names import register_markers


def pytest_configure(config):
    """The stages' markers, as tests/conftest.py registers them, for a run of kit tests alone: the catalogue
    and the GPU tests import the stage test files, whose pytestmark must be known."""
    register_markers(config, SUITE)


@pytest.fixture(scope="session")
def reference():
    """The reference solutions, in this process, through the suite's adapter."""
    return Implementation(LocalBackend(SOLUTIONS))


@pytest.fixture(scope="session")
def unavailable():
    """``unavailable(why)``: a deployment test whose server or browser is missing here skips, saying what to
    install, except in CI: .ci/run installs them and sets ATTNKIT_REQUIRE_SERVERS, so there it fails."""
    def stop(why: str):
        (pytest.fail if os.environ.get("ATTNKIT_REQUIRE_SERVERS") else pytest.skip)(why)
    return stop
