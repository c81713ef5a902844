"""Course content is data: each assignment's record and files agree with the kit's flat folders, every demo runs,
no prose count goes stale, the engine names no stage, and a new stage or a new assignment needs only the files the
README lists (in a copy of the kit: a toy stage and a toy assignment are built into a course and graded)."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grader.authoring.fixtures import generators
from grader.course.notebook import in_words, prose
from grader.kit import KIT, SOLUTIONS, SUITE, assignments, stage_info, stages
from suite_runtime.stage_names import module_files, stage_test_file

STAGES = stages()


@pytest.mark.parametrize("name", list(assignments()))
def test_each_record_lists_the_stage_modules_of_its_letter_in_order(name):
    a = assignments()[name]
    found = [p.stem for p in module_files(SOLUTIONS) if p.stem[0] == a.letter]
    assert a.modules == found, f"{a.folder / 'assignment.toml'} lists {a.modules}; solutions/ holds {found}"
    assert a.title.strip() and a.intro.strip() and a.outro.strip()
    assert all(s.title.strip() and s.points > 0 for s in a.stages)


def test_every_solution_belongs_to_an_assignment():
    assert sorted(p.stem for p in module_files(SOLUTIONS)) == sorted(STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_has_a_lesson_a_demo_a_fixture_generator_and_a_test_file_marked_with_its_stage(stage):
    info = stage_info(stage)
    a = assignments()[info.assignment]
    lesson = a.lesson(stage)
    assert len(lesson.split()) > 40 and not lesson.lstrip().startswith("#"), (
        f"lessons/{stage}.md: the lesson's text (its title is the record's)")
    demo = ast.parse(a.demo(stage).read_text())
    assert stage in {node.module for node in ast.walk(demo) if isinstance(node, ast.ImportFrom)}, (
        f"demos/{stage}.py must import the stage module it shows")
    found, none = generators()
    assert stage in found or stage in none
    tree = ast.parse((SUITE / stage_test_file(stage)).read_text())
    marks = [ast.unparse(node.value) for node in tree.body
             if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)]
    assert marks == [f"pytest.mark.{info.marker}"], f"{stage_test_file(stage)}: pytestmark = pytest.mark.{info.marker}"


def test_the_suite_registers_every_stage_s_marker_from_its_test_files():
    run = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"], cwd=KIT,
                         capture_output=True, text=True, timeout=120)
    registered = re.findall(r"^@pytest\.mark\.(\w+):", run.stdout, flags=re.M)
    assert sorted(m for m in registered if m in {stage_info(s).marker for s in STAGES}) == \
        sorted(stage_info(s).marker for s in STAGES), run.stdout[-2000:]


# Every demo in one interpreter (torch imported once), each as a script of its own (runpy), with the solutions
# importable the way a notebook's folder of stage modules is.
RUN_DEMOS = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    print(f"=== {path}", flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def test_every_demo_runs_against_the_solutions():
    demos = [str(assignments()[stage_info(s).assignment].demo(s)) for s in STAGES]
    run = subprocess.run([sys.executable, "-c", RUN_DEMOS, str(SOLUTIONS), *demos], capture_output=True, text=True,
                         timeout=300, cwd=KIT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    printed = run.stdout.split("=== ")[1:]
    assert len(printed) == len(demos) and all(len(part.splitlines()) > 1 for part in printed), run.stdout
    assert " False" not in run.stdout, f"a demo shows a check that does not hold:\n{run.stdout}"


def test_prose_computes_its_counts():
    assert [in_words(n) for n in (1, 7, 11, 21)] == ["one", "seven", "eleven", "21"]
    for a in assignments().values():
        for text in (a.intro, a.outro):
            said = prose(text, a)
            assert "{{" not in said and "{%" not in said
            for number in range(2, 21):  # a count in words is the number of stages, or no count of them
                if re.search(rf"\b{in_words(number)} (small steps|stage modules)\b", said):
                    assert number == len(a.stages), (a.name, said)


def test_the_engine_names_no_stage():
    """grader/ holds no stage module's name: it reads the stages from assignments/."""
    names = set(STAGES)
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    found = [f"{path.relative_to(KIT)}:{number}: {match.group(1)}"
             for path in sorted((KIT / "grader").rglob("*")) if path.is_file() and path.suffix in (".py", ".j2", ".md")
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             for match in pattern.finditer(line)]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- a new stage, a new assignment

