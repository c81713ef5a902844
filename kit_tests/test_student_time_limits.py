"""A student's endless loop stops with a message, in `pytest` and in the notebook; a busy machine stops nothing.

One course is built with a small time limit per check and released with nbgrader's own
generate_assignment. In copies of the release, s05 loops forever at import and s03 loops in one
function (the other modules stay stubs): `pytest` must stop each looping check at the limit, name
the stage and the limit, and fail the stage's other checks at once; the notebook's demo and check
cells, run in a real kernel, must do the same.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import nbformat
import pytest

from grader.course.build import GRADING_PLUGINS, build
from grader.course.samples import write_modules
from grader.kit import KIT, SOLUTIONS, SUITE
from runs import Nbgrader


def _time_limits():
    """The suite's time limits (tests/suite_plugin/time_limits.py, which pytest loads through tests/conftest.py), as
    a module of its own here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_time_limits", SUITE / "suite_plugin" / "time_limits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TIME_LIMITS = _time_limits()
WAIT_FACTOR, CheckClock = TIME_LIMITS.WAIT_FACTOR, TIME_LIMITS.CheckClock

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ASSIGNMENT = "attention"
LIMIT = 2.0  # the course's test_timeout here: small, so that every stop below comes quickly
STOPPED = f"this check was stopped after {LIMIT:g} s of CPU time (the time limit per check)"
NOT_RUN = "not run: an earlier check of this stage hit the time limit"
LOOP_AT_IMPORT = "while True:\n    pass\n"
LOOP_IN_FUNCTION = """

def all_context_vectors(attn_weights, inputs):
    while True:
        pass
"""
# Blocks the signals of the time limits, so that no per-check limit can fire: only check()'s own backstop can stop it.
LOOP_DEAF_TO_ALARMS = ("import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})\n"
                       "while True:\n    pass\n")
# Correct work that a busy machine slows down: s01's reference, which at import spends CPU_SECONDS of CPU time on the
# processor it shares with three CPU-bound processes (it gets a quarter of that processor: its wall-clock time is
# about four times its CPU time, twice the limit).
CPU_SECONDS = 1.0
BUSY_AT_IMPORT = f"""
import os as _os, subprocess as _subprocess, sys as _sys, time as _time

_cpus = _os.sched_getaffinity(0)
_one = min(_cpus)
_os.sched_setaffinity(0, {{_one}})
_hog = "import os\\nos.sched_setaffinity(0, {{%d}})\\nwhile True: pass" % _one
_hogs = [_subprocess.Popen([_sys.executable, "-c", _hog]) for _ in range(3)]
try:
    _started = _time.process_time()
    while _time.process_time() - _started < {CPU_SECONDS}:
        pass
finally:
    for _hog in _hogs:
        _hog.kill()
        _hog.wait()
    _os.sched_setaffinity(0, _cpus)
"""


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("time-limits") / "course"
    build(root, test_timeout=LIMIT)
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    return root / "release" / ASSIGNMENT


def student_copy(release, folder):
    """The release with s05 looping at import and s03's all_context_vectors looping (the rest of s03
    is the reference, so its first check passes)."""
    shutil.copytree(release, folder)
    (folder / "s05_self_attention.py").write_text(LOOP_AT_IMPORT)
    s03 = (SOLUTIONS / "s03_context_vectors.py").read_text()
    (folder / "s03_context_vectors.py").write_text(s03 + LOOP_IN_FUNCTION)
    return folder


