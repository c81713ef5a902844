"""The graded suite's public part: what of a stage's test file a release ships.

``public_tests(path)`` derives a public-only test file from a stage's test module: its imports,
``pytestmark``, the tests marked ``public`` and the module-level helpers, fixtures and constants they use.
The course build writes it into a release; the redaction of hidden material knows from it which test text
a student already has; Gradescope shows the public checks at once.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from .errors import CourseError


def _is_public(decorators) -> bool:
    return any(ast.unparse(d) == "pytest.mark.public" for d in decorators)


def _names_used(node) -> set[str]:
    """Names a statement needs: every Name it loads, the arguments of functions (pytest fixtures)
    and the strings of usefixtures(...)."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.update(a.arg for a in sub.args.args + sub.args.kwonlyargs)
        elif isinstance(sub, ast.Call) and ast.unparse(sub.func).endswith("usefixtures"):
            names.update(a.value for a in sub.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def _defined(node) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _test_names(node) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
        return {node.name}
    if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
        return {node.name} | {n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    return set()


@dataclass
class PublicTests:
    source: str | None  # the public-only test file (None: the stage has no public test)
    public: list[str]  # names of the public tests
    hidden: list[str]  # names of the tests left out


def public_tests(path: Path) -> PublicTests:
    """Derive a public-only test file: imports, ``pytestmark``, the tests marked public and the
    module-level helpers, fixtures and constants they use (transitively). Comments between
    statements and the module docstring are not carried over."""
    text = Path(path).read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    body = tree.body
    keep, public, hidden = set(), [], []
    for i, node in enumerate(body):
        tests = _test_names(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or "pytestmark" in _defined(node):
            keep.add(i)
        elif tests:
            if _is_public(node.decorator_list) and isinstance(node, ast.FunctionDef):
                keep.add(i)
                public.append(node.name)
            elif isinstance(node, ast.ClassDef) and _is_public(node.decorator_list):
                keep.add(i)
                public.extend(sorted(tests))
            else:
                hidden.extend(sorted(tests))
    # Helpers the kept statements need, transitively.
    definers = {}
    for i, node in enumerate(body):
        if not _test_names(node):
            for name in _defined(node):
                definers.setdefault(name, []).append(i)
    todo = list(keep)
    while todo:
        for name in _names_used(body[todo.pop()]):
            for j in definers.get(name, []):
                if j not in keep:
                    keep.add(j)
                    todo.append(j)
    used = set().union(*(_names_used(body[i]) for i in keep)) if keep else set()
    for forbidden in ("hidden_fx", "reference"):
        if forbidden in used and public:
            raise CourseError(f"{path.name}: a public test (or a helper it uses) needs the instructor-only "
                              f"fixture {forbidden!r}; it cannot be shipped to students")
    if not public:
        return PublicTests(None, public, hidden)
    stage = path.stem.removeprefix("test_")
    chunks = [f'"""Public tests of stage {stage} (the ones shipped with the assignment)."""']
    for i in sorted(keep):
        node = body[i]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        chunks.append("\n".join(lines[first - 1:node.end_lineno]))
    source = chunks[0] + "\n" + _join(body, keep, chunks[1:])
    return PublicTests(source, public, hidden)


def _join(body, keep, chunks) -> str:
    """Imports grouped at the top, two blank lines around definitions."""
    out, previous = "", None
    for i, chunk in zip(sorted(keep), chunks):
        kind = "import" if isinstance(body[i], (ast.Import, ast.ImportFrom)) else (
            "def" if isinstance(body[i], (ast.FunctionDef, ast.ClassDef)) else "stmt")
        if previous is None:
            sep = "\n"
        elif kind == "def" or previous == "def" or (kind != previous):
            sep = "\n\n\n" if "def" in (kind, previous) else "\n\n"
        else:
            sep = "\n"
        out += sep + chunk
        previous = kind
    return out + "\n"
