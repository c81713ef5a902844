"""The stage summary at the end of a run: how many checks of each stage pass, and where to continue."""
from __future__ import annotations

import shlex
from collections import defaultdict
from pathlib import Path

import pytest

from suite_runtime.stage_names import builds_on, stage_command, stage_of, teaching_order

from . import ROOT, SUITE, shown
from .devices import NO_CUDA

STAGE_TEST_FILES = tuple(sorted(p.name for p in SUITE.glob("test_*.py") if stage_of(p.name)))

# ---------------------------------------------------------------- summary

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Per stage: how many tests pass, and which stage to work on next, in what words. Written last, after
    pytest's own summaries (the reasons for other skips ...), right above the line of counts. The CUDA cases
    skipped for want of a GPU (dozens, one line each in pytest's list of skips) are one line of it instead; they
    are back in pytest's counts."""
    skipped = terminalreporter.stats.get("skipped", [])
    no_cuda = [report for report in skipped if _no_cuda(report)]
    skipped[:] = [report for report in skipped if not _no_cuda(report)]
    try:
        yield
    finally:
        skipped.extend(no_cuda)
    stage_summary(terminalreporter, config, len(no_cuda))


def _no_cuda(report) -> bool:
    """Whether ``report`` is of a CUDA case skipped because this machine has no CUDA device."""
    longrepr = getattr(report, "longrepr", None)
    return isinstance(longrepr, tuple) and len(longrepr) == 3 and NO_CUDA in str(longrepr[2])


def stage_summary(terminalreporter, config, no_cuda: int = 0):
    counts = defaultdict(lambda: [0, 0])  # stage -> [passed, total]
    failing = {}  # failing stage -> True while every failure is its own stub's NotImplementedError
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") != "call" and outcome != "error":
                continue
            stage = stage_of(report.nodeid)
            if stage:
                counts[stage][0] += outcome == "passed"
                counts[stage][1] += 1
                if outcome != "passed":
                    own = getattr(report, "not_written_yet", None) == stage
                    failing[stage] = failing.get(stage, True) and own
    if not counts and not no_cuda:
        return
    tr = terminalreporter
    tr.section("attention-kit stages")
    if no_cuda:
        tr.write_line(f"{no_cuda} CUDA case{'s' * (no_cuda > 1)} skipped: no CUDA device on this machine (each one's "
                      "CPU twin ran; run on a GPU to check them)")
    if not counts:
        return
    impl = Path(config.getoption("impl"))
    option = _impl_option(config, impl)

    def command(stage=None):
        return stage_command(stage, option) if stage else f"pytest --impl={option}" if option else "pytest"

    tr.write_line(f"implementation: {impl}")
    unchecked = {}  # failing stage -> the stages it builds on that this run did not check
    for stage in sorted(counts, key=teaching_order):
        passed, total = counts[stage]
        line = f"  {'    ' if stage in failing else 'done'}  {stage:<28} {passed:>3}/{total:<3} tests pass"
        for earlier in _builds_on(impl, stage) if stage in failing else []:  # its failures may be the earlier one's
            if earlier in failing:
                line += f"  (builds on {earlier}: make that pass first)"
            elif earlier not in counts:
                line += f"  (builds on {earlier}, not checked in this run)"
                unchecked.setdefault(stage, []).append(earlier)
        tr.write_line(line)
    todo = min(failing, key=teaching_order, default=None)
    if todo is None:
        every = len(counts) == len(STAGE_TEST_FILES)
        tr.write_line("Every stage passes." if every else
                      f"Every stage checked passes ({len(counts)} of {len(STAGE_TEST_FILES)}: `{command()}` "
                      "checks all).")
        return
    module = shown(impl / f"{todo}.py")
    for earlier in unchecked.get(todo, []):
        tr.write_line(f"First: run `{command(earlier)}`: {todo} builds on {earlier}, whose mistakes fail "
                      f"{todo}'s tests too.")
    if failing[todo]:  # still a stub
        tr.write_line(f"Next: stage {todo}: fill in the TODOs of {module},\n"
                      f"      then run `{command(todo)}` (the failures above say what is expected).")
    else:
        tr.write_line(f"Next: stage {todo}: fix {module},\n"
                      f"      then run `{command(todo)}` (the failures above say what is wrong).")


def _impl_option(config, impl: Path) -> str | None:
    """What a suggested command must add so that it tests ``impl`` again: None when a bare `pytest` tests it
    (the ini option impl names it), else ``impl`` as the student would type it, quoted for the shell."""
    if impl == (ROOT / config.getini("impl")).resolve():
        return None
    return shlex.quote(shown(impl))


def _builds_on(impl: Path, stage) -> list[str]:
    """The stages whose modules the student's module of ``stage`` imports."""
    try:
        return builds_on((impl / f"{stage}.py").read_text(errors="replace"))
    except OSError:  # missing: its tests say so
        return []
