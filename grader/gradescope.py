"""Gradescope's autograder: the zip ``attnkit gradescope`` builds, and the run that grades one submission.

Gradescope unzips an autograder into ``/autograder/source/``, runs its ``setup.sh`` once to build the
image, and for every submission copies the student's files into ``/autograder/submission/``, runs
``/autograder/run_autograder`` and reads ``/autograder/results/results.json``
(https://gradescope-autograders.readthedocs.io/en/latest/specs/). The zip holds::

    setup.sh                  a CPU build of torch, then the kit from kit/ (editable: it finds its files there)
    run_autograder            python3 -m grader.gradescope run, with kit/ on the path
    attnkit-gradescope.json   the assignment, its points per stage and the time limits
    kit/                      the kit's source: grader/, tests/, solutions/, fixtures/ (hidden ones too), ...

A submission is graded as ``attnkit grade`` grades one: its stage modules are read the way
``grader.submission`` reads them (a module submitted as a symbolic link fails on import, saying so),
and ``grader.cells.grade_folder`` grades them with a grading worker: the same suite, seed and sandbox.
The hidden tests, hidden fixtures and solutions must be in the image, since grading needs them; learner
code runs only in a sandbox box, whose world holds the Python installation and its own modules, not
/autograder. How well a box is kept apart depends on the container (see README, "Trusting the grades"):
Gradescope runs the autograder as root in Docker, where the run records the confinement it got in the
results' output; in ``plain`` mode (no namespaces) the box is only a child process with resource limits.

results.json has one test per counted check, worth points / counted of its stage (in whole hundredths of a
point: the passed checks share the stage's score, the failed ones the rest, so that the sums are exact) and
scoring all of it if it passed, nothing if not: the checks of a stage add up to ``grader.scoring.stage_score``.
Checks that need CUDA are skipped on Gradescope's machines and count for nothing, as in ``attnkit grade``:
they are not listed, and the stage's report says how many there were. Public checks (marked ``public``,
the ones students have) are ``visible``; hidden ones ``after_published``, with their failure message (the diagnosis,
never test code). Each stage also gets an unscored entry named with its total ("Stage 8:
causal_attention total: 9 of 12 points") whose output is the stage's report: unscored, so that the
entries never count a point twice whether Gradescope adds up the tests or takes the top-level score;
``after_published`` too, since the report names the hidden checks. The top-level output, shown to
the student at once, lists the stage totals. A submission that cannot be graded still gets a
results.json: score 0 and why.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import zipfile
from pathlib import Path

from stage_names import stage_test_file

# Everything this process will use is imported before any learner code runs (no lazy imports).
from . import submission as S
from .cells import grade_folder
from .course import plan_points, public_tests
from .kit import KIT, SUITE, marker
from .results import write_atomic
from .sandbox import TEST_TIMEOUT, Limits, budget_problem
from .scoring import needs_cuda, stage_report, stage_score

ROOT_ENV = "ATTNKIT_GRADESCOPE_ROOT"  # Gradescope's container root, /autograder unless set (the kit's test sets it)
SETTINGS = "attnkit-gradescope.json"
KIT_FOLDER = "kit"  # where the zip holds the kit's source
SHIPPED = ("pyproject.toml", "README.md", "conftest.py", "grader", "tests", "solutions", "exercises", "fixtures")
SKIPPED_NAMES = ("__pycache__", ".pytest_cache")
CPU_TORCH = "https://download.pytorch.org/whl/cpu"

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, in /autograder/source, to build the autograder's image.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip --version || {{ apt-get update && apt-get install -y python3-pip; }}
python3 -c 'import sys; assert sys.version_info >= (3, 10), "the kit needs Python 3.10 or later"'
export PIP_BREAK_SYSTEM_PACKAGES=1   # the image is the autograder's alone (Ubuntu 24.04's pip refuses otherwise)
python3 -m pip install torch --index-url {CPU_TORCH}   # CPU only: Gradescope has no GPU
python3 -m pip install -e {KIT_FOLDER}/   # editable: the kit finds its suite, solutions and fixtures in {KIT_FOLDER}/
"""

