"""The course's choice for the kernels' speed checks that cannot run where grading runs (no GPU): ``attnkit course
build --speed-checks skip|count`` keeps it in attnkit-course.json, and every grading path gives it to the grading
worker's pytest (``attnkit grade``, the autograder cells, Gradescope's autograder). Under "count" the kernels
reference loses exactly its speed checks' points on every stage; under "skip" it gets full marks."""
from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from grader import cli
from grader.course import cells
from grader.course.build import build
from grader.course.samples import by_student
from grader.course.settings import MARKER_FILE, Course
from grader.course.targets import course_folder_target, course_target
from grader.errors import CourseError
from grader.grading import records as R
from grader.grading.worker import WorkerProcess, pytest_args
from grader.kit import KIT, stages
from grader.outputs import gradescope
from grader.sandbox.limits import Limits
from runs import attnkit
from suite_runtime import SPEED_CHECK_POLICIES


def speed_option(args: list[str]) -> list[str]:
    return [arg for arg in args if arg.startswith("--speed-checks")]


def test_the_suite_and_the_root_conftest_know_the_same_choices():
    """The root conftest cannot import suite_runtime in a student's folder, so it repeats the list: the same one."""
    spec = importlib.util.spec_from_file_location("kit_root_conftest", KIT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    options = {}

    class Parser:
        def addoption(self, name, **kwargs):
            options[name] = kwargs

        def addini(self, *args, **kwargs):
            pass

    conftest.pytest_addoption(Parser())
    assert tuple(options["--speed-checks"]["choices"]) == SPEED_CHECK_POLICIES
    assert SPEED_CHECK_POLICIES[0] == "skip", "skip is every default: it must come first"


def test_a_course_built_to_count_them_says_so_to_every_grading_path(tmp_path, monkeypatch):
    root = tmp_path / "course"
    attnkit("course", "build", str(root), "--assignment", "kernels", "--speed-checks", "count")
    assert json.loads((root / MARKER_FILE).read_text())["speed_checks"] == "count"
    course = Course.load(root)
    assert course.speed_checks == "count"
    # attnkit grade, of the course's submissions or of a folder graded on its points
    assert course_target(root, "kernels").speed_checks == "count"
    (tmp_path / "submissions").mkdir()
    assert course_folder_target(course, tmp_path / "submissions", tmp_path / "out", "kernels").speed_checks == "count"
    # the grading worker's pytest, one word per option
    assert speed_option(pytest_args(tmp_path)) == ["--speed-checks=skip"]
    assert speed_option(pytest_args(tmp_path, course.speed_checks)) == ["--speed-checks=count"]
    # nbgrader's autograder cells: the first one grades with the course's choice
    notebook = json.loads((root / "source" / "kernels" / "kernels.ipynb").read_text())
    calls = [line for cell in notebook["cells"] for line in "".join(cell["source"]).splitlines()
             if line.startswith("grading = Grading(")]
    assert calls == ["grading = Grading('kernels', test_timeout=10.0, speed_checks='count')"]
    asked = {}

    def grade_folder(folder, limits, graded_stages, **options):
        asked.update(options)
        return {"fingerprint": "", "seed": 0, "tests": []}

    monkeypatch.setattr(cells, "grade_folder", grade_folder)
    monkeypatch.chdir(tmp_path / "submissions")
    exec(f"from grader.course.cells import Grading\n{calls[0]}", {})  # the cell, as nbgrader runs it
    assert asked["speed_checks"] == "count"
    # Rebuilt without the option: the default, and the cells are written as before the setting existed.
    build(root, assignments=["kernels"])
    assert Course.load(root).speed_checks == "skip"
    notebook = json.loads((root / "source" / "kernels" / "kernels.ipynb").read_text())
    assert "speed_checks" not in json.dumps(notebook)


def test_a_choice_that_is_neither_is_refused_saying_the_two(tmp_path, capsys):
    with pytest.raises(CourseError, match=r"speed_checks must be 'skip' or 'count', not 'fast': \"skip\" leaves"):
        build(tmp_path / "course", assignments=["kernels"], speed_checks="fast")
    assert not (tmp_path / "course" / MARKER_FILE).exists()
    with pytest.raises(SystemExit):
        cli.main(["course", "build", str(tmp_path / "course"), "--speed-checks", "fast"])
    assert "invalid choice: 'fast' (choose from 'skip', 'count')" in capsys.readouterr().err
    # A hand-edited course file: said when the course is read, not by a grading worker that cannot start.
    build(tmp_path / "course", assignments=["kernels"])
    marker = tmp_path / "course" / MARKER_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "speed_checks": "always"}))
    with pytest.raises(CourseError, match="speed_checks must be 'skip' or 'count', not 'always'"):
        Course.load(tmp_path / "course")
    with pytest.raises(ValueError, match="speed_checks must be one of skip, count"):
        WorkerProcess(Limits(), speed_checks="always")


