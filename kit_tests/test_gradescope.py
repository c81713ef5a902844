"""Gradescope's autograder end to end: ``attnkit gradescope`` builds the zip, and its ``run_autograder``
grades a submission laid out as in Gradescope's container into a results.json of Gradescope's format.

The container is a folder (``ATTNKIT_GRADESCOPE_ROOT``): source/ (the unzipped autograder),
submission/, results/. setup.sh is not run: the kit's virtualenv has what it installs, and its python3
comes first on PATH.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from grader.cells import grade_folder
from grader.course import plan_points
from grader.gradescope import ROOT_ENV
from grader.kit import marker, stages
from grader.samples import by_student
from grader.sandbox import Limits
from grader.scoring import stage_score

pytestmark = pytest.mark.slow

ROOT_KEYS = {"score", "output", "visibility", "stdout_visibility", "tests"}
TEST_KEYS = {"name", "score", "max_score", "output", "visibility", "status"}
VISIBILITIES = {"visible", "hidden", "after_due_date", "after_published"}
TOLERANCE = 1e-6  # scores are whole hundredths; sums of them in floating point differ by less


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    """assignment -> a Gradescope container folder with that assignment's autograder unzipped in source/."""
    made = {}

    def make(assignment):
        if assignment not in made:
            where = tmp_path_factory.mktemp(f"gradescope-{assignment}")
            out = where / "autograder.zip"
            subprocess.run([sys.executable, "-m", "grader.cli", "gradescope", assignment, "--out", str(out)],
                           check=True, capture_output=True, text=True)
            root = where / "autograder"
            unzip(out, root / "source")
            made[assignment] = root
        return made[assignment]
    return make


