"""Derive the learner's stubs from the reference solutions (``attnkit stubs``).

A solution marks what learners write with nbgrader's own delimiters, and the
comment lines right above each region say what the region does:

        # Project, score every query against every key, scale, softmax, mix the values.
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

In the stub, that comment becomes the TODO and the region a raise that points at it:

        # TODO: Project, score every query against every key, scale, softmax, mix the values.
        raise NotImplementedError("sNN_topic: SelfAttention_v1.forward: see its TODO")
"""
from __future__ import annotations

import ast
from pathlib import Path

from suite_runtime.stage_names import module_files

from ..errors import StubError
from ..kit import EXERCISES, SOLUTION_BEGIN, SOLUTION_END, SOLUTIONS, stages


def _qualnames(tree):
    """Map each line number to the qualified name of the innermost def/class around it."""
    names = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                for line in range(child.lineno, child.end_lineno + 1):
                    names[line] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return names


def make_stub(source: str, stage: str) -> str:
    lines = source.splitlines()
    qualnames = _qualnames(ast.parse(source))
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == SOLUTION_END:
            raise StubError(f"{stage}.py line {i + 1}: {SOLUTION_END} without {SOLUTION_BEGIN}")
        if line.strip() != SOLUTION_BEGIN:
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        task = []
        while out and out[-1].startswith(indent + "#") and out[-1].strip() != "#":
            task.insert(0, out.pop()[len(indent) + 1:].strip())
        if not task:
            raise StubError(f"{stage}.py line {i + 1}: write a comment above {SOLUTION_BEGIN} saying what the "
                            "region does")
        try:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == SOLUTION_END)
        except StopIteration:
            raise StubError(f"{stage}.py line {i + 1}: {SOLUTION_BEGIN} without {SOLUTION_END}") from None
        where = qualnames.get(i + 1, "module")
        out.append(f"{indent}# TODO: {task[0]}")
        out.extend(f"{indent}#       {more}" for more in task[1:])
        out.append(f'{indent}raise NotImplementedError("{stage}: {where}: see its TODO")')
        i = end + 1
    return "\n".join(out) + "\n"


def expected_exercises() -> dict[str, str]:
    """File name -> the stub text that solutions/ implies."""
    return {f"{s}.py": make_stub((SOLUTIONS / f"{s}.py").read_text(), s) for s in stages()}


def write_exercises(dest: Path = EXERCISES) -> list[Path]:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in expected_exercises().items():
        (dest / name).write_text(text)
        written.append(dest / name)
    return written


def out_of_sync(dest: Path = EXERCISES, assignments=None) -> list[str]:
    """Names of exercise files (of ``assignments``; None: of all) that differ from what solutions/
    implies (or are missing/extra)."""
    chosen = {f"{s}.py" for name in assignments for s in stages(name)} if assignments is not None else None
    expected = {n: text for n, text in expected_exercises().items() if chosen is None or n in chosen}
    present = {p.name for p in module_files(dest) if chosen is None or p.name in chosen}
    stale = [n for n, text in expected.items()
             if not (Path(dest) / n).is_file() or (Path(dest) / n).read_text() != text]
    return sorted(stale + sorted(present - set(expected)))