def test_gradescope_takes_the_course_s_choice_unless_told(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(gradescope, "build_zip", lambda out, name, *args: built.append(args[-1]) or Path(cli.__file__))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["gradescope", "kernels"]) == 0 and built == ["skip"]  # no course here
    build(tmp_path / "course", assignments=["kernels"], speed_checks="count")
    monkeypatch.chdir(tmp_path / "course")
    assert cli.main(["gradescope", "kernels"]) == 0 and built[-1] == "count"
    assert cli.main(["gradescope", "kernels", "--speed-checks", "skip"]) == 0 and built[-1] == "skip"


def test_gradescope_s_autograder_keeps_the_choice_and_grades_with_it(tmp_path, monkeypatch):
    out = gradescope.build_zip(tmp_path / "autograder.zip", "kernels", speed_checks="count")
    settings = json.loads(zipfile.ZipFile(out).read(gradescope.SETTINGS))
    assert settings["speed_checks"] == "count"
    # run_autograder's run() hands it to the grading worker
    asked = {}

    def grade_folder(folder, limits, graded_stages, **options):
        asked.update(options)
        raise RuntimeError("stop here")

    monkeypatch.setattr(gradescope, "grade_folder", grade_folder)
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    (tmp_path / "submission").mkdir()
    for stage in stages("kernels"):
        (tmp_path / "submission" / f"{stage}.py").write_text("")
    with pytest.raises(gradescope.GraderFailed, match="stop here"):
        gradescope.run(tmp_path, tmp_path / "settings.json")
    assert asked["speed_checks"] == "count"


@pytest.mark.slow
@pytest.mark.timeout(600)  # two gradings of the kernels in Triton's interpreter: 24 s idle, over 120 s at a load of 10
def test_the_kernels_reference_loses_exactly_its_speed_checks_under_count(tmp_path):
    """``attnkit grade`` of a folder on a course's points (no GPU here: every speed check cannot run), once with the
    course's "count", once told "skip"."""
    course = tmp_path / "course"
    build(course, assignments=["kernels"], speed_checks="count")
    by_student("reference", "kernels").write(tmp_path / "submissions" / "reference")
    found = {}
    for told in ([], ["--speed-checks", "skip"]):
        out = tmp_path / f"grades{len(found)}"
        (tmp_path / f"tmp{len(found)}").mkdir()
        attnkit("grade", "kernels", "--submissions", str(tmp_path / "submissions"), "--out", str(out),
                "--course", str(course), "--quiet", *told, tmpdir=tmp_path / f"tmp{len(found)}")
        found["skip" if told else "count"] = R.read_records(out)["reference"]
    for stage in found["count"]["stages"]:
        failed = [t["nodeid"].split("::")[1] for t in stage["tests"] if t["outcome"] == "failed"]
        assert failed == [f"test_speed[cuda-{f}x]" for f in ("0.25", "0.5", "0.8")], stage["stage"]
        assert all("This course counts speed checks that cannot run as failed" in t["message"]
                   for t in stage["tests"] if t["outcome"] == "failed")
        assert stage["passed"] == stage["counted"] - 3 and stage["passed"] > 0
        assert stage["points"] == pytest.approx(stage["max_points"] * stage["passed"] / stage["counted"], abs=0.01)
    assert found["count"]["total"] < found["count"]["max_total"]
    assert found["skip"]["total"] == found["skip"]["max_total"]
    skipped = [t for s in found["skip"]["stages"] for t in s["tests"] if "test_speed" in t["nodeid"]]
    assert len(skipped) == 3 * len(stages("kernels")) and all(t["outcome"] == "skipped" for t in skipped)
