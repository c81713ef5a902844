"""Whole-suite runs against other implementations, as a student or grader would start them.

The stubs must fail every stage test with their own NotImplementedError; a broken
submission must fail only the stages it breaks, with a clear reason.
"""
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

from grader.kit import KIT, SOLUTIONS, stages, suite_files


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


def test_stubs_fail_every_stage_test_with_their_own_message(tmp_path):
    results, stdout = run_suite("exercises", tmp_path)
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
        assert outcome == "failure" and "s08_causal_attention.py is missing" in message
    for outcome, message in by_stage["s09_multihead_wrapper"]:
        assert outcome in ("failure", "skipped") and ("s08_causal_attention" in message or "CUDA" in message)
    intact = set(stages()) - {"s05_self_attention", "s08_causal_attention", "s09_multihead_wrapper"}
    for stage in intact:
        assert all(outcome in ("passed", "skipped") for outcome, _ in by_stage[stage]), stage