def junit_results(path):
    """{test name: (outcome, message, seconds)} from a junit XML report."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, node.get("message") or ""
        name = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        results[name] = (outcome, message, float(case.get("time")))
    return results


def test_after_a_stop_the_stage_s_cuda_cases_stay_skipped(tmp_path):
    """Stage 10 loops at import: its checks after the first fail at once, but its CUDA cases are skipped as
    on any machine without CUDA, so that they count for nothing there either way (a student who hit the
    limit loses the checks that ran, not those that never could)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CUDA cases run instead of being skipped")
    s10 = "s10_multihead_attention"
    folder = write_modules(tmp_path / "student", replaced={s10: LOOP_AT_IMPORT}, assignment="attention")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(KIT / "tests" / f"test_{s10}.py"), f"--impl={folder}",
                    "-p", "no:cacheprovider", f"--check-time-limit={LIMIT:g}", f"--junitxml={junit}"],
                   cwd=KIT, capture_output=True, text=True, timeout=180)
    results = junit_results(junit)
    cuda = {name: r for name, r in results.items() if "cuda" in name}
    cpu = [r for name, r in results.items() if "cuda" not in name]
    assert cuda and all(outcome == "skipped" for outcome, _, _ in cuda.values()), cuda
    assert cpu[0][0] == "failure" and all(outcome == "error" and NOT_RUN in message
                                          for outcome, message, _ in cpu[1:]), cpu[:3]


def test_release_pytest_ini_carries_the_time_limit(release):
    ini = (release / "pytest.ini").read_text()
    assert f"\ncheck_time_limit = {LIMIT:g}\n" in ini and "\ntimeout" not in ini  # (pytest-timeout's is wall time)


# What the kit's test extra installs and nbgrader's Jupyter packages bring, which no student run uses (their
# distributions' import names)
NOT_FOR_STUDENTS = ("xdist", "pytest_timeout", "syrupy", "anyio", "platformdirs")


