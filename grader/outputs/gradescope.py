"""Gradescope's autograder: the zip ``attnkit gradescope`` builds, and the run that grades one submission.

Gradescope unzips an autograder into ``/autograder/source/``, runs its ``setup.sh`` once to build the
image, and for every submission copies the student's files into ``/autograder/submission/``, runs
``/autograder/run_autograder`` and reads ``/autograder/results/results.json``
(https://gradescope-autograders.readthedocs.io/en/latest/specs/). The zip holds::

    setup.sh                  what grading needs and nothing else (GRADING_NEEDS: a CPU build of torch, numpy,
                              pytest, pytest-timeout and what they need), at the versions of the machine that
                              built the zip (tested_versions), then the kit from kit/ (editable, without its
                              other dependencies: nbgrader, Dask, matplotlib serve the instructor's side)
    requirements.txt          those versions, pinned (torch apart: it comes from PyTorch's CPU index)
    run_autograder            python3 -m grader.outputs.gradescope run, with kit/ on the path
    attnkit-gradescope.json   the assignment, its points per stage, the time limits, whether plain confinement is
                              allowed and whether speed checks that cannot run count (speed_checks)
    kit/                      the kit's source: grader/, tests/, solutions/, fixtures/ (hidden ones too),
                              assignments/, ...

A submission is graded as ``attnkit grade`` grades one: its stage modules are read the way
``grader.submission`` reads them (a module submitted as a symbolic link fails on import, saying so),
and ``grader.grading.worker.grade_folder`` grades them with a grading worker: the same suite, seed and sandbox.
Students upload the modules themselves; an upload of one folder or one zip file that holds them is
graded as if they had been uploaded alone (``upload``), and an upload without them is told what to
upload (score 0, nothing that needs the instructor).
The hidden tests, hidden fixtures and solutions must be in the image, since grading needs them; learner
code runs only in a sandbox box, whose world holds the Python installation and its own modules, not
/autograder. How well a box is kept apart depends on the container (see README, "Trusting the grades"):
Gradescope runs the autograder as root in Docker, where the run records the confinement it got in the
results' output; in ``plain`` mode (no namespaces) the box is only a child process with resource limits.

results.json has one test per counted check, worth points / counted of its stage (``check_worth``: to four
decimals, the same for every submission) and scoring all of it if it passed, nothing if not; the stage's
total and the top-level score are ``grader.grading.scoring.stage_score``'s, to the hundredth as ``attnkit grade`` and
nbgrader give them, and the checks of a stage add up to it within half a hundredth.
Checks that need CUDA are skipped on Gradescope's machines and count for nothing, as in ``attnkit grade``:
they are not listed, and the stage's report says how many there were. The kernels' speed checks are such checks,
unless the zip was built with ``--speed-checks count``: then they fail, saying why, and cost their points. Public
checks (marked ``public``, the ones students have) are ``visible``; hidden ones ``after_published``, with their
failure message (the diagnosis, never test code). Each stage also gets an unscored entry named with its heading
and total ("Stage 8: Causal attention, batched total: 9 of 12 points") whose output is the stage's report and
whose status says whether every check passed: unscored, so that the entries never count a point twice whether
Gradescope adds up the tests or takes the top-level score; ``after_published`` too, since the report names the
hidden checks. The top-level output, shown to the student at once, lists the stage totals in columns; every
output is plain text (``TEXT_OUTPUT``: Gradescope's default format would collapse the columns, and read
whatever a learner's message holds as markup). An upload without the assignment's modules gets score 0 and what to
upload. A submission the grader fails on (twice: ``grade_folder`` tries a fresh worker and sandbox) gets no
results.json, and run_autograder exits non-zero: Gradescope then shows an autograder failure to the student and the
staff, with the reason in the autograder's log, never a score.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

import jinja2

from suite_runtime import DEFAULT_SPEED_CHECKS, SpeedChecks
from suite_runtime.stage_names import module_files, stage_test_file

from ..errors import UploadError
from ..grading.contracts import Graded, Verdict
from ..grading.records import write_atomic
from ..grading.scoring import needs_cuda, stage_report, stage_score

# Everything this process will use is imported before any learner code runs (no lazy imports).
from ..grading.worker import grade_folder
from ..kit import KIT, SUITE, assignment_of, plan_points, stage_info
from ..kit import assignment as assignment_record
from ..sandbox.confinement import ConfinementRecord
from ..sandbox.limits import TEST_TIMEOUT, Limits
from ..submission import MAX_MODULE_BYTES, linked_modules
from ..suite import public_tests
from ..untrusted import printable

ROOT_ENV = "ATTNKIT_GRADESCOPE_ROOT"  # Gradescope's container root, /autograder unless set (the kit's test sets it)
SETTINGS = "attnkit-gradescope.json"
KIT_FOLDER = "kit"  # where the zip holds the kit's source
SHIPPED = ("pyproject.toml", "README.md", "conftest.py", "grader", "tests", "solutions", "exercises", "fixtures",
           "assignments")
SKIPPED_NAMES = ("__pycache__", ".pytest_cache")
CPU_TORCH = "https://download.pytorch.org/whl/cpu"
# What grading imports (the suite's and the grader's side); the kit's other dependencies (nbgrader, Dask,
# matplotlib, tqdm) serve the instructor's commands. kit_tests/outputs/test_gradescope.py grades with these alone.
GRADING_NEEDS = ("torch", "numpy", "pytest", "pytest-timeout")
REQUIREMENTS = "requirements.txt"
TEXT_OUTPUT = {"output_format": "text", "test_output_format": "text", "test_name_format": "text"}

# The two scripts are templates in grader/outputs/templates/ (bash, with the names below filled in).
TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("grader.outputs", "templates"), keep_trailing_newline=True,
                               undefined=jinja2.StrictUndefined)


def run_autograder() -> str:
    """run_autograder: the same for every zip but for the names of the kit's folder and settings."""
    return TEMPLATES.get_template("run_autograder.j2").render(root_env=ROOT_ENV, kit=KIT_FOLDER, settings=SETTINGS)