RUN_AUTOGRADER = f"""#!/usr/bin/env bash
# Gradescope runs this for every submission: grade $ROOT/submission/ into $ROOT/results/results.json.
# Everything is in one function that bash reads whole before it runs any of it, and the line that calls it
# exits: nothing written into this file while it runs is ever read.
main() {{
  ROOT="${{{ROOT_ENV}:-/autograder}}"
  KIT="$ROOT/source/{KIT_FOLDER}"
  export PYTHONPATH="$KIT:$KIT/tests${{PYTHONPATH:+:$PYTHONPATH}}"
  python3 -m grader.gradescope run --root "$ROOT" --settings "$ROOT/source/{SETTINGS}"
  status=$?
  if [ ! -s "$ROOT/results/results.json" ]; then   # python3 itself failed: Gradescope still gets a verdict
    mkdir -p "$ROOT/results"
    printf '{{"score": 0, "output": "The autograder failed before grading (exit status %s); please tell your \
instructor.", "tests": []}}\\n' "$status" > "$ROOT/results/results.json"
  fi
}}
main "$@"; exit 0
"""


# ---------------------------------------------------------------- the zip

def build_zip(out, assignment: str = "attention", points: dict[str, float] | None = None,
              test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None, allow_plain: bool = False) -> Path:
    """Write Gradescope's autograder zip for ``assignment`` to ``out``; ``points``: stage module -> points
    (default: the course's default plan, 100 in all); ``allow_plain``: grade even where no confinement holds."""
    points = points or plan_points(100, None, assignment)
    settings = {"assignment": assignment, "points": points, "test_timeout": test_timeout, "time_budget": time_budget,
                "allow_plain": allow_plain}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        _add(zf, "setup.sh", SETUP_SH, executable=True)
        _add(zf, "run_autograder", RUN_AUTOGRADER, executable=True)
        _add(zf, SETTINGS, json.dumps(settings, indent=1) + "\n")
        for name in SHIPPED:
            path = KIT / name
            for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if file.is_file() and not file.is_symlink() and not set(file.parts) & set(SKIPPED_NAMES):
                    zf.write(file, f"{KIT_FOLDER}/{file.relative_to(KIT)}")
    return out


def _add(zf: zipfile.ZipFile, name: str, text: str, executable: bool = False):
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    info.external_attr = (0o100755 if executable else 0o100644) << 16  # unzip keeps the mode
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, text)


# ---------------------------------------------------------------- one submission

def public_names(stage: str) -> set[str]:
    """Names of the tests (functions or classes) of ``stage`` marked public: the ones students have."""
    return set(public_tests(SUITE / stage_test_file(stage)).public)


def is_public(nodeid: str, public: set[str]) -> bool:
    """tests/test_s08_x.py::test_y[cpu-case0] or ...::TestZ::test_y is public if test_y or TestZ is."""
    return bool(set(nodeid.partition("[")[0].split("::")[1:]) & public)


