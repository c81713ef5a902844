"""Whole-suite runs against other implementations, as a student or grader would start them.

The stubs must fail every stage test with their own NotImplementedError; a broken
submission must fail only the stages it breaks, with a clear reason. What a student reads
is checked too: tracebacks from the test's line to their own code, a summary that says what
to do next, messages for files Python cannot read, a `pytest --help` about their own folder.
"""
import importlib.machinery
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from grader.course.build import build
from grader.course.samples import edited, write_modules
from grader.kit import KIT, SOLUTIONS, stages, suite_files
from suite_runtime.adapters import SubmissionError, load_stage_module

# Whole suites or gradings run in its fixtures: seconds idle, minutes on a loaded machine (pytest's default of
# 120 s is for single tests).
pytestmark = pytest.mark.timeout(600)


def run_suite(impl, tmp_path, *extra):
    """Run the stage suites against impl; return ({test id: (outcome, message)}, stdout)."""
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, suite_files()), f"--impl={impl}", "-p", "no:cacheprovider",
         f"--junitxml={junit}", "-q", *extra],
        cwd=KIT, capture_output=True, text=True, timeout=600,
    )
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, (node.get("message") or "") + (node.text or "")
        results[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return results, proc.stdout


def stage_of(test_id):
    """The stage of a junit test id (tests.test_s08_causal_attention::test_x)."""
    return next(s for s in stages() if f"test_{s}" in test_id)


@pytest.fixture(scope="module")
def stub_run(tmp_path_factory):
    """The whole suite on the untouched stubs: ({test id: (outcome, message)}, stdout)."""
    return run_suite("exercises", tmp_path_factory.mktemp("stubs"))


def test_stubs_fail_every_stage_test_with_their_own_message(stub_run):
    results, stdout = stub_run
    graded = {t: r for t, r in results.items() if r[0] != "skipped"}
    assert len(graded) > 100
    wrong = {t: r for t, r in graded.items()
             if r[0] != "failure" or "NotImplementedError" not in r[1] or f"{stage_of(t)}: " not in r[1]}
    assert not wrong, f"{len(wrong)} tests did not fail with their stage's NotImplementedError: {sorted(wrong)[:5]}"
    skipped = [r[1] for r in results.values() if r[0] == "skipped"]
    assert all("CUDA" in why for why in skipped), skipped
    assert "Next: stage s01_attention_scores" in stdout


def test_broken_modules_cost_only_their_own_stages(tmp_path):
    submission = tmp_path / "submission"
    shutil.copytree(SOLUTIONS, submission, ignore=shutil.ignore_patterns("__pycache__"))
    path = submission / "s05_self_attention.py"
    path.write_text(path.read_text().replace("def forward(self, x):", "def forward(self, x)", 1))
    (submission / "s08_causal_attention.py").unlink()

    results, _ = run_suite(submission, tmp_path)
    by_stage = {}
    for test_id, (outcome, message) in results.items():
        by_stage.setdefault(stage_of(test_id), []).append((outcome, message))
    for outcome, message in by_stage["s05_self_attention"]:
        assert outcome == "failure" and "s05_self_attention.py has a syntax error on line" in message
    for outcome, message in by_stage["s08_causal_attention"]:
        assert (outcome, "s08_causal_attention.py is missing" in message) == ("failure", True) or (
            outcome == "skipped" and "CUDA" in message)
    for outcome, message in by_stage["s09_multihead_wrapper"]:
        assert outcome in ("failure", "skipped") and ("s08_causal_attention" in message or "CUDA" in message)
    intact = set(stages()) - {"s05_self_attention", "s08_causal_attention", "s09_multihead_wrapper"}
    for stage in intact:
        assert all(outcome in ("passed", "skipped") for outcome, _ in by_stage[stage]), stage


# ---------------------------------------------------------------- what a student reads

SUPPORT_FRAME = re.compile(r"^(tests/)?(adapters|checks)\.py:\d+: in ", re.M)  # a frame of the suite's own code
MODULE_CALL_FRAME = re.compile(r"torch/nn/modules/module\.py:\d+: in ")


def frames_of(report):
    """(file name, function) of each frame of a failure report (--tb=short)."""
    return [(Path(path).name, function) for path, function in re.findall(r"^(\S+\.py):\d+: in (\w+)$", report, re.M)]


def failure_report(stdout, test_name, test_file=None):
    """The report of one failed test in pytest's output (--tb=short): its lines below its ____ header (of the
    test in ``test_file``, when given, whose report starts with its traceback)."""
    failures = re.split(r"^=+ FAILURES =+$", stdout, flags=re.M)[1]
    failures = re.split(r"^=+ ", failures, flags=re.M)[0]
    parts = re.split(r"^_+ (\S+) _+$\n", failures, flags=re.M)
    for name, report in zip(parts[1::2], parts[2::2]):
        if name == test_name and (test_file is None or report.startswith(f"tests/{test_file}:")):
            return report
    raise AssertionError(f"no failure report for {test_file}::{test_name} in:\n{stdout[-3000:]}")


def suggested(stdout: str, before: str) -> str:
    """The command the summary suggests after ``before`` (`pytest ...`)."""
    found = re.search(rf"{before}\s+`(pytest [^`]*)`", stdout)
    assert found, f"no command after {before!r} in:\n{stdout[-2000:]}"
    return found.group(1)


def run_suggested(command: str) -> str:
    """Run a command the summary suggested, in the folder the suggesting run ran in; returns its output."""
    args = shlex.split(command)
    assert args[0] == "pytest", command
    return subprocess.run([sys.executable, "-m", "pytest", *args[1:], "-p", "no:cacheprovider"], cwd=KIT,
                          capture_output=True, text=True, timeout=600).stdout


def test_a_stub_failure_is_one_line_at_the_stub_and_the_summary_says_fill_in_last(stub_run):
    _, stdout = stub_run
    assert not SUPPORT_FRAME.search(stdout), SUPPORT_FRAME.search(stdout).group()
    report = failure_report(stdout, "test_journey_scores_every_token_against_the_query[attention_scores_loop]")
    stub = (KIT / "exercises" / "s01_attention_scores.py").read_text().splitlines()
    raised = 'NotImplementedError("s01_attention_scores: attention_scores_loop'
    where = next(n for n, line in enumerate(stub, 1) if raised in line)
    assert report.strip() == (f"exercises/s01_attention_scores.py:{where}: "
                              "NotImplementedError: s01_attention_scores: attention_scores_loop: see its TODO"), report
    assert len(stdout.splitlines()) < 3 * len(re.findall(r"^_+ \S+ _+$", stdout, flags=re.M)) + 100, \
        "a stub's failure takes more than its header and one line"
    # The stage summary comes last (after pytest's own, e.g. the reasons for skipped CUDA cases), right above
    # the line of counts, so that it is what a student sees.
    summary = stdout[stdout.index(" attention-kit stages "):]
    assert "SKIPPED" not in summary and "short test summary" not in summary, summary
    # The CUDA cases skipped for want of a GPU: one line of the summary, not one line each among pytest's skips.
    if "CUDA case" in stdout:
        assert "CUDA case" not in stdout[:stdout.index(" attention-kit stages ")], stdout[-5000:]
        assert re.search(r"\n\d+ CUDA cases skipped: no CUDA device on this machine \(each one's CPU twin ran", summary)
    assert re.fullmatch(r"(=+ )?\d+ failed, \d+ skipped in .*", summary.rstrip().splitlines()[-1]), summary
    assert re.search(r"s09_multihead_wrapper .* \(builds on s08_causal_attention: make that pass first\)", stdout)
    assert re.search(r"Next: stage s01_attention_scores: fill in the TODOs of exercises/s01_attention_scores\.py,"
                     r"\s+then run `pytest --impl=exercises -m attention_scores`", stdout), stdout[-2000:]


def test_the_command_the_summary_suggests_tests_the_modules_the_run_tested(stub_run):
    """`pytest --impl exercises` must not suggest a bare `pytest -m ...`: in the kit, that tests solutions/."""
    _, stdout = stub_run
    again = run_suggested(suggested(stdout, "then run"))
    assert f"implementation under test: {KIT / 'exercises'}" in again, again[:1000]
    assert re.search(r"Next: stage s01_attention_scores: fill in the TODOs", again), again[-2000:]


BROKEN = {  # stage -> edits of the reference: what each shows in a student's run
    # correct with given weights, its weights created in another order: only the book test fails, with its hint
    "s05_self_attention": [("        self.W_query = nn.Parameter(torch.rand(d_in, d_out))\n"
                            "        self.W_key = nn.Parameter(torch.rand(d_in, d_out))\n"
                            "        self.W_value = nn.Parameter(torch.rand(d_in, d_out))\n",
                            "        self.W_value = nn.Parameter(torch.rand(d_in, d_out))\n"
                            "        self.W_key = nn.Parameter(torch.rand(d_in, d_out))\n"
                            "        self.W_query = nn.Parameter(torch.rand(d_in, d_out))\n")],
    # wrong numbers (masked with 0): the book test's order hint would mislead; stage 9 imports this one
    "s08_causal_attention": [("masked_fill(mask_bool, -torch.inf)", "masked_fill(mask_bool, 0.0)")],
    # an error raised in forward(), called as model(x) through nn.Module.__call__
    "s10_multihead_attention": [("context_vec.contiguous().view(", "context_vec.view(")],
}


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    """The stages of BROKEN and stage 9 on the reference with BROKEN's edits: (results, stdout, submission)."""
    tmp = tmp_path_factory.mktemp("broken")
    submission = write_modules(tmp / "submission", replaced={
        stage: edited((SOLUTIONS / f"{stage}.py").read_text(), edits, stage) for stage, edits in BROKEN.items()})
    selected = "self_attention or causal_attention or multihead_wrapper or multihead_attention"
    return (*run_suite(submission, tmp, "-m", selected), submission)


def test_tracebacks_go_from_the_test_to_the_learners_forward(broken_run):
    _, stdout, _ = broken_run
    assert not SUPPORT_FRAME.search(stdout) and not MODULE_CALL_FRAME.search(stdout)
    report = failure_report(stdout, "test_output_of_a_token_ignores_later_tokens", "test_s10_multihead_attention.py")
    assert frames_of(report) == [("test_s10_multihead_attention.py", "test_output_of_a_token_ignores_later_tokens"),
                                 ("s10_multihead_attention.py", "forward")], report
    assert "view size is not compatible" in report  # the error's own message
    assert "Likely mistake" in report and "call .contiguous() first" in report


def test_a_book_test_hints_at_creation_order_only_when_the_stage_computes_right(broken_run):
    results, _, _ = broken_run
    s05 = {t.split("::")[-1]: r for t, r in results.items() if ".test_s05_" in t}
    s08 = {t.split("::")[-1]: r for t, r in results.items() if ".test_s08_" in t}
    v1_book = "test_book_reproduction[SelfAttention_v1-123]"
    assert all(outcome in ("passed", "skipped") for name, (outcome, _) in s05.items() if name != v1_book)
    assert s05[v1_book][0] == "failure" and "Create W_query, then W_key, then W_value" in s05[v1_book][1]

    outcome, message = s08["test_book_reproduction"]
    assert outcome == "failure" and "Fix this stage's other failures first (" in message
    assert "in this order" not in message  # the creation-order hint is not the cause here
    assert list(s08)[-1] == "test_book_reproduction"  # (junit keeps the order the tests ran in)


def test_summary_says_fix_and_names_the_stage_to_pass_first(broken_run, tmp_path):
    _, stdout, submission = broken_run
    assert re.search(rf"Next: stage s05_self_attention: fix \S*s05_self_attention\.py,\s+then run "
                     rf"`pytest --impl={re.escape(str(submission))} -m self_attention`", stdout), stdout[-2000:]
    assert re.search(r"s09_multihead_wrapper .* \(builds on s08_causal_attention: make that pass first\)", stdout)
    # stage 9 alone: whether stage 8 passes is not known, and the summary says so
    _, alone = run_suite(submission, tmp_path, "-m", "multihead_wrapper")
    assert "(builds on s08_causal_attention, not checked in this run)" in alone
    assert f"First: run `pytest --impl={submission} -m causal_attention`: s09_multihead_wrapper builds on" in alone, \
        alone[-2000:]
    first = run_suggested(suggested(alone, "First: run"))  # it tests this submission's stage 8
    assert f"implementation under test: {submission}" in first and "s08_causal_attention " in first, first[-2000:]


NULL_BYTES = "contains null bytes"


@pytest.mark.parametrize("content", [
    b"x = 1\n\0\ny = 2\n",  # a stray null byte
    "x = 1\n".encode("utf-16"),  # saved as UTF-16: a null byte after each ASCII character
], ids=["null-byte", "utf-16"])
def test_a_module_with_null_bytes_says_so_and_how_to_fix_it(tmp_path, content):
    (tmp_path / "s01_attention_scores.py").write_bytes(content)
    with pytest.raises(SubmissionError) as raised:
        load_stage_module(tmp_path, "s01_attention_scores")
    message = str(raised.value)
    assert message.startswith(f"s01_attention_scores.py {NULL_BYTES}") and "UTF-8" in message
    assert "line None" not in message


def test_null_bytes_in_a_module_it_imports_name_that_module(tmp_path):
    (tmp_path / "s08_causal_attention.py").write_bytes(b"class CausalAttention:\n    pass\0\n")
    (tmp_path / "s09_multihead_wrapper.py").write_text("from s08_causal_attention import CausalAttention\n")
    with pytest.raises(SubmissionError, match=f"^s08_causal_attention.py {NULL_BYTES}"):
        load_stage_module(tmp_path, "s09_multihead_wrapper")


def test_null_bytes_reported_as_a_value_error(tmp_path, monkeypatch):
    """Older Pythons raise ValueError, not SyntaxError, for source with null bytes."""
    def refuse(self, data, path, *args, **kwargs):
        raise ValueError("source code string cannot contain null bytes")

    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "source_to_code", refuse)
    (tmp_path / "s01_attention_scores.py").write_bytes(b"x = 1\0\n")
    with pytest.raises(SubmissionError, match=f"^s01_attention_scores.py {NULL_BYTES}"):
        load_stage_module(tmp_path, "s01_attention_scores")


def test_a_syntax_error_in_a_module_it_imports_names_that_module(tmp_path):
    (tmp_path / "s08_causal_attention.py").write_text("class CausalAttention:\n    def f(self)\n")
    (tmp_path / "s09_multihead_wrapper.py").write_text("from s08_causal_attention import CausalAttention\n")
    with pytest.raises(SubmissionError, match="^s08_causal_attention.py has a syntax error on line 2"):
        load_stage_module(tmp_path, "s09_multihead_wrapper")


def test_pytest_help_in_a_students_folder_mentions_only_what_is_there(tmp_path):
    folder = build(tmp_path / "course").source
    run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    shown = "".join(subprocess.run(run + [option], cwd=folder, capture_output=True, text=True, check=True).stdout
                    for option in ("--help", "--markers"))
    assert "--impl=PATH" in shown and "--seed=SEED" in shown and "@pytest.mark.causal_attention" in shown
    for absent in ("solutions", "exercises", "--isolate", "hidden cases", "kit_tests", "@pytest.mark.slow"):
        assert absent not in shown, absent