def test_a_students_run_imports_no_plugin_installed_for_grading(release):
    """Where the kit's test extra is installed (this Python), the release's pytest.ini blocks its plugins and
    those of the Jupyter packages: a student's `pytest` does not import them at every run, and the time limit
    still holds (the suite's own plugin)."""
    ini = (release / "pytest.ini").read_text()
    assert all(f" -p no:{name}" in ini for name in GRADING_PLUGINS), ini
    probe = ("import sys, pytest\n"
             "status = int(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider']))\n"
             f"print('loaded:', sorted({{m.split('.')[0] for m in sys.modules}} & {set(NOT_FOR_STUDENTS)}), status)\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=release, capture_output=True, text=True, timeout=120)
    assert "loaded: [] 0" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"check_time_limit = {LIMIT:g}" in ini


def third_party_imports(folder) -> set[str]:
    """The top-level modules the Python files of a folder (and its tests/, with the suite's packages there) import
    that are neither the standard library nor the folder's own."""
    import ast

    files = [*folder.glob("*.py"), *folder.glob("tests/*.py"), *folder.glob("tests/*/*.py")]
    own = {path.stem for path in files} | {path.parent.name for path in folder.glob("tests/*/__init__.py")}
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found - own - set(sys.stdlib_module_names)


def test_a_release_says_what_to_install(release):
    from importlib.metadata import distribution, packages_distributions

    from packaging.requirements import Requirement

    lines = [line for line in (release / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    required = {Requirement(line).name for line in lines}
    # ... and what those require, whatever the Python (stage_names reads TOML with tomli on Python 3.10, where the
    # standard library has no tomllib: pytest requires tomli there)
    installed = required | {Requirement(need).name for name in required for need in distribution(name).requires or []}
    distributions = packages_distributions()
    for module in third_party_imports(release):  # everything the release's code imports is installed by it
        assert set(distributions.get(module, [module])) & installed, f"{module} is imported but not installed by " \
                                                                       "requirements.txt"
    assert "pytest-timeout" not in required  # (the suite's own plugin keeps the limits)
    # Where a student reads it first (the notebook's first cell, the folder's README.md), a command per platform, the
    # CPU build of torch the default without an NVIDIA GPU (a plain pip install on Linux fetches the 5.5 GB CUDA build),
    # with what each costs; requirements.txt's own comment says the same.
    notebook = nbformat.read(release / f"{ASSIGNMENT}.ipynb", as_version=4)
    cpu = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    for text in (notebook.cells[0].source, (release / "README.md").read_text()):
        rows = {row.split(" | ")[0].strip("| "): row for row in text.splitlines() if row.startswith("| ")}
        assert cpu in rows["Linux or Windows without an NVIDIA GPU (most laptops)"], text
        assert cpu not in rows["macOS"] and "pip install -r requirements.txt" in rows["macOS"], text
        assert "190 MB" in text and "5.5 GB" in text, text
    assert notebook.cells[0].source.index(cpu) < 1000  # (in the cell's first lines, right under the title)
    said = (release / "requirements.txt").read_text()
    assert f"#   {cpu}\n#   pip install -r requirements.txt\n# macOS" in said and "190 MB" in said, said


def test_pytest_stops_each_looping_stage_once_and_names_it(release, tmp_path):
    folder = student_copy(release, tmp_path / "student")
    start = time.monotonic()
    junit = tmp_path / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:timeout",
                          f"--junitxml={junit}"], cwd=folder, capture_output=True, text=True, timeout=180)
    seconds = time.monotonic() - start
    assert run.returncode == 1, run.stdout[-3000:]
    assert f"stage s05_self_attention: {STOPPED}" in run.stdout
    assert f"stage s03_context_vectors: {STOPPED}" in run.stdout
    results = junit_results(junit)

    s05 = [r for name, r in results.items() if name.startswith("test_s05_self_attention::")]
    assert len(s05) >= 3
    first, *rest = s05
    assert first[0] == "failure" and first[1].startswith(f"stage s05_self_attention: {STOPPED}"), first
    # Stopped at the limit of CPU time, not earlier (a loaded machine makes the wall-clock time longer, not shorter)
    assert LIMIT <= first[2] < WAIT_FACTOR * LIMIT + 5
    for outcome, message, took in rest:  # at once, not after the limit again
        assert outcome == "error" and NOT_RUN in message and took < 1, (outcome, message, took)

    s03 = {name.split("::")[1]: r for name, r in results.items() if name.startswith("test_s03_context_vectors::")}
    assert s03["test_journey_context_vector"][0] == "passed"
    assert s03["test_journey_all_context_vectors"][1].startswith(f"stage s03_context_vectors: {STOPPED}")

    others = [r for name, r in results.items()
              if not name.startswith(("test_s03_", "test_s05_")) and r[0] != "skipped"]
    assert others and all("NotImplementedError" in message for _, message, _ in others)
    assert not any("time limit" in message for _, message, _ in others)
    assert seconds < 2 * LIMIT + 60, f"pytest took {seconds:.0f} s"


def test_a_busy_machine_does_not_stop_a_check(release, tmp_path):
    """A correct stage slowed down by the machine's load passes: the limit counts the check's CPU time (a wall-clock
    limit, pytest-timeout's, stopped this check: it took over twice the limit)."""
    folder = shutil.copytree(release, tmp_path / "student")
    s01 = (SOLUTIONS / "s01_attention_scores.py").read_text()
    (folder / "s01_attention_scores.py").write_text(s01 + BUSY_AT_IMPORT)
    junit = tmp_path / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "attention_scores",
                          f"--junitxml={junit}"], cwd=folder, capture_output=True, text=True, timeout=180)
    results = junit_results(junit)
    assert run.returncode == 0 and results and all(r[0] == "passed" for r in results.values()), run.stdout[-3000:]
    assert max(took for _, _, took in results.values()) > 2 * LIMIT  # (the machine was that busy)


def test_the_clock_stops_computing_and_waiting_and_counts_no_processor_wait(monkeypatch):
    """The clock of one check, in this process: CPU time stops a loop at the limit, waiting stops a sleep at WAIT_FACTOR
    times it, and time spent waiting for a processor is not waiting. The same without interval timers (Windows)."""
    for threaded in (False, True):
        with pytest.raises(pytest.fail.Exception, match="0.2 s of CPU time"):
            with CheckClock("s01_attention_scores", 0.2, threaded=threaded):
                while True:
                    pass
        start = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match=f"after waiting {WAIT_FACTOR * 0.2:g} s"):
            with CheckClock("s01_attention_scores", 0.2, threaded=threaded):
                time.sleep(30)
        assert WAIT_FACTOR * 0.2 <= time.monotonic() - start < WAIT_FACTOR * 0.2 + 2
    # A process that waited for a processor all along: a second of sleeping in it is no waiting at all.
    started = time.monotonic()
    monkeypatch.setattr(TIME_LIMITS, "run_delay", lambda: time.monotonic() - started)
    with CheckClock("s01_attention_scores", 0.2):
        time.sleep(WAIT_FACTOR * 0.2 + 0.5)