def shares(points: float, n: int) -> list[float]:
    """``points`` split into ``n`` shares of whole hundredths that add up to it exactly (in hundredths)."""
    cents = round(points * 100)
    return [(cents // n + (i < cents % n)) / 100 for i in range(n)]


def stage_title(stage: str) -> str:
    return f"Stage {int(stage[1:3])}: {marker(stage)}"


def stage_entries(stage: str, points: float, tests: list[dict], public: set[str]) -> tuple[float, list[dict]]:
    """(the stage's score, its results.json entries: its total, then one per counted or non-CUDA skipped check)."""
    score = stage_score(tests, points)
    counted = [t for t in tests if t["outcome"] in ("passed", "failed")]
    passed = [t["nodeid"] for t in counted if t["outcome"] == "passed"]
    failed = [t["nodeid"] for t in counted if t["outcome"] == "failed"]
    # The passed checks share the stage's score, the failed ones the rest: each is worth points / counted
    # to within a hundredth, and the sums are exact.
    earned = dict(zip(passed, shares(score, len(passed)) if passed else []))
    worth = {**earned, **dict(zip(failed, shares(points - score, len(failed)) if failed else []))}
    entries = [{"name": f"{stage_title(stage)} total: {score:g} of {points:g} points",
                "output": stage_report(marker(stage), points, tests), "visibility": "after_published"}]
    for t in tests:
        if t["outcome"] == "skipped" and needs_cuda(t["nodeid"]):
            continue  # not run without a GPU, counts for nothing: the stage's report says so
        entry = {"name": f"{stage_title(stage)} / {t['label']}",
                 "score": earned.get(t["nodeid"], 0.0), "max_score": worth.get(t["nodeid"], 0.0),
                 "visibility": "visible" if is_public(t["nodeid"], public) else "after_published"}
        if t["outcome"] == "failed":
            entry["status"] = "failed"
            entry["output"] = t["message"].strip() or "the check failed (no message)"
        elif t["outcome"] == "skipped":
            entry["output"] = f"skipped: {t['message'].strip() or 'not run'} (counts for no points)"
        else:
            entry["status"] = "passed"
        entries.append(entry)
    return score, entries


def results(graded: dict, points: dict[str, float]) -> dict:
    """Gradescope's results.json of the verdicts ``graded`` (grader.cells.grade_folder) on ``points``."""
    tests, lines, total = [], [], 0.0
    for stage, max_points in points.items():
        score, entries = stage_entries(stage, max_points, [t for t in graded["tests"] if t["stage"] == stage],
                                       public_names(stage))
        total += score
        tests.extend(entries)
        lines.append(f"{stage_title(stage):<36} {score:>6g} of {max_points:g}")
    confinement = graded.get("confinement") or {}
    lines += ["", f"Total: {round(total, 2):g} of {round(sum(points.values()), 2):g} points. Checks marked hidden "
              "show their results when the grades are published.",
              f"(graded in {graded.get('seconds', 0):.1f} s; sandbox: {confinement.get('mode', 'unknown')})"]
    tests.append(sandbox_entry(confinement))
    return {"score": round(total, 2), "output": "\n".join(lines), "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests}


def sandbox_entry(confinement: dict) -> dict:
    """An unscored entry for instructors only (Gradescope's "hidden"): how this submission's code was kept apart,
    and, when it was not (plain, which the instructor allowed), that the grade rests on trusting it."""
    mode = confinement.get("mode", "unknown")
    lacking = ", ".join(confinement.get("missing", [])) or "nothing"
    warning = ("UNCONFINED: learner code ran as root beside the grader and could have read the solutions and "
               "hidden tests or changed its own grade; grades are only as good as the submissions are honest. "
               if mode == "plain" else "")
    return {"name": f"Sandbox: {mode}" + (" (UNCONFINED)" if mode == "plain" else ""), "score": 0, "max_score": 0,
            "status": "passed" if mode != "plain" else "failed", "visibility": "hidden",
            "output": f"{warning}Confinement: {mode}; it lacks: {lacking} (see the kit's README, Trusting the grades)."}


def failure(why: str) -> dict:
    return {"score": 0, "output": f"This submission could not be graded: {why}\nPlease tell your instructor.",
            "visibility": "visible", "tests": []}


def run(root, settings_file) -> dict:
    """Grade ``root``/submission/ with the settings in ``settings_file`` and write ``root``/results/results.json
    (also when grading fails: score 0 and why). Returns what it wrote."""
    root = Path(root)
    try:
        settings = json.loads(Path(settings_file).read_text())
        points = settings["points"]
        folder = root / "submission"
        if not S.sources(folder):
            found = failure(f"no stage module (like {next(iter(points))}.py) at the top level of the upload: "
                            "submit the module files themselves, not a folder or an archive")
        else:
            limits = Limits(check_seconds=settings["test_timeout"], budget_seconds=settings["time_budget"])
            # All of the container's root (the kit, this run's settings, run_autograder, results/) is the
            # grader's: boxes get a copy of the submission's modules.
            graded = grade_folder(folder, limits, list(points), allow_plain=settings.get("allow_plain", False),
                                  private=[root])
            found = results(graded, points)  # (the worker, and every box of it, is gone)
    except Exception as exc:  # a worker error, a broken image: Gradescope must still get a verdict
        traceback.print_exc()
        found = failure(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    write_atomic(root / "results" / "results.json", json.dumps(found, indent=1) + "\n")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m grader.gradescope", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="grade ROOT/submission/ into ROOT/results/results.json")
    p.add_argument("--root", default=os.environ.get(ROOT_ENV, "/autograder"))
    p.add_argument("--settings", help=f"default: ROOT/source/{SETTINGS}")
    args = parser.parse_args(argv)
    found = run(args.root, args.settings or Path(args.root) / "source" / SETTINGS)
    print(found["output"])
    return 0


def cli(args) -> int:
    """``attnkit gradescope``."""
    from .course import CourseError

    try:
        points = plan_points(args.total, None, args.assignment)
    except CourseError as exc:
        print(f"attnkit gradescope: error: {exc}", file=sys.stderr)
        return 2
    if budget_problem(args.test_timeout, args.time_budget):
        print(f"attnkit gradescope: error: {budget_problem(args.test_timeout, args.time_budget)}", file=sys.stderr)
        return 2
    out = build_zip(args.out, args.assignment, points, args.test_timeout, args.time_budget, args.allow_plain)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): Gradescope's autograder for {args.assignment}, "
          f"{len(points)} stages, {sum(points.values()):g} points; upload it as a zip-file autograder "
          "(Ubuntu base image, no GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