TOY_SOLUTION = '''"""Toy stage: {what}."""
import torch


def {function}(queries, keys):
    """{doc} queries (n, d), keys (m, d) -> (n, m)."""
    # {todo}
    ### BEGIN SOLUTION
    return {code}
    ### END SOLUTION
'''
TOY_TEST = '''"""The toy stage {stage}: {what}."""
import pytest

from diagnosis import assert_close

pytestmark = pytest.mark.{marker}


@pytest.mark.public
def test_the_public_example(stage, public_fx):
    assert_close("{function}", stage.{function}(public_fx.queries, public_fx.keys), public_fx.expected)


def test_other_sizes(stage, hidden_fx):
    assert_close("{function}", stage.{function}(hidden_fx.queries, hidden_fx.keys), hidden_fx.expected)
'''
TOY_GENERATOR = '''

def {stage}(ref, public, hidden):
    for out, seed, (n, m, d) in ((public, 1, (2, 3, 4)), (hidden, 2, (5, 6, 8))):
        r = rng(seed)
        queries = out.add("queries", r.normal(size=(n, d)), "queries (n, d)")
        keys = out.add("keys", r.normal(size=(m, d)), "keys (m, d)")
        out.add("expected", ref.stage("{stage}").{function}(queries, keys), "{what}")
'''
TOY_DEMO = '''"""Demo of the toy stage: {what}."""
import torch
from {stage} import {function}

print("{what}:", {function}(torch.ones(2, 4), torch.ones(3, 4)))
'''
TOYS = {  # assignment -> (stage module, what it computes, the function, its code)
    "modern-attention": ("m08_toy_scaled_scores", "scores scaled by sqrt(d_k)", "scaled_scores",
                         "queries @ keys.T / keys.shape[-1] ** 0.5"),
    "toy": ("t01_toy_raw_scores", "raw dot-product scores", "raw_scores", "queries @ keys.T"),
}
TOY_RECORD = '''name = "toy"
letter = "t"
title = "A toy assignment"
intro = """
# A toy assignment

Your {{ stages | length | in_words }} stage module: `{{ stages[0].module }}.py`.
"""
outro = """
Submit your {{ stages | length | in_words }} stage module.
"""
'''
STAGE_ENTRY = '\n[[stages]]\nmodule = "{stage}"\ntitle = "{title}"\npoints = 10\n'


def add_stage(kit: Path, assignment: str, fresh: bool = False):
    """The files the README lists for a new stage: its solution, its test file, its lesson and demo, its fixture
    generator, and its entry in the assignment's record (and, for a new assignment, the record itself)."""
    stage, what, function, code = TOYS[assignment]
    marker = stage.split("_", 1)[1]
    folder = kit / "assignments" / assignment
    words = dict(stage=stage, what=what, function=function, marker=marker, code=code,
                 doc=f"The {what} of every query against every key.", todo=f"Compute the {what}.")
    (kit / "solutions" / f"{stage}.py").write_text(TOY_SOLUTION.format(**words))
    (kit / "tests" / f"test_{stage}.py").write_text(TOY_TEST.format(**words))
    (folder / "lessons").mkdir(parents=True, exist_ok=True)
    (folder / "demos").mkdir(exist_ok=True)
    (folder / "lessons" / f"{stage}.md").write_text(f"This toy stage computes the {what}. " * 20 + "\n")
    (folder / "demos" / f"{stage}.py").write_text(TOY_DEMO.format(**words))
    fixtures = folder / "fixtures.py"
    head = "from grader.authoring.fixtures import rng\n" if fresh else fixtures.read_text()
    fixtures.write_text(head + TOY_GENERATOR.format(**words))
    record = folder / "assignment.toml"
    entry = STAGE_ENTRY.format(stage=stage, title=what.capitalize())
    record.write_text((TOY_RECORD if fresh else record.read_text()) + entry)


