"""The kit checks itself: stubs in sync with solutions, fixtures reproducible, suites well formed."""
import ast
import json
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import numpy as np
import pytest

from grader.authoring.fixtures import REGENERATED, generate
from grader.authoring.stubs import out_of_sync
from grader.kit import EXERCISES, FIXTURES, KIT, SOLUTION_BEGIN, SOLUTIONS, SUITE, stages


def test_exercises_are_generated_from_the_solutions():
    stale = out_of_sync()
    assert not stale, f"exercises/ is out of sync with solutions/ for {stale}: run `attnkit stubs` and commit"


@pytest.mark.parametrize("stage", stages())
def test_stub_keeps_no_solution_and_raises_with_its_stage_name(stage):
    text = (EXERCISES / f"{stage}.py").read_text()
    assert SOLUTION_BEGIN not in text
    compile(text, f"{stage}.py", "exec")
    raises = [node.exc.args[0].value for node in ast.walk(ast.parse(text))
              if isinstance(node, ast.Raise) and getattr(node.exc, "func", None)
              and getattr(node.exc.func, "id", "") == "NotImplementedError"]
    assert raises and all(r.startswith(f"{stage}: ") for r in raises)
    assert len(raises) == (SOLUTIONS / f"{stage}.py").read_text().count(SOLUTION_BEGIN)


def test_fixtures_regenerate_to_the_committed_values(tmp_path):
    manifest = generate(tmp_path)
    committed = json.loads((FIXTURES / "manifest.json").read_text())
    assert manifest["files"] == committed["files"], (
        "fixture names, shapes or descriptions changed: run `attnkit fixtures`")
    for name in manifest["files"]:
        with np.load(FIXTURES / name, allow_pickle=False) as old, np.load(tmp_path / name, allow_pickle=False) as new:
            assert sorted(old.files) == sorted(new.files), name
            for key in old.files:
                assert old[key].dtype == new[key].dtype, f"{name}:{key}"
                np.testing.assert_allclose(new[key], old[key], **REGENERATED, err_msg=f"{name}:{key}")


def test_fixtures_rewrite_only_what_changed(tmp_path, monkeypatch):
    """`attnkit fixtures --stage S` regenerates S alone and leaves a file whose arrays are the same within float noise
    as it was (byte for byte); a generator that changes writes its files, and the manifest keeps every other stage."""
    import shutil

    import grader.authoring.fixtures as F

    shutil.copytree(FIXTURES, tmp_path / "fixtures")
    out = tmp_path / "fixtures"
    before = {p: p.read_bytes() for p in out.rglob("*.npz")}
    manifest = generate(out, ["s06_causal_mask"])
    assert manifest["written"] == [] and sorted(manifest["kept"]) == ["hidden/s06_causal_mask.npz",
                                                                       "public/s06_causal_mask.npz"]
    assert {p: p.read_bytes() for p in out.rglob("*.npz")} == before
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == set(
        json.loads((FIXTURES / "manifest.json").read_text())["files"])
    found, none = F.generators()
    original = found["s06_causal_mask"]

    def changed(ref, public, hidden):
        original(ref, public, hidden)
        hidden.add("d_k", np.asarray(5), "key dimension")  # another value: a real change

    monkeypatch.setattr(F, "generators", lambda: ({**found, "s06_causal_mask": changed}, none))
    assert generate(out, ["s06_causal_mask"])["written"] == ["hidden/s06_causal_mask.npz"]


def test_manifest_describes_every_stored_array():
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    stored = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.npz"))
    assert stored == sorted(manifest["files"])
    for name, arrays in manifest["files"].items():
        with np.load(FIXTURES / name, allow_pickle=False) as data:
            assert sorted(data.files) == sorted(arrays)
            for key, meta in arrays.items():
                assert list(data[key].shape) == meta["shape"] and str(data[key].dtype) == meta["dtype"]
                assert meta["description"]
    assert manifest["torch"] and manifest["generator"]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (KIT / "README.md").read_text()
    commands = re.findall(r"^```(?:bash|sh)\n(.*?)\n```", readme, flags=re.S | re.M)
    assert len(commands) >= 2, "the README opens with two commands: setup + demo, setup + tests"
    test_command = commands[1].strip()
    ci = (KIT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), f".ci/run must run the README's test command: {test_command}"


def test_an_assignment_says_which_of_its_packages_are_missing(monkeypatch):
    """What the demo leaves an assignment out for (and says what to install): a requirement not installed, or
    installed at a version it excludes; none for one installed as required."""
    from dataclasses import replace

    from grader import kit

    kernels = kit.assignment("kernels")
    assert kernels.missing() == []  # (the test extra's Python has Triton)
    wanting = replace(kernels, requires=("triton>=3.9", "no-such-distribution>=1", "numpy<1"))
    assert wanting.missing() == ["no-such-distribution>=1", "numpy<1"]


