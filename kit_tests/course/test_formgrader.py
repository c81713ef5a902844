"""The formgrader shows a course built and graded by the kit as nbgrader's own: a course built, its
submissions graded by ``attnkit grade --notebooks``, nbgrader's formgrader served by ``jupyter server``
on 127.0.0.1 and opened in headless Chromium. Each student's per-cell scores on the grading page are
the kit's records, every code cell has its execution count, the code is highlighted as IPython, and
the server logs no warning the course causes (no missing exchange, no configuration that cannot be
shown as JSON).

The browser is driven by playwright (the ``test`` extra) with the system's Chromium, found through
ATTNKIT_CHROMIUM or on PATH; without either the browser test is skipped, saying what to install.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from servers import free_port

from grader.course.build import build, exchange_hint
from grader.course.samples import by_student, write_submission
from grader.course.settings import Course
from grader.grading import records as R
from runs import Nbgrader, attnkit

# Whole suites or gradings run in its fixtures: seconds idle, minutes on a loaded machine (pytest's default of
# 120 s is for single tests).
pytestmark = pytest.mark.timeout(600)

ASSIGNMENT = "attention"
STUDENTS = ("reference", "tril-for-triu", "softmax-dim0")  # full marks, one stage partly, several stages
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
SERVER_START_SECONDS = 60  # jupyter server loads every installed extension: a few seconds here
PAGE_SECONDS = 30  # the grading page loads its scores with JavaScript, after the HTML
VIEWPORT_WIDTH = 1024  # pixels: a small laptop's window, where every verdict line must still fit its box


def find_chromium() -> str | None:
    """The Chromium to drive: ATTNKIT_CHROMIUM, else the first of BROWSERS on PATH."""
    given = os.environ.get("ATTNKIT_CHROMIUM")
    if given:
        return shutil.which(given)
    return next(filter(None, map(shutil.which, BROWSERS)), None)


@pytest.fixture(scope="module")
def chromium(unavailable):
    """The browser's path; skips the test (saying what to install) without playwright or Chromium."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        unavailable("the browser test needs playwright: pip install -e '.[test]'")
    path = find_chromium()
    if path is None:
        unavailable("no Chromium found: install it (apt-get install chromium) or set ATTNKIT_CHROMIUM to its path")
    return path


# ---------------------------------------------------------------- the course (fast)

def test_the_course_s_nbgrader_config_is_json_and_names_steps_nbgrader_resolves(tmp_path):
    """The formgrader shows its configuration as JSON (and warns on every visit when it cannot):
    the course names its steps by import strings, which nbgrader resolves."""
    from nbconvert.exporters import Exporter
    from traitlets.config.loader import PyFileConfigLoader
    from traitlets.utils.importstring import import_item

    root = tmp_path / "course"
    build(root, assignments=[ASSIGNMENT])
    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    json.dumps(config)  # raises TypeError on a class or any other object JSON has no form for
    steps = (config.Autograde.sanitize_preprocessors + config.Autograde.autograde_preprocessors
             + config.GenerateFeedback.preprocessors)
    assert all(isinstance(step, str) and isinstance(import_item(step), type) for step in steps), steps
    assert issubclass(import_item(config.GenerateFeedback.exporter_class), Exporter)


def test_the_build_makes_the_exchange_folder_or_says_how(tmp_path):
    root = tmp_path / "course"
    course = build(root, assignments=[ASSIGNMENT])
    assert course.exchange == root / "exchange"
    assert course.exchange.is_dir() and course.exchange.stat().st_mode & 0o777 == 0o777, \
        "students submit into the exchange: everyone may write there, as nbgrader's release makes it"
    assert exchange_hint(course) is None
    elsewhere = build(tmp_path / "other", assignments=[ASSIGNMENT], exchange_root=str(tmp_path / "srv" / "exchange"))
    assert elsewhere.exchange.is_dir()
    missing = Course(root=root, exchange_root=str(tmp_path / "not-made"))
    hint = exchange_hint(missing)
    assert hint is not None and f"sudo mkdir -p {tmp_path / 'not-made'}" in hint and "chmod ugo+rwx" in hint, hint