@pytest.mark.slow
@pytest.mark.timeout(600)  # (a whole grading: seconds idle, minutes on a loaded machine)
def test_a_new_stage_and_a_new_assignment_need_only_their_own_files(tmp_path):
    kit = tmp_path / "kit"
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.egg-info")
    for name in ("grader", "tests", "solutions", "exercises", "fixtures", "assignments"):
        shutil.copytree(KIT / name, kit / name, ignore=ignore)
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copyfile(KIT / name, kit / name)
    add_stage(kit, "modern-attention")
    add_stage(kit, "toy", fresh=True)
    env = dict(os.environ, PYTHONPATH=f"{kit}{os.pathsep}{kit / 'tests'}")

    def attnkit(*args):
        run = subprocess.run([sys.executable, "-m", "grader.cli", *map(str, args)], cwd=kit, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"attnkit {' '.join(map(str, args))}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        return run.stdout

    attnkit("stubs")
    attnkit("fixtures")
    course = tmp_path / "course"
    said = attnkit("course", "build", course, "--assignment", "modern-attention", "--assignment", "toy")
    assert "m08_toy_scaled_scores" in said and "t01_toy_raw_scores" in said
    notebook = json.loads((course / "source" / "toy" / "toy.ipynb").read_text())
    text = "".join("".join(cell["source"]) for cell in notebook["cells"])
    assert "Your one stage module: `t01_toy_raw_scores.py`" in text and "Stage 1: Raw dot-product scores" in text
    for assignment, (stage, *_) in TOYS.items():
        submissions = tmp_path / assignment
        for student, base in (("solution", "solutions"), ("stub", "exercises")):
            for path in (kit / base).glob(f"{stage[0]}[0-9][0-9]_*.py"):
                (submissions / student).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, submissions / student / path.name)
        attnkit("grade", assignment, "--course", course, "--submissions", submissions, "--out", tmp_path / "grades" /
                assignment, "--quiet")
        records = {s: json.loads((tmp_path / "grades" / assignment / f"{s}.json").read_text())
                   for s in ("solution", "stub")}
        points = {s: {entry["stage"]: (entry["points"], entry["max_points"]) for entry in r["stages"]}
                  for s, r in records.items()}
        assert points["solution"][stage][0] == points["solution"][stage][1] > 0, points["solution"]
        assert records["solution"]["total"] == records["solution"]["max_total"], points["solution"]
        assert points["stub"][stage][0] == 0 and records["stub"]["total"] == 0, points["stub"]


def test_the_readme_s_counts_stage_tables_and_lists_are_the_records():
    """The README's counts of assignments and stages, its table of each assignment's stages, and its lists of the
    assignments and of their stage modules are those of the records (a stage or an assignment added, the README
    follows or this fails)."""
    readme = (KIT / "README.md").read_text()
    records = assignments()
    assert f"attention-kit teaches attention in {in_words(len(records))} assignments." in readme
    paragraphs = re.split(r"\n\s*\n|\n(?=\|)", readme)  # (a table's rows one by one)
    for a in records.values():
        said = re.search(rf"`{a.name}`,?\s[^.]*?\sin\s(\w+)\sstages", readme)
        assert said and said.group(1) == in_words(len(a.stages)), (a.name, said and said.group())
        rows = re.findall(rf"^\| (\d+) \| `({a.letter}\d\d_\w+)` \|", readme, flags=re.M)
        assert rows == [(str(s.number), s.module) for s in a.stages], f"the README's table of {a.name}'s stages"
    letters = {f"`{a.letter}NN_*.py`" for a in records.values()}
    for paragraph in paragraphs:  # where the README lists stage modules by their letter, it lists every letter
        listed = set(re.findall(r"`[a-z]NN_\*\.py`", paragraph))
        assert not listed or listed == letters, paragraph
    for command in ("| `attnkit course build DIR` |", "| `attnkit demo [--dir DIR] [--nbgrader ASSIGNMENT] [--all]` |"):
        row = next(line for line in readme.splitlines() if line.startswith(command))
        assert all(f"`{name}`" in row for name in records), row
