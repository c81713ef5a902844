"""A stage's points and its feedback, from the verdicts of its checks.

A verdict is one test of the graded suite on one submission: ``{"nodeid", "stage", "marker",
"label", "outcome": "passed" | "failed" | "skipped", "message", "limit", "mistakes"}``
(grader.grading.contracts.Verdict).
A stage earns ``points x passed / counted``, where skipped checks (CUDA cases on a machine without CUDA) do not
count. The mistakes the suite diagnosed travel beside the message, as data (the verdict's ``mistakes``).
"""
from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from suite_runtime.stage_names import marker, stage_of

from ..kit import stage_info
from .contracts import Check, TestRecord

MESSAGE_LIMIT = 700  # characters of one failure message shown in feedback
# Columns of a stage report's lines: longer ones are wrapped (at spaces, with a deeper indent), since the formgrader
# and the feedback page show a cell's output in a box that cuts a line at its width (about 130 columns in a window
# 1280 pixels wide; 100 leave room for narrower windows), and so may a terminal.
REPORT_WIDTH = 100
DETAILED_FAILURES = 12  # failures per stage shown with their message
# The lines of a failure message that say what the evidence bears out (diagnosis.findings): kept when it is cut.
FINDING_LINES = ("Evidence:", "Likely mistake:", "Possible mistake", "Not written yet:")


def check_entry(nodeid: str) -> Check | None:
    """A graded check of the suite as the records name it, or None for a test of no stage."""
    stage = stage_of(nodeid)
    if stage is None:
        return None
    return {"nodeid": nodeid, "stage": stage, "marker": marker(stage), "label": label(nodeid)}


DEVICES = {"cpu": "CPU", "cuda": "CUDA"}  # device parameters of a check, as feedback names them
CASE = re.compile(r"case(\d+)")  # a random case's parameter, counted from 0


def params(nodeid: str) -> list[str]:
    """A check's pytest parameters: ...::test_other_sizes[cuda-case0] -> ['cuda', 'case0']."""
    inside = nodeid.split("::")[-1].partition("[")[2]
    return inside[:-1].split("-") if inside.endswith("]") else []


POSSESSIVE = re.compile(r"(?<=[a-z0-9])_s(?=_|$)")  # how a test's name writes 's: test_with_the_book_s_weights


def label(nodeid: str) -> str:
    """A check's name as students read it: tests/test_s10_x.py::test_other_sizes[cuda-case0] -> 'other sizes
    (case 1, CUDA)', test_with_the_book_s_weights -> "with the book's weights". Code names in the parameters
    (attention_scores_loop, SelfAttention_v1) stay as they are."""
    names = [POSSESSIVE.sub("'s", re.sub(r"^test_?", "", p)).replace("_", " ")
             for p in nodeid.partition("[")[0].split("::")[1:]]
    found = params(nodeid)
    cases = [f"case {int(number[1]) + 1}" for p in found if (number := CASE.fullmatch(p))]
    devices = [DEVICES[p] for p in found if p in DEVICES]
    shown = [p for p in found if not CASE.fullmatch(p) and p not in DEVICES] + cases + devices
    return " / ".join(names) + (f" ({', '.join(shown)})" if shown else "")


def needs_cuda(nodeid: str) -> bool:
    """A check that runs on a CUDA device (skipped, and not counted, where there is none)."""
    return "cuda" in params(nodeid)


def stage_score(tests: Sequence[TestRecord], points: float) -> float:
    """points x (passed / counted); skipped tests (e.g. CUDA cases without a GPU) do not count. ``tests``: a
    stage's checks, as verdicts (contracts.Verdict) or as a record keeps them (contracts.TestRecord)."""
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    if not counted:
        return 0.0
    passed = sum(t["outcome"] == "passed" for t in counted)
    return round(points * passed / len(counted), 2)


def stage_report(stage: str, points: float, tests: Sequence[TestRecord]) -> str:
    """What a stage's autograder cell prints (and Gradescope shows, and the feedback page): the stage's heading
    with its score, a line per check, the failures' messages."""
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    passed = [t for t in counted if t["outcome"] == "passed"]
    score = stage_score(tests, points)
    lines = [f"{stage_info(stage).heading}: {len(passed)} of {len(counted)} checks pass -> {score:g} of {points:g} "
             "points"]
    shown = 0
    for t in tests:
        if t["outcome"] == "passed":
            lines.append(f"  PASS  {t['label']}")
        elif t["outcome"] == "failed":
            lines.append(f"  FAIL  {t['label']}")
            if shown < DETAILED_FAILURES:
                shown += 1
                message = t["message"].strip() or "the check failed (no message)"
                if len(message) > MESSAGE_LIMIT:  # cut, but what the diagnosis found is always shown
                    cut = message[:MESSAGE_LIMIT]
                    named = [line for line in message.splitlines() if line.startswith(FINDING_LINES)]
                    message = "\n".join([cut + " [...]"] + [line for line in named if line not in cut])
                lines.extend(line for m in message.splitlines() for line in _wrapped("        " + m))
        elif not needs_cuda(t["nodeid"]):
            lines.append(f"  skip  {t['label']} ({t['message'].strip() or 'skipped'})")
    # Checks on a CUDA device are skipped on a grader without one: the student cannot do anything about it.
    on_cuda = sum(t["outcome"] == "skipped" and needs_cuda(t["nodeid"]) for t in tests)
    if on_cuda:
        lines.append(f"  ({on_cuda} more {'checks need' if on_cuda > 1 else 'check needs'} a CUDA GPU: "
                     f"not run here, so {'they count' if on_cuda > 1 else 'it counts'} for no points)")
    return "\n".join(lines)


def _wrapped(line: str) -> list[str]:
    """``line`` in lines of at most REPORT_WIDTH columns where it has spaces to break at; the continuation
    lines are indented four columns deeper than the line."""
    if len(line) <= REPORT_WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, REPORT_WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False, drop_whitespace=True) or [line]
