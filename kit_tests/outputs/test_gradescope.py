"""Gradescope's autograder end to end: ``attnkit gradescope`` builds the zip, and its ``run_autograder``
grades a submission laid out as in Gradescope's container into a results.json of Gradescope's format.

The container is a folder (``ATTNKIT_GRADESCOPE_ROOT``): source/ (the unzipped autograder),
submission/, results/. setup.sh is not run: the kit's virtualenv has what it installs (at the versions it
pins), and its python3 comes first on PATH; one run sees nothing else (``image_only/sitecustomize.py``
hides every other installed distribution), to show that what setup.sh installs is enough to grade.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest
from gradescope_results import checks, unzip, validate

from grader.course.samples import by_student
from grader.grading.scoring import stage_score
from grader.grading.worker import grade_folder
from grader.kit import KIT, SOLUTIONS, marker, plan_points, stage_info, stages
from grader.outputs.gradescope import GRADING_NEEDS, ROOT_ENV, check_worth
from grader.sandbox.limits import Limits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

IMAGE_ONLY = Path(__file__).parent.parent / "image_only"


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


def autograder_run(root: Path, sample=None, python: Path | None = None, cwd: Path | None = None,
                   **env) -> subprocess.CompletedProcess:
    """Put ``sample``'s modules (None: nothing) in root/submission/, run the autograder in ``cwd`` (default: root, as
    Gradescope does) with ``python``'s folder first on PATH (default: this interpreter's) and ``env`` in its
    environment."""
    for name in ("submission", "results"):
        shutil.rmtree(root / name, ignore_errors=True)
        (root / name).mkdir()
    if sample is not None:
        sample.write(root / "submission")
    script = root / "source" / "run_autograder"
    assert os.access(script, os.X_OK), "run_autograder must be executable in the zip"
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env, ROOT_ENV: str(root),
           "PATH": f"{Path(python or sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(script)], env=env, cwd=cwd or root, capture_output=True, text=True, timeout=600)


def run_autograder(root: Path, sample=None, python: Path | None = None, cwd: Path | None = None, **env) -> dict:
    """``autograder_run``, which must succeed: its results."""
    done = autograder_run(root, sample, python, cwd, **env)
    path = root / "results" / "results.json"
    assert done.returncode == 0 and path.is_file(), f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    return json.loads(path.read_text())


def failed_run(root: Path, sample=None, python: Path | None = None, **env) -> str:
    """``autograder_run``, which must fail as the grader's failure: no results.json, a non-zero exit. Its log."""
    done = autograder_run(root, sample, python, **env)
    assert done.returncode != 0 and not (root / "results" / "results.json").exists(), done.stdout[-3000:]
    return done.stdout + done.stderr


def image(root: Path) -> dict:
    """The environment of a run that sees only what setup.sh installs (``image_only/sitecustomize.py``)."""
    pinned = [line.split("==")[0] for line in (root / "source" / "requirements.txt").read_text().splitlines()]
    return {"PYTHONPATH": str(IMAGE_ONLY), "ATTNKIT_ONLY_INSTALLED": ",".join(["torch", "attention-kit", *pinned])}


@pytest.fixture(scope="module")
def autograded(container):
    """(assignment, student) -> the results of that sample, graded once by the autograder with nothing installed
    but what setup.sh installs."""
    done = {}

    def grade(assignment, student):
        if (assignment, student) not in done:
            root = container(assignment)
            # Started in a kit checkout (an instructor trying the zip beside their kit): the autograder still
            # imports its own kit, never the working folder's.
            done[assignment, student] = run_autograder(root, by_student(student, assignment), cwd=KIT, **image(root))
        return done[assignment, student]
    return grade


def lost(found: dict) -> set[str]:
    """Markers of the stages some check of which failed (a check is named by its stage's heading, then its own)."""
    by_heading = {stage_info(s).heading: stage_info(s).marker for s in stages()}
    return {by_heading[t["name"].split(" / ")[0]] for t in checks(found) if t["score"] < t["max_score"]}


def test_reference_gets_full_marks(autograded):
    found = autograded("attention", "reference")
    validate(found, "attention")
    assert found["score"] == 100
    assert all(t["status"] == "passed" and t["score"] == t["max_score"] for t in checks(found))
    assert {t["visibility"] for t in checks(found)} == {"visible", "after_published"}  # public and hidden checks


def test_a_mistake_costs_its_stage_only(container, autograded):
    sample = by_student("tril-for-triu")
    found = autograded("attention", "tril-for-triu")
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
    sample.write(container("attention") / "submission")
    graded = grade_folder(container("attention") / "submission", Limits(), stages("attention"))
    points = plan_points(100, None, "attention")
    expected = {stage: stage_score([t for t in graded["tests"] if t["stage"] == stage], points[stage])
                for stage in points}
    assert found["score"] == round(sum(expected.values()), 2)
    for stage, score in expected.items():
        assert f"{stage_info(stage).heading} total: {score:g} of" in "\n".join(t["name"] for t in found["tests"])


def test_a_check_is_worth_the_same_in_every_submission(autograded):
    """What a check is worth does not depend on what passed: Gradescope shows each check's max, and a student
    comparing two submissions must see the same (it once split a stage's hundredths 0.62 / 0.61 by outcome)."""
    worth = [{t["name"]: t["max_score"] for t in checks(autograded("attention", student))}
             for student in ("reference", "tril-for-triu")]
    assert worth[0] == worth[1]
    points = plan_points(100, None, "attention")
    for stage, max_points in points.items():
        mine = [v for name, v in worth[0].items() if name.startswith(f"{stage_info(stage).heading} / ") and v]
        assert set(mine) == {check_worth(max_points, len(mine))}, stage