def module_name(path: Path) -> str:
    """The dotted name of a module of the grader or of the graded suite's packages: grader/sandbox/limits.py ->
    grader.sandbox.limits, tests/suite_runtime/adapters.py -> suite_runtime.adapters, tests/conftest.py -> conftest."""
    parts = path.relative_to(SUITE if path.is_relative_to(SUITE) else KIT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The modules a file imports, anywhere in it, as absolute names (relative ones resolved, for a module of the
    grader or of the suite's packages; ``from . import x`` names the module x)."""
    found = set()
    package = module_name(path).split(".")
    if package and path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[:len(package) - node.level + 1])
            if node.module:
                found.add(f"{base}.{node.module}")
            else:
                found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
    return found


def test_the_graded_suite_never_imports_the_grader():
    """Students get tests/ without the grader: the suite stands alone, and the grader plugs into it
    through its hook (pytest_attnkit_backend), never the other way round."""
    forbidden = {"grader"} | {p.stem for p in Path(__file__).parent.rglob("*.py")}  # and the kit's own tests
    for path in sorted(SUITE.rglob("*.py")) + [KIT / "conftest.py"]:
        reached = {name.split(".")[0] for name in imported(path)} & forbidden
        assert not reached, f"{path.name} imports {sorted(reached)}"


# The graded suite's layers, lowest first (tests/: each a package but the last): its runtime (stage names, the
# adapter, the random cases), the diagnosis engine, its pytest plugin, then the conftest and the stage test files.
SUITE_LAYERS = {"runtime": "suite_runtime", "diagnosis": "diagnosis", "plugin": "suite_plugin"}
# What the grader may import of the suite: the stage names and the adapter (a grading box holds copies of those
# two, with the package's __init__: grader/sandbox/template.py), the random cases (the fixture generators).
GRADER_READS = {"suite_runtime", "suite_runtime.stage_names", "suite_runtime.adapters", "suite_runtime.cases"}
BOX_HOLDS = {"suite_runtime", "suite_runtime.adapters", "suite_runtime.stage_names", "suite_runtime.triton_compile"}


def suite_layer(module: str) -> int:
    top = module.split(".")[0]
    names = list(SUITE_LAYERS.values())
    return names.index(top) if top in names else len(names)


def suite_modules() -> dict[str, Path]:
    return {module_name(path): path for path in SUITE.rglob("*.py") if "egg-info" not in str(path)}


def test_the_suite_s_layers_import_downwards_only():
    """Runtime < diagnosis < plugin < tests: the runtime knows nothing of how failures are explained, the
    diagnosis engine nothing of pytest's wiring, and no package of the suite imports a test file."""
    modules = suite_modules()
    suite = {*SUITE_LAYERS.values(), "conftest"} | {n for n in modules if n.startswith("test_")}
    upwards = [f"{name} imports {m}" for name, path in modules.items() for m in sorted(imported(path))
               if m.split(".")[0] in suite and suite_layer(m) > suite_layer(name)]
    assert not upwards, "a layer of the suite imports one above it:\n" + "\n".join(upwards)


def test_the_grader_reads_the_suite_s_runtime_only():
    """The grader imports the stage names, the adapter and the random cases; never the diagnosis engine, the suite's
    pytest plugin or a test file (a grading run reaches those through pytest, as a student's run does)."""
    suite = {*SUITE_LAYERS.values(), "conftest"} | {n for n in suite_modules() if n.startswith("test_")}
    reached = {f"{module_name(path)} imports {m}" for path in (KIT / "grader").rglob("*.py")
               for m in imported(path) if m.split(".")[0] in suite and m not in GRADER_READS}
    assert not reached, sorted(reached)


def test_a_box_s_copy_of_the_runtime_is_whole():
    """What a grading box imports of the suite (its copy of the runtime) imports nothing of the suite beyond it:
    the standard library, NumPy and torch besides (and tomli, which stage_names reads records with on Python 3.10,
    never in a box; and Triton, which triton_compile sets up for a kernel compiled in a box)."""
    from grader.sandbox.template import SUITE_RUNTIME_MODULES

    modules = suite_modules()
    copied = {module_name(SUITE / "suite_runtime" / name) for name in SUITE_RUNTIME_MODULES}
    assert copied == BOX_HOLDS
    allowed = set(sys.stdlib_module_names) | {"__future__", "numpy", "torch", "tomli", "triton"}
    outside = {m for name in copied for m in imported(modules[name])
               if m.split(".")[0] not in allowed and m not in copied}
    assert not outside, sorted(outside)


# The grader's layers, lowest first: a module imports from its own layer and the layers below it, never above;
# within a layer, its modules import each other one way (no circle).
LAYERS = {
    "facts": ("grader.errors", "grader.kit", "grader.suite", "grader.submission", "grader.untrusted"),  # data
    "authoring": ("grader.authoring",),  # stubs and fixtures, from the reference solutions
    "sandbox": ("grader.sandbox",),  # where learner code runs
    "grading": ("grader.grading",),  # a run of the graded suite per submission; verdicts, scores, records
    "outputs": ("grader.outputs",),  # what is made from records: the class report, Gradescope's results
    "course": ("grader.course",),  # the nbgrader side: a course, its release, notebook, gradebook, feedback, demo
    "command line": ("grader.cli", "grader"),
}
# The confined side of the sandbox runs where the kit is not, one module per process role: each imports the standard
# library and these of its siblings only (grader.sandbox.template copies them: RUNTIME_MODULES).
_SANDBOX = "grader.sandbox."
CHILD_SIDE = {_SANDBOX + name: {_SANDBOX + sibling for sibling in siblings} for name, siblings in {
    "child": ("box_process", "procfs", "syscalls", "wire"),  # the template
    "box_process": ("reference_process", "worker_process", "seccomp", "syscalls", "wire"),  # a box's first process
    "worker_process": ("reference_proxy", "seccomp", "syscalls", "wire"),  # the process that runs learner code
    "reference_proxy": ("wire",),  # in a worker: the stages it builds on, run elsewhere
    "reference_process": ("reference_proxy", "seccomp", "wire"),  # where they run
    "seccomp": ("syscalls",), "syscalls": (), "wire": (), "procfs": (),
}.items()}


def layer_of(module: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS.values()) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} belongs to no layer: add it to LAYERS"
    return max(matches)[1]


