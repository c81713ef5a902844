"""Every grade holds inside a container too: Gradescope, Docker, Kubernetes pods, CI runners.

Those run the grader as root with Docker's default capabilities (no CAP_SYS_ADMIN, so no namespaces) and
no cgroup tree; ``kit_tests/docker_default.sh`` runs a command that way here. There the kit chooses the
``container`` confinement (grader/sandbox/): each box a fresh uid under the learner's seccomp filter,
with the kit's secrets, the course or Gradescope's /autograder private to root, proven by a probe box
before any learner code runs. This module runs in such a container: the sandbox's own test file
(``test_sandbox.py``, every test of it), and Gradescope's ``run_autograder`` on the reference, the stubs
and the attacks that reach for the grader itself (tamper corpus entries). The tamper corpus through
``attnkit grade`` runs there too (``test_tamper_grade.py``, its container half).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from gradescope_results import unzip, validate

from grader.course.samples import by_student, write_modules
from grader.kit import KIT, SOLUTIONS, marker, plan_points, stages
from grader.outputs.gradescope import ROOT_ENV
from runs import DOCKER, expected_scores, hidden_quotes, kit_modes_kept, scores
from tamper import Context, corpus, reading_solutions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ASSIGNMENT = "attention"


def in_container(command, env=None, **options) -> subprocess.CompletedProcess:
    """``command`` run as Docker runs a container's: root, Docker's default capabilities, no cgroups."""
    env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run([str(DOCKER), *map(str, command)], env=env, capture_output=True, text=True, **options)


@pytest.fixture(scope="module", autouse=True)
def docker_like(unavailable):
    """Root is needed to make the container (in CI, a missing piece fails the test instead of skipping it)."""
    if os.geteuid() != 0:
        unavailable("a container as Docker makes one needs root here (unshare, setpriv)")
    check = in_container(["true"])
    if check.returncode != 0:
        unavailable(f"cannot make a container like Docker's here: {check.stderr.strip()}")
    with kit_modes_kept():  # (the container confinement makes them private to root)
        yield


def test_the_sandbox_holds_in_a_container():
    """Every test of test_sandbox.py, with the confinement a container gets."""
    run = in_container([sys.executable, "-m", "pytest", "kit_tests/sandbox/test_sandbox.py", "-q", "-p",
                        "no:cacheprovider", "-W", "ignore::grader.sandbox.confinement.SandboxWarning"],
                       env={"ATTNKIT_TEST_CONFINEMENT": "container"}, cwd=KIT, timeout=1500)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    print(f"\ntest_sandbox.py in a container: {summary}")
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert re.search(r"\b([5-9]\d|\d{3}) passed", summary), summary


# ---------------------------------------------------------------- Gradescope

@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    """Gradescope's /autograder: the zip unzipped into source/."""
    where = tmp_path_factory.mktemp("gradescope-container")
    subprocess.run([sys.executable, "-m", "grader.cli", "gradescope", ASSIGNMENT, "--out", str(where / "ag.zip")],
                   check=True, capture_output=True, text=True)
    root = where / "autograder"
    unzip(where / "ag.zip", root / "source")
    return root


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def grade_on_gradescope(root: Path, modules: dict[str, str]) -> tuple[dict, float]:
    """Put ``modules`` (stage module -> source; the other stages: the reference) in root/submission/, run
    run_autograder in the container, and return results.json and the run's wall-clock seconds."""
    for name in ("submission", "results"):
        subprocess.run(["rm", "-rf", str(root / name)], check=True)
        (root / name).mkdir()
    write_modules(root / "submission", replaced=modules, assignment=ASSIGNMENT)
    started = time.monotonic()
    run = in_container([root / "source" / "run_autograder"], cwd=root, timeout=900, env={
        ROOT_ENV: str(root), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    seconds = time.monotonic() - started
    results = root / "results" / "results.json"
    assert results.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    assert results.stat().st_uid == 0  # written by the trusted side (root), not by a box's uid
    return json.loads(results.read_text()), seconds


def expected_score(entry) -> float:
    points = plan_points(100, None, ASSIGNMENT)
    return round(sum(p * float(entry.fraction(marker(stage))) for stage, p in points.items()), 2)


def sandbox_entry(found: dict) -> dict:
    entries = [t for t in found["tests"] if t["name"].startswith("Sandbox: ")]
    assert len(entries) == 1, [t["name"] for t in found["tests"]]
    return entries[0]


def everything_shown(found: dict) -> str:
    return "\n".join([found.get("output", "")] + [f"{t['name']}\n{t.get('output', '')}" for t in found["tests"]])


def test_gradescope_grades_the_reference_in_a_container(autograder):
    found, seconds = grade_on_gradescope(autograder, {})
    print(f"\nGradescope, the reference, in a container: {seconds:.1f} s")
    validate(found, ASSIGNMENT)
    assert found["score"] == 100
    entry = sandbox_entry(found)
    assert entry["name"] == "Sandbox: container" and entry["visibility"] == "hidden"  # for instructors only
    assert "UNCONFINED" not in everything_shown(found)


def attacks() -> list:
    """The stubs, and the corpus entries that aim at the grader (its processes, files and hidden material)."""
    chosen = {"reach-the-grader", "read-dependency", "leak-dressed", "reach-outside", "steal-reference"}
    return [entry for entry in corpus() if entry.name in chosen or entry.name.endswith("stubs")]


@pytest.mark.parametrize("entry", attacks(), ids=lambda e: e.name)
def test_gradescope_gives_each_attack_its_honest_grade_in_a_container(autograder, entry):
    ctx = Context(course=autograder, assignment=ASSIGNMENT, bystanders=())
    modules = entry.modules(ctx)
    if entry.name == "reach-outside":  # aimed at Gradescope's own layout: the kit's solutions under source/kit/
        modules["s10_multihead_attention"] = reading_solutions("s10_multihead_attention").replace(
            str(SOLUTIONS), str(autograder / "source" / "kit" / "solutions"))
    before = tree_hash(autograder / "source")
    found, seconds = grade_on_gradescope(autograder, modules)
    shown = everything_shown(found)
    assert found["score"] == pytest.approx(expected_score(entry), abs=0.011), f"{entry.name}: {found['output']}"
    assert sandbox_entry(found)["name"] == "Sandbox: container"
    assert tree_hash(autograder / "source") == before, "the autograder's files changed"
    for word in ("FORGED", "EDITED", "SHADOW-RAN", "RAN\n"):
        assert word not in shown, word
    own = "\n".join(modules.get(stage, (SOLUTIONS / f"{stage}.py").read_text()) for stage in stages(ASSIGNMENT))
    leaked = hidden_quotes(shown, own)  # (dressed or not: what the redactor sees through, this sees through)
    assert not leaked, f"hidden lines shown to the student: {leaked[:3]}"
    assert "sandbox: container" in found["output"]  # the run's line, written after the boxes were dead
    print(f"\n{entry.name}: {found['score']:g} points in {seconds:.1f} s")


def test_plain_is_refused_unless_allowed(monkeypatch):
    """Where nothing confines (no root, no user namespaces: an unprivileged container), grading stops and
    says what to do; the instructor may allow plain, and then every record and Gradescope say so."""
    from grader.outputs import gradescope
    from grader.sandbox import confinement as sandbox

    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.ConfinementRefused, match="--allow-plain") as refused:
        sandbox.probe()
    assert "nothing was graded" in str(refused.value)
    assert sandbox.probe(allow_plain=True).mode == "plain"
    assert "UNCONFINED" in sandbox.probe(allow_plain=True).summary()
    plain = gradescope.sandbox_entry({"mode": "plain", "missing": ["files", "uid"]})
    assert plain["visibility"] == "hidden" and "UNCONFINED" in plain["name"] and plain["status"] == "failed"
    assert stages(ASSIGNMENT)  # (the assignment exists)


# ---------------------------------------------------------------- nbgrader

def test_nbgrader_autogrades_in_a_container(tmp_path):
    """nbgrader's own autograde, as root in a container: each autograder cell grades its submission with the
    container confinement (the course private to root first), the reference gets full marks and an attack on
    the grader its honest grade."""

    from grader.course.build import build
    from grader.course.samples import write_submission

    root = tmp_path / "course"
    course = build(root, assignments=[ASSIGNMENT])
    run = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", ASSIGNMENT], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    release = root / "release" / ASSIGNMENT
    attack = next(entry for entry in corpus() if entry.name == "reach-the-grader")
    write_submission(by_student("reference"), release, root / "submitted" / "reference" / ASSIGNMENT)
    folder = root / "submitted" / attack.name / ASSIGNMENT
    write_submission(by_student("reference"), release, folder)
    write_modules(folder, replaced=attack.modules(Context(course=root, assignment=ASSIGNMENT, bystanders=())),
                  assignment=ASSIGNMENT)
    tmpdir = Path(tempfile.mkdtemp(prefix="nbgrader-container-", dir="/tmp"))  # (boxes must pass through TMPDIR)
    tmpdir.chmod(0o711)
    try:
        run = in_container([sys.executable, "-m", "nbgrader", "autograde", ASSIGNMENT], cwd=root, timeout=900,
                           env={"TMPDIR": str(tmpdir)})
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    got = scores(course.of(ASSIGNMENT), root / "gradebook.db", ["reference", attack.name])
    assert sum(got["reference"].values()) == pytest.approx(course.of(ASSIGNMENT).total)
    assert got[attack.name] == pytest.approx(expected_scores(course.of(ASSIGNMENT), attack), abs=1e-6)
    record = json.loads((root / "autograded" / attack.name / ASSIGNMENT / "attnkit-grading.json").read_text())
    assert record["confinement"]["mode"] == "container"
