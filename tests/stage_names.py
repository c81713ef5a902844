"""What stages are called: one definition for the suite, the grader (``attnkit``) and the kit's tests.

A stage is a module named ``sNN_topic`` (``s08_causal_attention``) in a folder of stage modules
(``solutions/``, ``exercises/``, a student's submission). Its checks are the tests in
``tests/test_sNN_topic.py``, all marked with the pytest marker ``topic`` (``causal_attention``),
which is what ``pytest -m causal_attention`` selects. Markers are unique across the kit.

The kit has two assignments; the letter a stage's name starts with says which one it belongs to
(``ASSIGNMENTS``): chapter 3 of the book (``s01``-``s11``) and the attention of today's LLMs
(``m01_pytorch_attention``, ...).

Standard library only, so that the grader can read names without importing torch.
"""
from __future__ import annotations

import re
from pathlib import Path

# Assignment -> the letter its stage modules' names start with, in the order the course teaches them.
ASSIGNMENTS = {"attention": "s", "modern-attention": "m"}
_LETTERS = "".join(ASSIGNMENTS.values())
MODULE = re.compile(rf"[{_LETTERS}]\d\d_\w+")  # a stage module's name
TEST_FILE = re.compile(rf"test_([{_LETTERS}]\d\d_\w+)\.py")  # the name of its test file


def teaching_order(stage: str) -> tuple:
    """Sort key of stage module names in teaching order: chapter 3's stages, then modern-attention's."""
    return _LETTERS.index(stage[0]), stage


def assignment_of(stage: str) -> str:
    """The assignment a stage belongs to: s08_causal_attention -> attention."""
    return next(name for name, letter in ASSIGNMENTS.items() if stage[:1] == letter)


def is_stage_module(name: str) -> bool:
    return MODULE.fullmatch(name) is not None


def marker(stage: str) -> str:
    """The stage's pytest marker: s08_causal_attention -> causal_attention."""
    return stage.split("_", 1)[1]


def stage_command(stage: str, impl: str | None = None) -> str:
    """The command that runs one stage's tests, as the notebook and the summary of a pytest run suggest
    it: s08_causal_attention -> ``pytest -m causal_attention``; with ``impl`` (the folder of modules a run
    tested, when a bare ``pytest`` there would test another) ``pytest --impl=exercises -m causal_attention`` (one
    word: with a space, a path outside the folder would be taken for where the tests are)."""
    return f"pytest --impl={impl} -m {marker(stage)}" if impl else f"pytest -m {marker(stage)}"


def stage_test_file(stage: str) -> str:
    """The name of the stage's test file: s08_causal_attention -> test_s08_causal_attention.py."""
    return f"test_{stage}.py"


def stage_of(nodeid) -> str | None:
    """The stage a test or test file belongs to (``tests/test_s08_causal_attention.py::test_x``), or None."""
    match = TEST_FILE.search(str(nodeid).split("::")[0])
    return match.group(1) if match else None


def module_files(folder) -> list[Path]:
    """The stage modules in ``folder``: regular files named ``sNN_topic.py`` (or ``mNN_topic.py``), in
    teaching order, assignment by assignment. A symbolic link is not one (it could point anywhere), nor
    is a folder named like a module."""
    found = [p for p in Path(folder).iterdir()
             if p.suffix == ".py" and is_stage_module(p.stem) and p.is_file() and not p.is_symlink()]
    return sorted(found, key=lambda p: teaching_order(p.stem))


def builds_on(source: str) -> list[str]:
    """The stage modules that a stage module's ``source`` imports (stage 9's wrapper imports stage 8's
    ``CausalAttention``: ``["s08_causal_attention"]``), in the order they are imported. A stage is
    graded with the reference versions of these, so that a mistake costs points on its own stage only."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # (ValueError: null bytes) the import fails and says so
        return []
    found = []
    for node in ast.walk(tree):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [n for n in names if is_stage_module(n) and n not in found]
    return found