def test_the_grader_s_layers_import_downwards_only_and_one_way_within():
    modules = {module_name(path): path for path in (KIT / "grader").rglob("*.py")}
    names = list(LAYERS)
    graph, upwards = TopologicalSorter(), []
    for name, path in modules.items():
        inner = {m for m in imported(path) if m in modules} - {name}
        graph.add(name, *inner)
        upwards += [f"{name} ({names[layer_of(name)]}) imports {m} ({names[layer_of(m)]})" for m in sorted(inner)
                    if layer_of(m) > layer_of(name)]
    assert not upwards, "a layer imports one above it:\n" + "\n".join(upwards)
    try:
        graph.prepare()
    except CycleError as exc:
        pytest.fail(f"grader's modules import each other in a circle: {exc.args[1]}")


def test_the_typed_contracts_hold(tmp_path):
    """The contracts between the engine's parts are types (grader.grading.contracts: job, verdict, a worker's
    messages, result, record; diagnosis.findings), and mypy finds them kept where they are made and read: the files
    and settings of [tool.mypy] in pyproject.toml. Its cache in a fresh folder: a clean clone, nothing left behind."""
    checked = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(KIT / "pyproject.toml"),
                              "--cache-dir", str(tmp_path / "mypy"), "--no-color-output", "--no-error-summary"],
                             cwd=KIT, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, f"mypy (see [tool.mypy] in pyproject.toml):\n{checked.stdout}{checked.stderr}"


