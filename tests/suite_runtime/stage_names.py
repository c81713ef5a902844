"""What stages are called: one definition for the suite, the grader (``attnkit``) and the kit's tests.

A stage is a module named ``<letter>NN_topic`` (``s08_causal_attention``) in a folder of stage
modules (``solutions/``, ``exercises/``, a student's submission). Its checks are the tests in
``tests/test_s08_causal_attention.py``, all marked with the pytest marker ``topic``
(``causal_attention``), which is what ``pytest -m causal_attention`` selects. Markers are unique
across the kit.

The letter a stage's name starts with says which assignment it belongs to. The kit keeps one record per
assignment (``assignments/<name>/assignment.toml``: its name, its letter, its stages in teaching order);
``records`` reads them, for the suite's order of stages across assignments and for the grader
(``grader.kit``). A student's release has one assignment and no records: nothing here needs them but
that order.

Standard library only (and tomli on Python 3.10, which pytest requires there), so that the grader can
read names without importing torch.
"""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

MODULE = re.compile(r"[a-z]\d\d_\w+")  # a stage module's name
TEST_FILE = re.compile(r"test_([a-z]\d\d_\w+)\.py")  # the name of its test file
# The kit's assignment records (a student's release has no such folder: its stages share one letter).
ASSIGNMENTS_FOLDER = Path(__file__).resolve().parents[2] / "assignments"
RECORD = "assignment.toml"


@cache
def records() -> tuple[dict, ...]:
    """The kit's assignment records, each as its assignment.toml holds it (plus ``folder``), in the order the
    course teaches them: by ``order`` (those without one last), then by name. None in a release."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
        import tomli as tomllib

    if not ASSIGNMENTS_FOLDER.is_dir():
        return ()
    found = []
    for path in sorted(ASSIGNMENTS_FOLDER.glob(f"*/{RECORD}")):
        try:
            record = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
        found.append({**record, "folder": str(path.parent)})
    return tuple(sorted(found, key=lambda r: (r.get("order", float("inf")), str(r.get("name")))))


def teaching_order(stage: str) -> tuple:
    """Sort key of stage module names in teaching order: assignment by assignment (the kit's records' order),
    each assignment's stages by number."""
    letters = [record.get("letter") for record in records()]
    return (letters.index(stage[0]) if stage[:1] in letters else len(letters)), stage


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


def register_markers(config, suite) -> None:
    """Each stage's marker, registered with pytest from the stage test files in ``suite`` (test_s08_causal_attention.py
    marks its tests causal_attention): `pytest -m causal_attention` selects a stage, `pytest --markers` lists it."""
    for stage in filter(None, (stage_of(path.name) for path in sorted(Path(suite).glob("test_*.py")))):
        config.addinivalue_line("markers", f"{marker(stage)}: the checks of stage {stage}")


def module_files(folder) -> list[Path]:
    """The stage modules in ``folder``: regular files named ``<letter>NN_topic.py``, in teaching order,
    assignment by assignment. A symbolic link is not one (it could point anywhere), nor is a folder named
    like a module."""
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