# ---------------------------------------------------------------- the formgrader in a browser (slow)

@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A course whose class was graded by ``attnkit grade --notebooks``: {root, course, records}."""
    root = tmp_path_factory.mktemp("formgrader") / "course"
    course = build(root, assignments=[ASSIGNMENT])
    Nbgrader(root)("generate_assignment", ASSIGNMENT)
    for student in STUDENTS:
        write_submission(by_student(student), root / "release" / ASSIGNMENT, root / "submitted" / student / ASSIGNMENT)
    stdout = attnkit("grade", ASSIGNMENT, "--course", str(root), "--quiet", "--notebooks")
    assert f"autograded notebooks: {len(STUDENTS)} written, 0 failed" in stdout, stdout
    return dict(root=root, course=course, records=R.read_records(root / "attnkit-grades" / ASSIGNMENT))


@pytest.mark.slow
def test_notebooks_are_numbered_and_highlighted_as_after_a_run(graded):
    nb = nbformat.read(graded["root"] / "autograded" / "tril-for-triu" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb",
                       as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(cell.outputs == [] for cell in code if not cell.metadata["nbgrader"]["grade"]), \
        "setup, demo and check cells print nothing when graded"
    info = nb.metadata["language_info"]
    assert (info["codemirror_mode"], info["pygments_lexer"], info["name"]) == \
        ({"name": "ipython", "version": 3}, "ipython3", "python")


@pytest.fixture(scope="module")
def formgrader(graded, tmp_path_factory):
    """nbgrader's formgrader on 127.0.0.1 in the course folder (where it reads nbgrader_config.py):
    {url, token, log}. Stopped after the module's tests, passed or failed."""
    jupyter = tmp_path_factory.mktemp("jupyter")
    log = jupyter / "server.log"
    port, token = free_port(), secrets.token_hex(16)
    # The instructor's own Jupyter settings (~/.jupyter) stay out of it; the extensions are those installed
    # (jupyter_server_config.d), as `jupyter lab` in the course folder would have them.
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(jupyter / "config"), JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"))
    command = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={graded['root']}"]
    if os.geteuid() == 0:
        command.append("--allow-root")
    with log.open("w") as out:
        server = subprocess.Popen(command, cwd=graded["root"], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            assert server.poll() is None, f"jupyter server exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"jupyter server not up in {SERVER_START_SECONDS} s:\n" \
                                                f"{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        yield dict(url=url, token=token, log=log)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def submission_ids(course: Course, students) -> dict[str, str]:
    """student -> the id of their submitted notebook (its grading page: /formgrader/submissions/<id>/)."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course.root / 'gradebook.db'}", course.course_id) as gb:
        return {s: gb.find_submission_notebook(course.notebook, ASSIGNMENT, s).id for s in students}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_formgrader_shows_the_kit_s_scores_per_cell(chromium, graded, formgrader):
    from playwright.sync_api import sync_playwright

    url, token = formgrader["url"], formgrader["token"]
    pages = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": VIEWPORT_WIDTH, "height": 800})
            page.set_default_timeout(PAGE_SECONDS * 1000)
            # The assignments page: the exchange is listed there (a missing one is a banner and a warning).
            page.goto(f"{url}/formgrader/manage_assignments?token={token}")
            page.locator(".name a", has_text=ASSIGNMENT).wait_for()  # the table is filled by JavaScript
            banner = page.locator("#warning-exchange").count()  # nbgrader's "exchange directory ... does not exist"
            for student, notebook_id in submission_ids(graded["course"], STUDENTS).items():
                page.goto(f"{url}/formgrader/submissions/{notebook_id}/?token={token}")
                # The scores arrive by JavaScript, from the gradebook: each cell's box shows its autograded
                # score (greyed, as the box's placeholder) until a grader types one in (its value).
                page.wait_for_function("() => { const boxes = [...document.querySelectorAll('input.score')];"
                                       " return boxes.length > 0 && boxes.every(b => b.placeholder !== ''); }")
                pages[student] = dict(
                    scores=page.eval_on_selector_all(
                        "input.score", "bs => Object.fromEntries(bs.map(b => [b.id, b.value || b.placeholder]))"),
                    prompts=page.eval_on_selector_all(".code_cell .input_prompt",
                                                      "ps => ps.map(p => p.textContent.trim())"),
                    highlighted=page.locator(".hl-ipython3").count(),
                    # output boxes whose lines are wider than the box (cut off, or a scrollbar to find)
                    cut=page.eval_on_selector_all(".output_area pre", "ps => ps.filter(p => p.scrollWidth > "
                                                  "p.clientWidth + 1).map(p => p.textContent.slice(0, 300))"),
                )
        finally:
            browser.close()

    for student, shown in pages.items():
        record = graded["records"][student]
        expected = {f"grade_{stage['stage']}": stage["points"] for stage in record["stages"]}
        assert {cell: float(value) for cell, value in shown["scores"].items()} == pytest.approx(expected, abs=1e-9), \
            f"{student}: the formgrader's scores (left) are not the kit's record {expected}"
        # Every code cell as run: "In [1]:" ... in order, none left "In [ ]:"; code highlighted as IPython.
        code_cells = 2 * len(expected) + 1  # the setup cell, and a demo and an autograder cell per stage
        assert [re.sub(r"\s+", " ", p) for p in shown["prompts"]] == [f"In [{n}]:" for n in range(1, code_cells + 1)], \
            f"{student}: {shown['prompts']}"
        assert shown["highlighted"] >= code_cells, f"{student}: {shown['highlighted']} cells highlighted as IPython"
        assert shown["cut"] == [], f"{student}: lines wider than their box at {VIEWPORT_WIDTH} px: {shown['cut']}"
    assert sum(1 for r in graded["records"]["tril-for-triu"]["stages"] if r["points"] < r["max_points"]) == 1
    assert banner == 0, "the formgrader says the exchange directory is missing"

    log = formgrader["log"].read_text()
    assert "Unwritable directory" not in log and "not serializable" not in log, log[-3000:]
    warnings = [line for line in log.splitlines() if re.match(r"\[[WEC] ", line)]
    assert warnings == [], "the formgrader's server logged:\n" + "\n".join(warnings)


# ---------------------------------------------------------------- a student's JupyterLab (slow)

def readme_lab_command() -> list[str]:
    """The README's command that hides nbgrader's instructor tools from a student's JupyterLab."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    found = re.search(r"^\.venv/bin/(jupyter labextension disable .*)$", readme, re.M)
    assert found, "the README gives no command that hides nbgrader's instructor tools from students"
    return found.group(1).split()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_student_s_jupyterlab_from_the_kit_s_venv_shows_no_instructor_tools(chromium, tmp_path):
    """With the README's command run (for this test's user only: its own JUPYTER_CONFIG_DIR), JupyterLab opens a
    course notebook with nbgrader's student tools (Validate Assignment) and without its Create Assignment panel."""
    from playwright.sync_api import sync_playwright

    command = readme_lab_command()
    assert "--level=user" in command and "@jupyter/nbgrader:create-assignment" in command, command
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:]], env=env, check=True,
                   capture_output=True)
    work = tmp_path / "work"
    course = build(tmp_path / "course", assignments=[ASSIGNMENT])
    shutil.copytree(course.source, work)
    port, token = free_port(), secrets.token_hex(16)
    server_command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                      "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}"]
    if os.geteuid() == 0:
        server_command.append("--allow-root")
    with (tmp_path / "lab.log").open("w") as out:
        server = subprocess.Popen(server_command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "lab.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            try:
                page = browser.new_page()
                page.set_default_timeout(PAGE_SECONDS * 1000)
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{ASSIGNMENT}.ipynb?token={token}")
                page.locator(".jp-Notebook").first.wait_for()
                page.locator("[title='Validate Assignment']").first.wait_for()  # nbgrader's extension is loaded
                titles = page.eval_on_selector_all("[title]", "es => es.map(e => e.getAttribute('title'))")
            finally:
                browser.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert not [t for t in titles if "Create Assignment" in t or "Formgrader" in t], titles