def test_the_sandbox_s_confined_side_needs_only_the_standard_library_and_itself():
    """child.py runs in the box's runtime folder with its siblings beside it (the template imports NumPy, torch and
    the suite's adapter later, inside its functions): at the top, these files import the standard library and
    each other only, as siblings in the runtime folder or within grader.sandbox; and the template copies each of
    them into that folder."""
    from grader.sandbox.template import CHILD_SCRIPT, RUNTIME_MODULES

    copied = {f"{_SANDBOX}{path.stem}" for path in [CHILD_SCRIPT, *RUNTIME_MODULES]}
    assert copied == set(CHILD_SIDE)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, allowed in CHILD_SIDE.items():
        path = KIT / (name.replace(".", "/") + ".py")
        siblings = allowed | {a.rpartition(".")[2] for a in allowed}
        found = set()
        pending = list(ast.parse(path.read_text()).body)
        while pending:  # module-level statements, inside if/try too, not inside functions or classes
            node = pending.pop()
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level and node.module is None:  # from . import sibling
                found.update(f"grader.sandbox.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.add(node.module if not node.level else f"grader.sandbox.{node.module}")
            pending += list(ast.iter_child_nodes(node))
        outside = {m for m in found if m.split(".")[0] not in stdlib and m not in siblings}
        assert not outside, f"{path.name} imports {sorted(outside)} at the top"


def test_check_labels_read_as_english():
    """A check's label is its test's name in words: a possessive is written ``_s_`` in the name and shown with
    its apostrophe, never as a lone "s" or a plural ("the books weights")."""
    from grader.grading.scoring import label

    names = [f"{path.name}::{node.name}" for path in SUITE.glob("test_*.py")
             for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    assert len(names) > 100
    wrong = [(name, label(name)) for name in names if re.search(r"(^| )s( |$)|\bbooks\b", label(name))]
    assert not wrong, wrong
    assert label("test_s04_trainable_projections.py::test_journey_with_the_book_s_weights[check_scores]") == \
        "journey with the book's weights (check_scores)"
    assert label("test_m01_pytorch_attention.py::test_use_mask_follows_the_module_s_mask") == \
        "use mask follows the module's mask"


def test_a_stage_report_wraps_long_lines_to_fit_the_formgrader_s_box():
    """A cell's output box in the formgrader cuts lines at its width (kit_tests/course/test_formgrader.py looks at it
    in a browser): the report's lines are wrapped at spaces, and say the same."""
    from grader.grading.scoring import REPORT_WIDTH, label, stage_report

    nodeid = "tests/test_s02_normalization.py::test_random_cases"
    message = ("all_pairs_weights(inputs) differs from the expected values in 42 of 49 entries (largest difference "
               "0.1699; tolerance rtol=0.0001, atol=1e-06).\n  first mismatching row [0]:\n"
               "Likely mistake: softmax over dim 0 (each column sums to 1); each query's row must sum to 1, use dim=-1")
    text = stage_report("s02_normalization", 8, [{"nodeid": nodeid, "label": label(nodeid), "outcome": "failed",
                                              "message": message}])
    assert max(map(len, text.splitlines())) <= REPORT_WIDTH, text
    assert " ".join(message.split()) in " ".join(text.split())


def test_the_readme_gives_the_demo_one_time():
    """One measured figure (the Performance table, from a fresh clone), not a second estimate elsewhere."""
    readme = (KIT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `attnkit demo")]
    timed = [line for line in rows if re.search(r"\b\d+(\.\d+)? ?(s|min|minutes?)\b", line)]
    assert len(rows) == 2 and len(timed) == 1, timed


def test_the_demo_puts_chapter_3_through_nbgrader_and_the_others_on_request(monkeypatch, tmp_path):
    """nbgrader's autograde takes seconds a submission, so the first command puts one assignment through nbgrader's
    round (the kit's first) and every one through attnkit grade; --nbgrader NAME (repeatable) or --all ask for more,
    in the kit's order, and one this Python cannot grade (left out, as the demo says) is not asked for."""
    from grader import cli
    from grader.course import demo
    from grader.kit import assignments

    names = list(assignments())
    assert demo.nbgrader_rounds(names) == ["attention"] == names[:1]
    assert demo.nbgrader_rounds(names, "all") == names
    assert demo.nbgrader_rounds(names, ["kernels", "modern-attention"]) == ["modern-attention", "kernels"]
    assert demo.nbgrader_rounds([n for n in names if n != "kernels"], ["kernels"]) == []

    asked = []
    monkeypatch.setattr(demo, "run", lambda root, nbgrader=None: asked.append((root, nbgrader)) or
                        {"fast_path_differs": []})
    for argv, nbgrader in ((["demo"], None), (["demo", "--nbgrader", "kernels", "--nbgrader", "attention"],
                                             ["kernels", "attention"]), (["demo", "--all"], "all")):
        assert cli.main([*argv, "--dir", str(tmp_path)]) == 0
        assert asked.pop() == (str(tmp_path), nbgrader), argv


def test_flex_attention_called_eagerly_as_its_stage_means_warns_nothing():
    """torch warns "Use torch.compile(flex_attention)" at the first eager call, which contradicts stage f04 (graded
    code may not compile): the stage's module filters that one warning, so a student's run, a notebook demo and a
    grading box stay quiet; any other warning still fails this run (-W error)."""
    import subprocess

    code = ("import sys, torch; sys.path.insert(0, 'solutions'); import f04_flex_attention as f; "
            "q = torch.randn(1, 2, 8, 4); f.attend(q, q, q, mask_mod=f.causal)")
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=KIT, capture_output=True, text=True)
    assert run.returncode == 0 and "torch.compile" not in run.stderr, run.stderr[-2000:]
