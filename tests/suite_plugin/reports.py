"""A failure as a student reads it: the traceback from the test's line to the learner's code, one line for a part
not written yet, and what an exception means when the operation that raised it bears the reading out."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diagnosis import STUB, error_findings, error_text
from suite_runtime.stage_names import stage_of

from . import shown
from .book import failed_checks, note_book_failure
from .implementation import Witness
from .time_limits import note_time_limit, stages_out_of_time

# ---------------------------------------------------------------- failure reports
#
# A failure's traceback goes from the test's line to the learner's code: the frames of the suite's
# support modules are hidden (``__tracebackhide__`` in adapters.py and checks.py), and so are those
# of nn.Module.__call__ between a call ``model(x)`` and the forward() it runs.

MODULE_CALL = ("_wrapped_call_impl", "_call_impl")  # nn.Module.__call__'s functions in torch/nn/modules/module.py


def _is_module_call(code) -> bool:
    return code.co_name in MODULE_CALL and code.co_filename == torch.nn.modules.module.__file__


def skip_module_calls(tb):
    """Unlink nn.Module.__call__'s frames from the traceback ``tb`` (an exception's own chain of frames,
    which is what pytest formats). The last frame, where the error was raised, always stays."""
    while tb is not None and tb.tb_next is not None:
        following = tb.tb_next
        if following.tb_next is not None and _is_module_call(following.tb_frame.f_code):
            tb.tb_next = following.tb_next
        else:
            tb = following


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure as a student reads it: without nn.Module's dispatch frames; when learner code raised (rather
    than computed wrong numbers), what the error usually means; a book test's failure in its context."""
    traced = item.config.getoption("tbstyle", "no") != "no"  # ("no" also without the terminal plugin: grading)
    if call.excinfo is not None and traced and not item.config.getoption("fulltrace", False):
        skip_module_calls(call.excinfo.tb)
    report = yield
    if report.failed and note_time_limit(item, report):  # (time_limits)
        return report
    if report.failed and note_book_failure(item, call, report):  # (book)
        return report
    report.not_written_yet = _not_written_yet(item, call) if report.failed else None  # (for the stage summary)
    if report.not_written_yet and traced:
        # A stub's traceback says nothing its message does not: one line, where to write the code (a first
        # run of every stage on the stubs is then a few hundred lines, not thousands).
        entry = call.excinfo.traceback[-1]
        report.longrepr = f"{shown(Path(entry.path))}:{entry.lineno + 1}: {call.excinfo.exconly()}"
        return report
    if report.failed and call.excinfo is not None and not call.excinfo.errisinstance(AssertionError):
        read = error_findings(error_text(call.excinfo.typename, str(call.excinfo.value)),
                              _call_that_raised(item, call.excinfo.value),
                              getattr(getattr(item, "module", None), "ERROR_READINGS", None))
        # A stub's error is no mistake (none is recorded, none counted in a class report): its line says so.
        stub = any(f.causes == (STUB,) for f in read)
        findings = [f for f in read if f.causes != (STUB,)]
        report.attnkit_findings = recorded(findings)
        if read and hasattr(report.longrepr, "addsection"):
            text = "\n".join([line for f in findings for line in f.lines()] + [STUB] * stub)
            report.longrepr.addsection("Likely mistake" if findings else "Not written yet", text)  # for the terminal
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:  # for one-line reports (grading feedback, -rf summaries)
                crash.message += f"\n{text}"
    elif report.failed and call.excinfo is not None:
        # What the check's diagnosis found (diagnosis.diagnosed), as data: a grader lists it in its records.
        report.attnkit_findings = recorded(getattr(call.excinfo.value, "findings", []))
    return report


def recorded(findings) -> list:
    """The findings a grading record lists as the check's mistakes: those that name a cause (a probe's effect alone is
    evidence the message shows, no mistake to count in a class report)."""
    return [f.record() for f in findings if f.shown]


def _call_that_raised(item, exc):
    """The operation on the implementation under test that raised ``exc`` (checks.Call), or None."""
    impl = item.funcargs.get("impl") if hasattr(item, "funcargs") else None
    witness = getattr(impl, "backend", None)
    return witness.call_that_raised(exc) if isinstance(witness, Witness) else None

def _not_written_yet(item, call) -> str | None:
    """The stage whose module raised the NotImplementedError the check failed on, when it is a module of the
    implementation under test: a part not written yet there (each stub raises one, naming its function)."""
    if call.excinfo is None or not call.excinfo.errisinstance(NotImplementedError):
        return None
    raised_in = Path(call.excinfo.traceback[-1].path)
    if raised_in.parent != Path(item.config.getoption("impl")):
        return None
    return stage_of(f"test_{raised_in.stem}.py")


def pytest_runtest_teardown(item, nextitem):
    """After the last check, forget which stages ran out of time and which checks failed: a grading
    worker runs its one pytest session again for the next submission, which must start afresh."""
    if nextitem is None:
        stages_out_of_time(item.config).clear()
        failed_checks(item.config).clear()