# ---------------------------------------------------------------- the zip

def build_zip(out, assignment: str = "attention", points: dict[str, float] | None = None,
              test_timeout: float = TEST_TIMEOUT, time_budget: float | None = None, allow_plain: bool = False,
              speed_checks: SpeedChecks = DEFAULT_SPEED_CHECKS) -> Path:
    """Write Gradescope's autograder zip for ``assignment`` to ``out``; ``points``: stage module -> points
    (default: the course's default plan, 100 in all); ``allow_plain``: grade even where no confinement holds;
    ``speed_checks``: "skip" or "count" the speed checks that cannot run (Gradescope has no GPU)."""
    points = points or plan_points(100, None, assignment)
    settings = {"assignment": assignment, "points": points, "test_timeout": test_timeout, "time_budget": time_budget,
                "allow_plain": allow_plain, "speed_checks": speed_checks}
    versions = tested_versions((*GRADING_NEEDS, *assignment_record(assignment).requirement_names))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        _add(zf, "setup.sh", setup_sh(versions), executable=True)
        _add(zf, REQUIREMENTS, "".join(f"{name}=={version}\n" for name, version in sorted(versions.items())
                                       if name != "torch"))
        _add(zf, "run_autograder", run_autograder(), executable=True)
        _add(zf, SETTINGS, json.dumps(settings, indent=1) + "\n")
        for name in SHIPPED:
            path = KIT / name
            for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if (file.is_file() and not file.is_symlink() and not set(file.parts) & set(SKIPPED_NAMES)
                        and not any(part.endswith(".egg-info") for part in file.parts)):  # (a build's leftovers)
                    zf.write(file, f"{KIT_FOLDER}/{file.relative_to(KIT)}")
    return out