def test_modern_attention(container):
    sample = by_student("kv-repeat", "modern-attention")
    found = run_autograder(container("modern-attention"), sample)
    validate(found, "modern-attention")
    assert lost(found) == set(sample.breaks)
    assert 0 < found["score"] < 100


def test_setup_installs_what_grading_needs_at_the_versions_tested(container, autograded):
    """setup.sh installs a CPU torch and what grading imports, each at the version this machine has (where the
    kit's tests run), and nothing of the instructor's side (it took 281 s with JupyterLab, nbgrader, Dask and
    matplotlib, and an unpinned torch). The samples above were graded with nothing else to be found."""
    source = container("attention") / "source"
    for script in ("setup.sh", "run_autograder"):
        subprocess.run(["bash", "-n", str(source / script)], check=True)  # setup.sh is not run here
    setup = (source / "setup.sh").read_text()
    torch = distribution("torch").version.split("+")[0]
    assert f"pip install --no-deps torch=={torch} --index-url https://download.pytorch.org/whl/cpu" in setup
    assert "pip install -r requirements.txt" in setup and "pip install --no-deps -e kit/" in setup
    pins = dict(line.split("==") for line in (source / "requirements.txt").read_text().splitlines())
    assert {"numpy", "pytest"} | set(GRADING_NEEDS) - {"torch"} <= set(pins)
    for name, version in pins.items():
        assert distribution(name).version.split("+")[0] == version, name
    assert not set(pins) & {"nbgrader", "jupyterlab", "notebook", "distributed", "dask", "matplotlib", "tqdm"}
    assert autograded("attention", "reference")["score"] == 100  # with only these


def test_an_upload_of_one_folder_or_zip_is_graded_as_its_modules(container, tmp_path):
    """Students drop a folder or a zip on Gradescope: the modules one folder down (or in the zip, at its top or
    one folder down) are graded as if uploaded alone."""
    root = container("attention")
    partial = {stage: (SOLUTIONS / f"{stage}.py").read_text() for stage in ("s01_attention_scores",
                                                                           "s02_normalization")}

    class InAFolder:
        def write(self, dest):
            (Path(dest) / "my work").mkdir()
            for name, text in partial.items():
                (Path(dest) / "my work" / f"{name}.py").write_text(text)
            (Path(dest) / "notes.txt").write_text("a file beside the folder")

    class Zipped:
        def write(self, dest):
            with zipfile.ZipFile(Path(dest) / "attention.zip", "w") as zf:
                for name, text in partial.items():
                    zf.writestr(f"attention/{name}.py", text)
                    zf.writestr(f"__MACOSX/attention/._{name}.py", "resource fork")

    points = plan_points(100, None, "attention")
    for upload in (InAFolder(), Zipped()):
        found = run_autograder(root, upload)
        validate(found, "attention")
        assert found["score"] == round(points["s01_attention_scores"] + points["s02_normalization"], 2), \
            found["output"]
        assert lost(found) == {marker(stage) for stage in points} - {"attention_scores", "normalization"}


def test_an_upload_without_the_modules_is_told_what_to_upload(container):
    """Score 0 and what to upload, never "tell your instructor": the student can put it right."""
    root = container("attention")
    solutions = root / "source" / "kit" / "solutions"
    reference = {stage: (SOLUTIONS / f"{stage}.py").read_text() for stage in stages("attention")}

    def uploaded(**files):
        class Upload:
            def write(self, dest):
                for name, what in files.items():
                    path = Path(dest) / name.replace("__", "/")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if isinstance(what, Path):
                        path.symlink_to(what, target_is_directory=what.is_dir())
                    else:
                        path.write_text(what)
        found = run_autograder(root, Upload())
        assert found["score"] == 0 and found["tests"] == [], found["output"]
        assert found["output"].startswith("Nothing was graded: ") and "instructor" not in found["output"]
        assert "upload the modules themselves (s01_attention_scores.py, s02_normalization.py" in found["output"]
        return found["output"]

    assert "(the upload was empty)" in uploaded()
    said = uploaded(**{"notes.txt": "x", "m01_pytorch_attention.py": "x"})
    assert "m01_pytorch_attention.py belongs to the modern-attention assignment" in said
    assert "(uploaded: m01_pytorch_attention.py, notes.txt)" in said
    assert "no stage module" in uploaded(solutions=solutions)  # a link to the solutions is not followed
    said = uploaded(**{"a__s01_attention_scores.py": reference["s01_attention_scores"],
                       "b__s01_attention_scores.py": reference["s01_attention_scores"]})
    assert "the stage modules are in 2 places (a/, b/): upload one set" in said
    assert "no stage module" in uploaded(**{"broken.zip": "PK not really a zip",
                                            "two__deep__s01_attention_scores.py": "two folders down"})


def test_a_broken_autograder_reports_a_failure_never_a_score(container):
    """A broken image (here: its settings) is the instructor's to mend: no results.json, so that Gradescope shows an
    autograder failure to the student and the staff instead of a score; the reason is in the autograder's log."""
    root = container("attention")
    settings = root / "source" / "attnkit-gradescope.json"
    kept = settings.read_text()
    try:
        settings.write_text("{ cut short")
        said = failed_run(root, by_student("reference"))
    finally:
        settings.write_text(kept)
    assert "JSONDecodeError" in said and "not the student's work" in said, said[-3000:]


def test_a_broken_image_reports_a_failure_never_a_score(container, tmp_path):
    broken = tmp_path / "python3"  # e.g. setup.sh failed: the interpreter does not even start
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    said = failed_run(container("attention"), by_student("reference"), python=broken)
    assert "the autograder failed (exit status 3)" in said, said


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
