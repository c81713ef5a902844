"""The student loop: how long one `pytest` run of the public suite takes, next to importing torch.

    python benchmarks/bench_student_loop.py [--runs 5] [--plugins-too]

Times, each as the median of --runs runs (the commands take turns, after one untimed round
that warms the file cache):

    bare     python -c "import torch"                   the floor: every run of the suite imports torch
    stage    python -m pytest --impl=exercises           in the kit, one stage on its stubs (its checks fail,
             -m attention_scores -q                     as they do for a student who has not started)
    kit      python -m pytest -m public -q               in the kit, on the reference solutions
    release  python -m pytest -m public -q               in a release folder made by `attnkit course build`
                                                         + `nbgrader generate_assignment`, with the
                                                         reference solutions copied in (a finished student)

and prints each as a ratio to the bare import. Targets (issue 34): release at most 1.3x, the kit's one
stage 1.5x (the kit's whole public suite, four assignments with Triton's interpreter, has none). The
suite runs must pass (the stage's, on the stubs, must fail).
With --plugins-too, stage and release run a second time with the ini's addopts overridden by the
kit's former ones (-rs --tb=short): every pytest plugin installed loads, as before the release's
pytest.ini and the kit's pyproject.toml blocked those no student run uses; the same run shows both.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))
TARGETS = {"stage": 1.5, "release": 1.3}  # issue 34 (none for the kit's whole suite)
EVERY_PLUGIN = ["-o", "addopts=-rs --tb=short"]  # the ini's addopts before plugins were blocked there


def run_once(cmd, cwd, status=0) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != status:
        raise SystemExit(f"`{' '.join(cmd)}` in {cwd} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return elapsed, proc.stdout


def timed(commands: dict, runs: int) -> dict:
    """name -> median and spread of ``runs`` wall-clock timings of (cmd, cwd[, exit status]). The commands take turns
    (one untimed round first, to warm the file cache), so that a change in the machine's load
    during the benchmark hits all of them alike. Fails loudly if a command fails."""
    times = {name: [] for name in commands}
    output = {}
    for i in range(runs + 1):
        for name, (cmd, cwd, *status) in commands.items():
            elapsed, output[name] = run_once(cmd, cwd, *status)
            if i:
                times[name].append(elapsed)
    return {name: {"median": statistics.median(t), "min": min(t), "max": max(t),
                   "summary": output[name].strip().splitlines()[-1] if output[name].strip() else ""}
            for name, t in times.items()}


def make_release(tmp: Path) -> Path:
    """A course's release folder (what a student downloads), with the reference solutions in it."""
    from grader.course.build import build
    from grader.course.demo import check, load_api
    from grader.kit import SOLUTIONS

    # nbgrader runs `alembic` when it creates the gradebook: find it next to this Python
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    course = build(tmp / "course")
    check(load_api(course.root).generate_assignment(course.assignment, force=True), "generate_assignment")
    release = course.root / "release" / course.assignment
    for name in course.stage_files():
        shutil.copy(SOLUTIONS / name, release / name)
    return release


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per command (default: %(default)s)")
    parser.add_argument("--plugins-too", action="store_true",
                        help="also time stage and release with every installed pytest plugin loading (as before)")
    args = parser.parse_args(argv)

    python = sys.executable
    suite = [python, "-m", "pytest", "-m", "public", "-q", "-p", "no:cacheprovider"]
    stage = [python, "-m", "pytest", "--impl=exercises", "-m", "attention_scores", "-q", "-p", "no:cacheprovider"]
    with tempfile.TemporaryDirectory(prefix="bench-student-loop-") as tmp:
        print("building a release folder (attnkit course build + nbgrader generate_assignment) ...", flush=True)
        release = make_release(Path(tmp))
        commands = {
            "bare": ([python, "-c", "import torch"], KIT),
            "stage": (stage, KIT, 1),
            "kit": (suite, KIT),
            "release": (suite, release),
        }
        if args.plugins_too:
            commands |= {"stage+all": ([*stage, *EVERY_PLUGIN], KIT, 1),
                         "release+all": ([*suite, *EVERY_PLUGIN], release)}
        results = timed(commands, args.runs)
    rows = [("bare", 'python -c "import torch"', results["bare"]),
            ("stage", "pytest -m attention_scores (kit, stubs)", results["stage"]),
            ("kit", "pytest -m public -q  (kit, solutions)", results["kit"]),
            ("release", "pytest -m public -q  (release folder)", results["release"])]
    if args.plugins_too:
        rows += [("stage+all", "the same, every plugin loading", results["stage+all"]),
                 ("release+all", "the same, every plugin loading", results["release+all"])]
    bare = rows[0][2]["median"]
    print()
    print(f"student loop, median of {args.runs} runs ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end)")
    print(f"{'':<12}{'command':<40}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>8}{'target':>8}")
    for name, what, r in rows:
        target = f"{TARGETS[name]:g}x" if name in TARGETS else ""
        print(f"{name:<12}{what:<40}{r['median']:>10.2f}{r['min']:>8.2f}{r['max']:>8.2f}{r['median'] / bare:>7.2f}x"
              f"{target:>8}")
    print()
    for name, _, r in rows[1:]:
        print(f"{name}: {r['summary']}")
    missed = [f"{name} {results[name]['median'] / bare:.2f}x" for name in TARGETS
              if results[name]["median"] / bare > TARGETS[name]]
    print("ratio = median time / median of the bare torch import; "
          + (f"MISSES its target: {', '.join(missed)}" if missed else "every target met"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
