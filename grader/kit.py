"""Access to the kit's own files: the stage list and the tests' adapter module."""
from __future__ import annotations

import importlib.util
import re
import sys
from functools import cache

from . import SOLUTIONS, TESTS

STAGE = re.compile(r"^(s\d\d)_(\w+)\.py$")


def stages() -> list[str]:
    """Stage module names in teaching order (s01_attention_scores, ...), from solutions/."""
    return sorted(p.stem for p in SOLUTIONS.glob("s[0-9][0-9]_*.py"))


def marker(stage: str) -> str:
    """The pytest marker of a stage: its name without the sNN_ prefix."""
    return stage.split("_", 1)[1]


@cache
def adapters():
    """tests/adapters.py, the single door from tests to an implementation."""
    path = TESTS / "adapters.py"
    loaded = sys.modules.get("adapters")
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # already imported by the tests' conftest: share its classes
    spec = importlib.util.spec_from_file_location("adapters", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("adapters", module)
    spec.loader.exec_module(module)
    return module


def reference():
    """The reference solutions, reached through the adapter like any implementation."""
    a = adapters()
    return a.Implementation(a.LocalBackend(SOLUTIONS))
