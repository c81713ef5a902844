"""Grades that do not depend on the machine's load: the same classes graded idle and beside CPU hogs, compared.

    python benchmarks/load_grading.py [--loads 0,2,6,12] [--corpora samples,catalogue,tamper] [--repeat 1]
                                      [--assignments A,B] [--container] [--out DIR]

Each corpus is prepared once, then graded afresh at each load (a copy of it for every run) with ``attnkit grade``
(a process of its own, as an instructor runs it):

    samples     the demo's sample submissions of every assignment (a folder of submissions per assignment)
    catalogue   the catalogue's mistakes and correct variants in packs (kit_tests/catalogue.py; as
                kit_tests/grading/test_catalogue.py grades them), per assignment
    tamper      the tamper corpora (kit_tests/tamper.py): chapter 3's with its bystanders and late bystanders, and
                modern-attention's and frontier-attention's, each in an nbgrader course of its own, graded by one
                worker with a limit of 3 s per check (as kit_tests/grading/ grades them)
    gradescope  Gradescope's run_autograder on the reference, the stubs and each tamper entry that aims at the grader
                (as kit_tests/sandbox/test_container.py runs it), one submission per run

A load of N is N CPU-bound processes beside the run (every other one niced, as other users' jobs would be); the
run queue is sampled meanwhile (/proc/loadavg's running count: its mean is the table's "load seen"). ``--container``
grades as kit_tests/docker_default.sh runs a command: root with Docker's default capabilities and no cgroups.

Every run's points (per student and stage, to the hundredth, as records and results.json give them) are compared
with the idle run's (the first at load 0). The table says per corpus and load whether they are byte-identical;
``OUT/runs/<corpus>/<load>-<n>/`` keeps each run's log, its records (or results.json) and points, and every run
whose points differ is listed with the students and stages that differ. Exit status: 0 when every run gave the
idle points, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))
sys.path.insert(0, str(KIT / "kit_tests"))  # the catalogue, the tamper corpora, how the kit's tests run commands
ATTNKIT = [sys.executable, "-m", "grader.cli"]
DOCKER = KIT / "kit_tests" / "docker_default.sh"
TAMPER_TIMEOUT = 3.0  # CPU seconds per check for the tamper corpora, as their tests grade them


# ---------------------------------------------------------------- load

class Load:
    """``count`` CPU-bound processes (every other one at nice 10) while the block runs, and the run queue sampled."""

    def __init__(self, count: int):
        self.count, self.samples, self.hogs = count, [], []
        self._stop = threading.Event()

    def __enter__(self):
        for i in range(self.count):
            self.hogs.append(subprocess.Popen(
                [*(["nice", "-n", "10"] if i % 2 else []), sys.executable, "-c", "while True: pass"]))
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.5):
            with open("/proc/loadavg") as handle:
                self.samples.append(int(handle.read().split()[3].split("/")[0]) - 1)  # (less this reader)

    def seen(self) -> float:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else 0.0

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        for hog in self.hogs:
            hog.kill()
            hog.wait()


def run(command, log: Path, env=None, cwd=None, container=False) -> int:
    """``command`` (in a container like Docker's with ``container``), its output into ``log``; its exit status."""
    env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(map(str, command))}\n".encode())
        out.flush()
        return subprocess.run([str(DOCKER), *map(str, command)] if container else list(map(str, command)),
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode


def points_of_records(folder: Path) -> dict:
    """student -> {stage: points} of the records in ``folder`` (attnkit grade's), and the checks' outcomes."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith("grades"):
            continue
        record = json.loads(path.read_text())
        found[record["student"]] = {s["stage"]: s["points"] for s in record["stages"]}
    return found


# ---------------------------------------------------------------- corpora

class Corpus:
    """A class to grade: ``prepare`` once, then ``grade`` a fresh copy of it per run; points come back."""

    name = ""

    def prepare(self, where: Path):
        raise NotImplementedError

    def grade(self, copy: Path, log: Path, container: bool, tmpdir: Path) -> dict:
        raise NotImplementedError


class Folders(Corpus):
    """Folders of submissions, one per assignment (``--submissions``), graded with the default limits."""

    def __init__(self, name, writer, assignments):
        self.name, self.writer, self.assignments = name, writer, assignments

    def prepare(self, where):
        for assignment in self.assignments:
            self.writer(assignment, where / assignment / "submissions")

    def grade(self, copy, log, container, tmpdir):
        points = {}
        for folder in sorted(p for p in copy.iterdir() if p.is_dir()):
            status = run([*ATTNKIT, "grade", folder.name, "--submissions", folder / "submissions", "--out",
                          folder / "grades", "--quiet"], log, env={"TMPDIR": str(tmpdir)}, container=container)
            got = points_of_records(folder / "grades")
            points |= {f"{folder.name}/{student}": stages for student, stages in got.items()}
            if status != 0:
                points[f"{folder.name}/(run)"] = {"exit status": status}
        return points


def write_samples(assignment, dest):
    from grader.course.samples import samples

    for sample in samples(assignment):
        sample.write(dest / sample.student)


def write_catalogue(assignment, dest):
    from grading.test_catalogue import packs_of

    from grader.course.samples import write_modules

    for index, pack in enumerate(packs_of(assignment)):
        write_modules(dest / f"pack-{index}", assignment=assignment,
                      replaced={stage: entry.modules()[stage] for stage, entry in pack.items()})


class Tamper(Corpus):
    """The tamper corpora, each in an nbgrader course of its own, graded by one worker (one template for all)."""

    name = "tamper"

    def __init__(self, assignments):
        self.assignments = assignments

    def prepare(self, where):
        from grader.course.build import build
        from grader.course.samples import by_student, write_submission
        from tamper import ASSIGNMENT_CORPORA, BYSTANDERS, LATE, Context, corpus, write_entry

        corpora = {"attention": (corpus(), BYSTANDERS)}
        corpora |= {name: (entries(), ("reference",)) for name, entries in ASSIGNMENT_CORPORA.items()}
        for assignment, (entries, bystanders) in corpora.items():
            if assignment not in self.assignments:
                continue
            root = where / assignment
            build(root, assignments=[assignment], test_timeout=TAMPER_TIMEOUT)
            subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", assignment], cwd=root,
                           check=True, capture_output=True)
            release = root / "release" / assignment
            ctx = Context(course=root, assignment=assignment, bystanders=bystanders)
            for student in bystanders:
                for name in (student, LATE + student):
                    write_submission(by_student(student, assignment), release, root / "submitted" / name / assignment)
            for entry in entries:
                write_entry(entry, ctx, release, root / "submitted" / entry.name / assignment)

    def grade(self, copy, log, container, tmpdir):
        from grader.grading import records as R

        points = {}
        for root in sorted(p for p in copy.iterdir() if p.is_dir()):
            status = run([*ATTNKIT, "grade", root.name, "--course", root, "--workers", "1", "--quiet"], log,
                         env={"TMPDIR": str(tmpdir)}, container=container)
            got = points_of_records(R.results_dir(root, root.name))
            points |= {f"{root.name}/{student}": stages for student, stages in got.items()}
            if status != 0:
                points[f"{root.name}/(run)"] = {"exit status": status}
        return points


class Gradescope(Corpus):
    """Gradescope's run_autograder, one submission per run: the reference, the stubs, the attacks on the grader
    (kit_tests/sandbox/test_container.py's, less reach-outside, which needs Gradescope's own layout)."""

    name = "gradescope"

    def __init__(self, assignments):
        pass  # (chapter 3's, as kit_tests/sandbox/test_container.py grades it)

    def prepare(self, where):
        from grader.course.samples import by_student, write_modules
        from grader.outputs.gradescope import build_zip
        from tamper import Context, corpus

        build_zip(where / "autograder.zip", "attention", test_timeout=TAMPER_TIMEOUT)
        for name, sample in (("reference", "reference"), ("stubs", "untouched")):
            by_student(sample).write(where / "uploads" / name)  # every stage module, as a student uploads them
        ctx = Context(course=where / "autograder", assignment="attention", bystanders=())
        for entry in corpus():
            if entry.name in ("reach-the-grader", "read-dependency", "leak-dressed", "steal-reference"):
                write_modules(where / "uploads" / entry.name, replaced=entry.modules(ctx), assignment="attention")

    def grade(self, copy, log, container, tmpdir):
        from gradescope_results import unzip

        from grader.outputs.gradescope import ROOT_ENV

        points = {}
        # the reference first, in a fresh container, as the bystander that once got 0 was graded (issue 33)
        for upload in sorted((copy / "uploads").iterdir(), key=lambda path: (path.name != "reference", path.name)):
            root = copy / "runs" / upload.name / "autograder"
            unzip(copy / "autograder.zip", root / "source")
            shutil.copytree(upload, root / "submission")
            (root / "results").mkdir()
            status = run([root / "source" / "run_autograder"], log, cwd=root, container=container,
                         env={ROOT_ENV: str(root), "TMPDIR": str(tmpdir),
                              "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
            results = root / "results" / "results.json"
            found = json.loads(results.read_text()) if results.is_file() else None
            points[upload.name] = {"score": found["score"] if found else None, "exit status": status}
            if found:
                shutil.copy(results, log.parent / f"{upload.name}.results.json")
        return points


CORPORA = {"samples": lambda chosen: Folders("samples", write_samples, chosen),
           "catalogue": lambda chosen: Folders("catalogue", write_catalogue, chosen), "tamper": Tamper,
           "gradescope": Gradescope}


# ---------------------------------------------------------------- the runs

def grader_failures(points: dict) -> list[str]:
    """What in a run's points is the grader's own failure (a command that failed, a run with no score): never a
    grade to compare, even when the idle run failed the same way."""
    return [f"{who}: the grader failed ({found})" for who, found in sorted(points.items())
            if found.get("exit status") or ("score" in found and found["score"] is None)]


def differences(idle: dict, got: dict) -> list[str]:
    said = []
    for student in sorted(set(idle) | set(got)):
        a, b = idle.get(student, {}), got.get(student, {})
        for stage in sorted(set(a) | set(b)):
            if a.get(stage) != b.get(stage):
                said.append(f"{student} {stage}: {a.get(stage)} idle, {b.get(stage)} here")
    return said


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", default="0,2,6,12", help="CPU hogs beside each run (0 first: the idle grades)")
    parser.add_argument("--corpora", default="samples,catalogue,tamper", help=f"of {', '.join(CORPORA)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs at each load")
    parser.add_argument("--assignments", default=None, help="those of the kit's assignments to grade (default: all)")
    parser.add_argument("--container", action="store_true", help="grade in a container as Docker makes one")
    parser.add_argument("--out", type=Path, default=None, help="where the logs go (default: a new folder in /tmp)")
    args = parser.parse_args(argv)
    from grader.kit import assignments

    loads = [int(n) for n in args.loads.split(",")]
    chosen = args.assignments.split(",") if args.assignments else assignments()
    if loads[0] != 0:
        loads.insert(0, 0)
    out = (args.out or Path(tempfile.mkdtemp(prefix="load-grading-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs in {out}", flush=True)
    if args.container:
        from runs import kit_modes_kept
    modes = kit_modes_kept() if args.container else contextlib.nullcontext()
    rows, failed = [], False
    with modes:
        for name in args.corpora.split(","):
            corpus = CORPORA[name](chosen)
            prepared = out / "prepared" / name
            if not prepared.exists():
                corpus.prepare(prepared)
            idle = None
            for load in loads:
                for n in range(args.repeat if load or idle is not None else 1):
                    where = out / "runs" / name / f"{load}-{n}"
                    if where.exists():
                        shutil.rmtree(where)
                    where.mkdir(parents=True)
                    copy = where / "work"
                    shutil.copytree(prepared, copy, symlinks=True)
                    # TMPDIR the boxes (other uids in a container) may pass through
                    tmpdir = Path(tempfile.mkdtemp(prefix="load-tmp-", dir="/tmp"))
                    tmpdir.chmod(0o711)
                    started = time.monotonic()
                    try:
                        with Load(load) as hogs:
                            points = corpus.grade(copy, where / "log.txt", args.container, tmpdir)
                    finally:
                        shutil.rmtree(tmpdir, ignore_errors=True)
                    seconds = time.monotonic() - started
                    (where / "points.json").write_text(json.dumps(points, indent=1, sort_keys=True))
                    if idle is None:
                        idle = points
                    said = grader_failures(points) + differences(idle, points)
                    if said:
                        failed = True
                        (where / "DIFFERS.txt").write_text("\n".join(said) + "\n")
                        for records in copy.rglob("attnkit-grades"):  # keep the records of a run that differs
                            shutil.copytree(records, where / "records" / records.parent.name, dirs_exist_ok=True)
                        for records in copy.rglob("grades"):
                            if records.is_dir():
                                shutil.copytree(records, where / "records" / records.parent.name, dirs_exist_ok=True)
                    shutil.rmtree(copy, ignore_errors=True)
                    row = (name, load, n, hogs.seen(), len(points), round(seconds), "identical" if not said
                           else f"{len(said)} differ")
                    rows.append(row)
                    print("  ".join(map(str, row)), flush=True)
                    if said:
                        print("    " + "\n    ".join(said[:20]), flush=True)
    print("\n| corpus | hogs | run | load seen | submissions | seconds | points vs idle |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