def unzip(archive: Path, dest: Path):
    """Extract like unzip does: with the modes the zip records (zipfile alone drops them)."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            path = Path(zf.extract(info, dest))
            mode = info.external_attr >> 16 & 0o777
            if mode:
                path.chmod(mode)


def run_autograder(root: Path, sample=None, python: Path | None = None) -> dict:
    """Put ``sample``'s modules (None: nothing) in root/submission/, run the autograder with ``python``'s
    folder first on PATH (default: this interpreter's), read its results."""
    for name in ("submission", "results"):
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).mkdir()
    if sample is not None:
        sample.write(root / "submission")
    script = root / "source" / "run_autograder"
    assert os.access(script, os.X_OK), "run_autograder must be executable in the zip"
    env = dict(os.environ, **{ROOT_ENV: str(root)},
               PATH=f"{Path(python or sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(script)], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    path = root / "results" / "results.json"
    assert path.is_file(), f"no results.json; stdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    return json.loads(path.read_text())


def checks(found: dict) -> list[dict]:
    return [t for t in found["tests"] if "max_score" in t]


def validate(found: dict, assignment: str):
    """results.json has Gradescope's shape, and its scores add up: per check, per stage, in all."""
    assert set(found) <= ROOT_KEYS and {"score", "tests"} <= set(found), sorted(found)
    assert isinstance(found["score"], (int, float)) and isinstance(found["tests"], list)
    for t in found["tests"]:
        assert set(t) <= TEST_KEYS and isinstance(t["name"], str) and t["name"], t
        assert t.get("visibility", "visible") in VISIBILITIES, t
        assert isinstance(t.get("output", ""), str), t
        if "max_score" in t:
            assert isinstance(t["score"], (int, float)) and isinstance(t["max_score"], (int, float)), t
            assert 0 <= t["score"] <= t["max_score"] + TOLERANCE, t
    points = plan_points(100, None, assignment)
    assert abs(sum(t["max_score"] for t in checks(found)) - 100) < TOLERANCE
    assert abs(sum(t["score"] for t in checks(found)) - found["score"]) < TOLERANCE
    for stage, max_points in points.items():
        title = f": {marker(stage)} "
        mine = [t for t in checks(found) if title in t["name"]]
        assert mine, f"no checks of {stage} in results.json"
        assert abs(sum(t["max_score"] for t in mine) - max_points) < TOLERANCE, stage
        totals = [t for t in found["tests"] if title in t["name"] and "total:" in t["name"]]
        assert len(totals) == 1 and "score" not in totals[0], totals  # unscored: no point counted twice
        assert f"{round(sum(t['score'] for t in mine), 2):g} of {max_points:g} points" in totals[0]["name"]


def lost(found: dict) -> set[str]:
    """Markers of the stages some check of which failed."""
    return {t["name"].split(": ")[1].split(" / ")[0] for t in checks(found) if t["score"] < t["max_score"]}


def test_reference_gets_full_marks(container):
    found = run_autograder(container("attention"), by_student("reference"))
    validate(found, "attention")
    assert found["score"] == 100
    assert all(t["status"] == "passed" and t["score"] == t["max_score"] for t in checks(found))
    assert {t["visibility"] for t in checks(found)} == {"visible", "after_published"}  # public and hidden checks


def test_a_mistake_costs_its_stage_only(container):
    sample = by_student("tril-for-triu")
    found = run_autograder(container("attention"), sample)
    validate(found, "attention")
    assert lost(found) == set(sample.breaks) == {"causal_mask"}
    assert found["score"] < 100
    failed = [t for t in checks(found) if t.get("status") == "failed"]
    assert failed and all(t["score"] == 0 and t["output"].strip() for t in failed)
    for visibility in ("visible", "after_published"):  # public and hidden checks name the mistake
        diagnosed = [t for t in failed if t["visibility"] == visibility and "Likely mistake: the mask hides the past"
                     in t["output"]]
        assert diagnosed, f"no {visibility} failed check of causal_mask names the mistake"
    for t in failed:  # the diagnosis, never test code
        assert "def test_" not in t["output"] and "assert " not in t["output"], t["output"]
    passed = [t for t in checks(found) if t.get("status") == "passed"]
    assert all(t["score"] == t["max_score"] > 0 for t in passed)
    # The same grades as the kit's own grading (attnkit grade, the autograder cells) gives this submission.
    graded = grade_folder(container("attention") / "submission", Limits(), stages("attention"))
    points = plan_points(100, None, "attention")
    expected = {stage: stage_score([t for t in graded["tests"] if t["stage"] == stage], points[stage])
                for stage in points}
    assert found["score"] == round(sum(expected.values()), 2)
    for stage, score in expected.items():
        assert f"{marker(stage)} total: {score:g} of" in "\n".join(t["name"] for t in found["tests"])


def test_modern_attention(container):
    sample = by_student("kv-repeat", "modern-attention")
    found = run_autograder(container("modern-attention"), sample)
    validate(found, "modern-attention")
    assert lost(found) == set(sample.breaks)
    assert 0 < found["score"] < 100


def test_the_scripts_parse_and_install_a_cpu_torch(container):
    source = container("attention") / "source"
    for script in ("setup.sh", "run_autograder"):
        subprocess.run(["bash", "-n", str(source / script)], check=True)  # setup.sh is not run here
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in (source / "setup.sh").read_text()


def test_an_ungradable_submission_still_gets_results(container):
    found = run_autograder(container("attention"))  # nothing uploaded
    assert found["score"] == 0 and found["tests"] == []
    assert "could not be graded" in found["output"]


def test_a_broken_image_still_gets_results(container, tmp_path):
    broken = tmp_path / "python3"  # e.g. setup.sh failed: the interpreter does not even start
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    found = run_autograder(container("attention"), by_student("reference"), python=broken)
    assert found["score"] == 0 and found["tests"] == []
    assert "failed before grading (exit status 3)" in found["output"]


def test_learner_code_cannot_see_the_autograder(container):
    """The image holds the solutions and hidden fixtures, which grading needs; the box must not see them."""
    root = container("attention")
    secrets = [root / "source" / "kit" / "fixtures" / "hidden", root / "source" / "kit" / "solutions"]
    assert all(any(p.iterdir()) for p in secrets)
    reference = by_student("reference")
    spy = ("import os\n"
           f"if any(os.path.exists(p) for p in {[str(p) for p in secrets]!r}):\n"
           "    raise ImportError('this module can see the autograder')\n")

    class Spying:
        def write(self, dest):
            reference.write(dest)
            first = sorted(Path(dest).glob("s01_*.py"))[0]
            first.write_text(spy + first.read_text())

    found = run_autograder(root, Spying())
    assert found["score"] == 100, found["output"]
