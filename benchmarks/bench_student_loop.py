"""The student loop: how long one `pytest` run of the public suite takes, next to importing torch.

    python benchmarks/bench_student_loop.py [--runs 5]

Times, each as the median of --runs runs (the three commands take turns, after one untimed round
that warms the file cache):

    bare     python -c "import torch"                   the floor: every run of the suite imports torch
    kit      python -m pytest -m public -q               in the kit, on the reference solutions
    release  python -m pytest -m public -q               in a release folder made by `attnkit course build`
                                                         + `nbgrader generate_assignment`, with the
                                                         reference solutions copied in (a finished student)

and prints each as a ratio to the bare import. Target for kit and release: at most 2x. The suite
runs must pass.
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
TARGET = 2.0


def run_once(cmd, cwd) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` in {cwd} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return elapsed, proc.stdout


def timed(commands: dict, runs: int) -> dict:
    """name -> median and spread of ``runs`` wall-clock timings of (cmd, cwd). The commands take turns
    (one untimed round first, to warm the file cache), so that a change in the machine's load
    during the benchmark hits all of them alike. Fails loudly if a command fails."""
    times = {name: [] for name in commands}
    output = {}
    for i in range(runs + 1):
        for name, (cmd, cwd) in commands.items():
            elapsed, output[name] = run_once(cmd, cwd)
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
    args = parser.parse_args(argv)

    python = sys.executable
    suite = [python, "-m", "pytest", "-m", "public", "-q", "-p", "no:cacheprovider"]
    with tempfile.TemporaryDirectory(prefix="attnkit-bench-") as tmp:
        print("building a release folder (attnkit course build + nbgrader generate_assignment) ...", flush=True)
        release = make_release(Path(tmp))
        results = timed({
            "bare": ([python, "-c", "import torch"], KIT),
            "kit": (suite, KIT),
            "release": (suite, release),
        }, args.runs)
    rows = [("bare", 'python -c "import torch"', results["bare"]),
            ("kit", "pytest -m public -q  (kit, solutions)", results["kit"]),
            ("release", "pytest -m public -q  (release folder)", results["release"])]
    bare = rows[0][2]["median"]
    print()
    print(f"student loop, median of {args.runs} runs ({os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at the end)")
    print(f"{'':<9}{'command':<40}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>8}")
    for name, what, r in rows:
        print(f"{name:<9}{what:<40}{r['median']:>10.2f}{r['min']:>8.2f}{r['max']:>8.2f}{r['median'] / bare:>7.2f}x")
    print()
    for name, _, r in rows[1:]:
        print(f"{name}: {r['summary']}")
    worst = max(r["median"] for _, _, r in rows[1:]) / bare
    verdict = "meets" if worst <= TARGET else "MISSES"
    print(f"ratio = median time / median of the bare torch import; target <= {TARGET:g}x: {verdict} it "
          f"(worst {worst:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