def notebook_cells(release, cells):
    """The release notebook's cells with these grade ids (or new cells), in this order."""
    nb = nbformat.read(release / f"{ASSIGNMENT}.ipynb", as_version=4)
    by_id = {cell.metadata["nbgrader"]["grade_id"]: cell for cell in nb.cells if "nbgrader" in cell.metadata}
    nb.cells = [by_id[c] if isinstance(c, str) else c for c in cells]
    return nb


def without_check(cell):
    """A demo cell without its closing check(...) call (one pytest run less)."""
    return nbformat.v4.new_code_cell(cell.source.rsplit("\ncheck(", 1)[0])


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


@pytest.fixture(scope="module")
def notebook_run(release, tmp_path_factory):
    """The setup cell, the demo cells of stages 5 (with its check) and 3 (without) and a demo of
    stage 1, executed in a real kernel in a student copy, with a SIGALRM handler of the kernel's own
    around them; then check() on a stage whose module blocks SIGALRM, with a short backstop."""
    from nbclient import NotebookClient

    folder = student_copy(release, tmp_path_factory.mktemp("notebook") / "student")
    (folder / "s07_dropout.py").write_text(LOOP_DEAF_TO_ALARMS)
    new = nbformat.v4.new_code_cell
    demos = notebook_cells(release, ["demo_s03_context_vectors", "demo_s01_attention_scores"]).cells
    nb = notebook_cells(release, [
        "setup",
        new("import signal\ndef own_handler(signum, frame):\n    pass\nsignal.signal(signal.SIGALRM, own_handler)"),
        "demo_s05_self_attention", without_check(demos[0]), without_check(demos[1]),
        new("print('handler restored:', signal.getsignal(signal.SIGALRM) is own_handler)"),
        new("setup(checks_time_limit=4)\ncheck('dropout')"),
    ])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return nb.cells


def test_demo_stops_a_loop_at_import_and_names_the_stage_and_the_limit(notebook_run):
    out = stdout(notebook_run[2])
    assert f"Stage s05_self_attention: the demo was stopped after {LIMIT:g} s of CPU time (the time limit)" in out, out
    assert re.search(r"It was stopped on line \d+ of s05_self_attention\.py\.", out), out
    # the cell's check(...) ran the stage's public tests: stopped once, the rest not run
    assert f"stage s05_self_attention: {STOPPED}" in out and NOT_RUN in out, out


def test_demo_stops_a_loop_in_a_function(notebook_run):
    out = stdout(notebook_run[3])
    assert f"Stage s03_context_vectors: the demo was stopped after {LIMIT:g} s of CPU time (the time limit)" in out, out
    assert re.search(r"It was stopped on line \d+ of s03_context_vectors\.py\.", out), out


def test_demo_still_reports_stubs_and_restores_the_alarm_handler(notebook_run):
    assert "Not written yet: s01_attention_scores: " in stdout(notebook_run[4])
    assert "handler restored: True" in stdout(notebook_run[5])


def test_check_has_a_backstop_when_no_check_can_be_stopped(notebook_run):
    out = stdout(notebook_run[6])
    assert "Stage dropout: the checks were stopped after 4 s" in out, out


def test_demo_and_check_do_nothing_while_grading(release, tmp_path):
    """nbgrader sets NBGRADER_EXECUTION: neither may run learner code in the kernel, nor wait for it."""
    folder = student_copy(release, tmp_path / "student")
    nb = notebook_cells(release, ["setup", "demo_s05_self_attention"])
    code = "\n".join(cell.source for cell in nb.cells)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, NBGRADER_EXECUTION="autograde"))
    assert run.returncode == 0 and run.stdout == "" and run.stderr == "", run.stderr
    assert time.monotonic() - start < 10