def tested_versions(needs=GRADING_NEEDS) -> dict[str, str]:
    """name -> version of ``needs`` and of everything they require, as installed here (where the kit was
    tested): what the autograder's image installs. Local labels are dropped (torch 2.13.0+cpu -> 2.13.0: the
    image takes the CPU build of that version)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    found: dict[str, str] = {}
    todo = list(needs)
    while todo:
        dist = distribution(todo.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in found:
            continue
        found[name] = Version(dist.version).public
        for line in dist.requires or []:
            required = Requirement(line)
            if required.marker is None or required.marker.evaluate({"extra": ""}):
                todo.append(required.name)
    return found


def python_floor(versions: dict[str, str]) -> tuple[int, int]:
    """The oldest Python 3 that every one of ``versions`` supports (their Requires-Python), as installed here."""
    from importlib.metadata import distribution

    from packaging.specifiers import SpecifierSet

    metadata = [distribution(name).metadata for name in versions]
    needs = [SpecifierSet(m["Requires-Python"] if "Requires-Python" in m else "") for m in metadata]
    return next((3, minor) for minor in range(8, 100) if all(f"3.{minor}.99" in spec for spec in needs))


def setup_sh(versions: dict[str, str]) -> str:
    """setup.sh for ``versions`` (``tested_versions``): torch from the CPU index, the rest from REQUIREMENTS."""
    floor = python_floor(versions)
    built = f"Python {sys.version_info.major}.{sys.version_info.minor}, torch {versions['torch']}"
    return TEMPLATES.get_template("setup.sh.j2").render(
        built=built, floor=floor, floor_text=".".join(map(str, floor)), torch=versions["torch"], index=CPU_TORCH,
        requirements=REQUIREMENTS, kit=KIT_FOLDER)


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


def check_worth(points: float, counted: int) -> float:
    """What one of a stage's ``counted`` checks is worth: the same for every check and every submission (a
    stage's counted checks do not depend on the submission), to four decimals so that Gradescope shows it
    plainly; n of them add up to ``points`` within n / 20000."""
    return round(points / counted, 4) if counted else 0.0


def stage_entries(stage: str, points: float, tests: Sequence[Verdict], public: set[str]) -> tuple[float, list[dict]]:
    """(the stage's score, its results.json entries: its total, then one per counted or non-CUDA skipped check)."""
    score = stage_score(tests, points)
    worth = check_worth(points, sum(t["outcome"] in ("passed", "failed") for t in tests))
    entries = [total_entry(stage, points, tests)]
    for t in tests:
        if t["outcome"] == "skipped" and needs_cuda(t["nodeid"]):
            continue  # not run without a GPU, counts for nothing: the stage's report says so
        counted = t["outcome"] in ("passed", "failed")
        entry = {"name": f"{stage_info(stage).heading} / {t['label']}",
                 "score": worth if t["outcome"] == "passed" else 0.0, "max_score": worth if counted else 0.0,
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


def total_entry(stage: str, points: float, tests: Sequence[Verdict]) -> dict:
    """A stage's unscored entry: its total in the name, its report as output, passed when every check did."""
    failed = any(t["outcome"] == "failed" for t in tests)
    return {"name": f"{stage_info(stage).heading} total: {stage_score(tests, points):g} of {points:g} points",
            "status": "failed" if failed else "passed", "output": stage_report(stage, points, tests),
            "visibility": "after_published"}


def results(graded: Graded, points: Mapping[str, float]) -> dict:
    """Gradescope's results.json of the verdicts ``graded`` (grader.grading.worker.grade_folder) on ``points``."""
    tests: list[dict] = []
    rows: list[tuple[str, str]] = []
    total = 0.0
    for stage, max_points in points.items():
        score, entries = stage_entries(stage, max_points, [t for t in graded["tests"] if t["stage"] == stage],
                                       public_names(stage))
        total += score
        tests.extend(entries)
        rows.append((stage_info(stage).heading, f"{score:>6g} of {max_points:g}"))
    width = max(len(heading) for heading, _ in rows)  # (the stage totals in columns)
    lines = [f"{heading:<{width}} {score}" for heading, score in rows]
    confinement = graded["confinement"]
    mode = confinement["mode"] if confinement else "unknown"
    lines += ["", f"Total: {round(total, 2):g} of {round(sum(points.values()), 2):g} points. Checks marked hidden "
              "show their results when the grades are published.",
              f"(graded in {graded.get('seconds', 0):.1f} s; sandbox: {mode})"]
    tests.append(sandbox_entry(confinement))
    return {"score": round(total, 2), "output": "\n".join(lines), "visibility": "visible",
            "stdout_visibility": "hidden", "tests": tests, **TEXT_OUTPUT}


def sandbox_entry(confinement: ConfinementRecord | None) -> dict:
    """An entry without points, for instructors only (Gradescope's "hidden"): how this submission's code was kept apart
    (None: not known), and, when it was not (plain, which the instructor allowed), that the grade rests on trusting
    it."""
    mode = confinement["mode"] if confinement else "unknown"
    lacking = (", ".join(confinement["missing"]) if confinement else "") or "nothing"
    warning = ("UNCONFINED: learner code ran as root beside the grader and could have read the solutions and "
               "hidden tests or changed its own grade; grades are only as good as the submissions are honest. "
               if mode == "plain" else "")
    return {"name": f"Sandbox: {mode}" + (" (UNCONFINED)" if mode == "plain" else ""),
            "status": "passed" if mode != "plain" else "failed", "visibility": "hidden",
            "output": f"{warning}Confinement: {mode}; it lacks: {lacking} (see the kit's README, Trusting the grades)."}


def to_fix(why: str) -> dict:
    """The results of an upload the student can put right: score 0, and what to upload."""
    return {"score": 0, "output": f"Nothing was graded: {why}", "visibility": "visible", "tests": [], **TEXT_OUTPUT}


# ---------------------------------------------------------------- what was uploaded

MAX_ZIP_BYTES = 50 << 20  # an uploaded zip larger than this is not opened
IGNORED = ("__MACOSX", "__pycache__")  # folders that zips and Python leave beside the modules



@contextlib.contextmanager
def upload(submission: Path, stages: list[str]):
    """The folder whose stage modules are graded: ``submission`` if they are at its top level, else the one
    folder (not a link) or zip file at its top level that holds them (a zip: at its top level or in a folder
    of it). A zip's modules are taken out, as regular files within the size a module may have, into a
    private folder that lasts as long as the context. An UploadError says what to upload otherwise."""
    from ..sandbox import scratch

    wanted = [f"{stage}.py" for stage in stages]
    if _ours(submission, wanted):
        yield submission
        return
    # where the assignment's modules are, a folder or (a zip, its folder) -> their zip members (a folder: none)
    places: dict[Path | tuple[Path, str], list[zipfile.ZipInfo]] = {}
    for entry in sorted(Path(submission).iterdir()):
        if entry.is_symlink() or entry.name.startswith(".") or entry.name in IGNORED:
            continue
        if entry.is_dir() and _ours(entry, wanted):
            places[entry] = []
        elif entry.suffix.lower() == ".zip" and entry.is_file():
            for folder, members in _zipped(entry, wanted).items():
                places[(entry, folder)] = members
    if len(places) != 1:
        raise UploadError(_what_to_upload(submission, wanted, places))
    ((place, members),) = places.items()
    if isinstance(place, Path):
        yield place
        return
    archive, _ = place
    with scratch.Folder("upload") as unpacked:
        try:
            with zipfile.ZipFile(archive) as zf:
                for info in members:
                    with zf.open(info) as data:
                        text = data.read(MAX_MODULE_BYTES + 1)
                    if len(text) <= MAX_MODULE_BYTES:  # a larger module is not graded (grader.submission)
                        (unpacked.path / PurePosixPath(info.filename).name).write_bytes(text)
        except (OSError, RuntimeError, EOFError, NotImplementedError, zipfile.BadZipFile, zlib.error) as exc:
            raise UploadError(f"{printable(archive.name)} could not be read ({printable(exc)}): upload the "
                              f"modules themselves ({', '.join(wanted)}); you may submit again") from None
        yield unpacked.path


def _ours(folder: Path, wanted: list[str]) -> bool:
    """Whether ``folder`` holds a stage module of ``wanted`` (a file, or a link: graded as one that fails)."""
    return bool(({p.name for p in module_files(folder)} | set(linked_modules(folder))) & set(wanted))


def _zipped(archive: Path, wanted: list[str]) -> dict[str, list[zipfile.ZipInfo]]:
    """folder of the zip ("" for its top level) -> its members that are stage modules of ``wanted``, regular
    files, at the top level or one folder down; {} for a file that is no zip this reads."""
    try:
        if archive.stat().st_size > MAX_ZIP_BYTES:
            return {}
        with zipfile.ZipFile(archive) as zf:
            members = zf.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return {}
    found: dict[str, list[zipfile.ZipInfo]] = {}
    for info in members:
        path = PurePosixPath(info.filename)
        regular = (info.external_attr >> 16) & 0o170000 in (0, 0o100000)  # not a link, a device, a folder
        if (len(path.parts) <= 2 and path.name in wanted and regular and not info.is_dir()
                and not set(path.parts) & set(IGNORED)):
            found.setdefault(str(path.parent) if len(path.parts) == 2 else "", []).append(info)
    return found


def _what_to_upload(submission: Path, wanted: list[str], places: Mapping[Path | tuple[Path, str], object]) -> str:
    where = [f"{place.relative_to(submission)}/" if isinstance(place, Path) else
             f"{place[0].name}" + (f" (in {place[1]}/)" if place[1] else "") for place in places]
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(submission).iterdir())
    others = sorted({printable(p.name) for p in module_files(submission)} - set(wanted))
    said = [f"the stage modules are in {len(where)} places ({', '.join(map(printable, where))}): upload one set"
            if places else "no stage module of this assignment was found in the upload"]
    if others:
        said.append(f"{', '.join(others)} belong{'s' * (len(others) == 1)} to the "
                    f"{assignment_of(Path(others[0]).stem)} assignment, not this one")
    said.append(f"upload the modules themselves ({', '.join(wanted)}), or one folder or one zip file that holds "
                "them; you may submit again")
    said.append(f"(uploaded: {', '.join(map(printable, held[:12]))}{' ...' if len(held) > 12 else ''})"
                if held else "(the upload was empty)")
    return "; ".join(said[:-1]) + ". " + said[-1]


class GraderFailed(RuntimeError):
    """The autograder could not grade this submission, for reasons of its own (a broken image, its worker or sandbox
    failing twice): no results.json, so that Gradescope shows an autograder failure, never a score."""


def run(root, settings_file) -> dict:
    """Grade ``root``/submission/ with the settings in ``settings_file`` and write ``root``/results/results.json;
    returns what it wrote. An upload without the modules gets score 0 and what to upload (the student's to put right).
    Any other failure is the grader's: GraderFailed, and no results.json."""
    root = Path(root)
    try:
        settings = json.loads(Path(settings_file).read_text())
        points = settings["points"]
        limits = Limits(check_seconds=settings["test_timeout"], budget_seconds=settings["time_budget"])
        try:
            with upload(root / "submission", list(points)) as folder:
                # All of the container's root (the kit, this run's settings, run_autograder, results/) is the
                # grader's: boxes get a copy of the submission's modules.
                graded = grade_folder(folder, limits, list(points), allow_plain=settings.get("allow_plain", False),
                                      private=[root], speed_checks=settings.get("speed_checks", DEFAULT_SPEED_CHECKS))
            found = results(graded, points)  # (the worker, and every box of it, is gone)
        except UploadError as exc:
            found = to_fix(str(exc))
    except Exception as exc:  # a worker or sandbox that failed twice, a broken image
        raise GraderFailed(f"{type(exc).__name__}: {exc}") from exc
    write_atomic(root / "results" / "results.json", json.dumps(found, indent=1) + "\n")
    return found


FAILED = ("The autograder failed on this submission, for reasons of its own (not the student's work): it wrote no "
          "results.json, so Gradescope reports an autograder failure instead of a score. Fix the cause (the error "
          "above) and regrade the submission.")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m grader.outputs.gradescope", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="grade ROOT/submission/ into ROOT/results/results.json")
    p.add_argument("--root", default=os.environ.get(ROOT_ENV, "/autograder"))
    p.add_argument("--settings", help=f"default: ROOT/source/{SETTINGS}")
    args = parser.parse_args(argv)
    try:
        found = run(args.root, args.settings or Path(args.root) / "source" / SETTINGS)
    except GraderFailed:
        traceback.print_exc(file=sys.stdout)  # the autograder's log, which instructors read
        print(FAILED)
        return 1
    print(printable(found["output"], newlines=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
