"""pytest wiring of the graded suite: which implementation the tests reach, fixtures, devices, failure
reports, the stage summary.

    pytest                      # the stage modules (sNN_topic.py) of the folder the ini option impl names
    pytest --impl=PATH          # the stage modules of folder PATH
    pytest -m causal_attention  # one stage (suite_runtime.stage_names.stage_command)

The ini option impl names this folder in a student's copy (pytest.ini), the reference solutions in
the kit (pyproject.toml).

The tests reach the implementation only through the ``impl`` fixture (``suite_runtime.adapters.Implementation``).
It runs the stage modules in this process, unless a plugin answers ``pytest_attnkit_backend``
with a backend of its own: the grader's plugin (``grader.grading.plugin``) runs them in its sandbox.

Each concern is a module of the package ``suite_plugin``; this file names the hooks and fixtures each
contributes, so that pytest finds them here and applies them to this folder's tests only.
"""
from suite_plugin.book import pytest_collection_modifyitems
from suite_plugin.devices import device, pytest_itemcollected, target
from suite_plugin.implementation import impl, pytest_addhooks, pytest_configure, reference, stage
from suite_plugin.inputs import hidden_fx, public_fx, rng
from suite_plugin.reports import pytest_runtest_makereport, pytest_runtest_teardown
from suite_plugin.selection import pytest_ignore_collect
from suite_plugin.summary import pytest_terminal_summary
from suite_plugin.time_limits import pytest_runtest_call, pytest_runtest_setup

__all__ = [
    "device", "hidden_fx", "impl", "public_fx", "pytest_addhooks", "pytest_collection_modifyitems", "pytest_configure",
    "pytest_ignore_collect", "pytest_itemcollected", "pytest_runtest_call", "pytest_runtest_makereport",
    "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_terminal_summary", "reference", "rng", "stage",
    "target",
]
