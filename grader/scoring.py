"""A stage's points and its feedback, from the verdicts of its checks.

A verdict is one test of the graded suite on one submission: ``{"nodeid", "stage", "marker",
"label", "outcome": "passed" | "failed" | "skipped", "message"}``. A stage earns
``points x passed / counted``, where skipped checks (CUDA cases on a machine without CUDA) do not
count. What a message says is read here too: the mistakes the suite diagnosed, and which limit
of the sandbox a check ran into.
"""
from __future__ import annotations

import re

from stage_names import marker, stage_of

MESSAGE_LIMIT = 700  # characters of one failure message shown in feedback
DETAILED_FAILURES = 12  # failures per stage shown with their message
MISTAKE = re.compile(r"Likely mistake:\s*(.*?)(?=\nLikely mistake:|\Z)", re.S)
TIME_LIMIT = re.compile(r"time limit|pytest-timeout")  # the sandbox's, the suite's and pytest-timeout's words
LIMITS = [  # (limit, what its message says), checked in this order
    ("budget", re.compile(r"time budget of this submission ran out")),
    ("memory", re.compile(r"memory limit of")),
    ("time", TIME_LIMIT),
    ("crash", re.compile(r"died with signal|sandbox process died unexpectedly")),
    ("exit", re.compile(r"exited with code \S+ before answering")),
    ("output", re.compile(r"answer could not be read: a result of")),
]


def check_entry(nodeid: str) -> dict | None:
    """A graded check of the suite as the records name it, or None for a test of no stage."""
    stage = stage_of(nodeid)
    if stage is None:
        return None
    return {"nodeid": nodeid, "stage": stage, "marker": marker(stage), "label": label(nodeid)}


def label(nodeid: str) -> str:
    """A check's name in feedback: tests/test_s08_x.py::test_mask_is_a_buffer[cpu] -> 'mask is a buffer[cpu]'."""
    parts = nodeid.split("::")[1:]
    return " / ".join(re.sub(r"^test_?", "", p).replace("_", " ") for p in parts)


def stage_score(tests: list[dict], points: float) -> float:
    """points x (passed / counted); skipped tests (e.g. CUDA cases without a GPU) do not count."""
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    if not counted:
        return 0.0
    passed = sum(t["outcome"] == "passed" for t in counted)
    return round(points * passed / len(counted), 2)


def stage_report(marker: str, points: float, tests: list[dict]) -> str:
    """What a stage's autograder cell prints: a line per check, the failures' messages, the score."""
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    passed = [t for t in counted if t["outcome"] == "passed"]
    score = stage_score(tests, points)
    lines = [f"Stage {marker}: {len(passed)} of {len(counted)} checks pass -> {score:g} of {points:g} points"]
    shown = 0
    for t in tests:
        if t["outcome"] == "passed":
            lines.append(f"  PASS  {t['label']}")
        elif t["outcome"] == "failed":
            lines.append(f"  FAIL  {t['label']}")
            if shown < DETAILED_FAILURES:
                shown += 1
                message = t["message"].strip() or "the check failed (no message)"
                if len(message) > MESSAGE_LIMIT:
                    message = message[:MESSAGE_LIMIT] + " [...]"
                lines.extend("        " + m for m in message.splitlines())
        else:
            lines.append(f"  skip  {t['label']} ({t['message'].strip() or 'skipped'})")
    return "\n".join(lines)


def mistakes(message: str) -> list[str]:
    """The mistakes a failure message names (the text after each "Likely mistake:")."""
    return [m.strip() for m in MISTAKE.findall(message or "") if m.strip()]


def limit_of(message: str, output_capped: bool = False) -> str | None:
    """Which limit of the sandbox a check ran into, from its message (None: none)."""
    for name, pattern in LIMITS:
        if pattern.search(message or ""):
            return name
    return "output" if output_capped else None
