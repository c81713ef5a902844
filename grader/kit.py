"""The kit's files, its assignments and their stages: where everything is, and the course content as data.

An assignment is a folder ``assignments/<name>/`` (``ASSIGNMENTS_FOLDER``)::

    assignment.toml      name, letter (its stage modules' first letter), order, title, intro and outro
                         (Markdown, read as Jinja2 templates), and one [[stages]] table per stage in teaching
                         order: module (<letter>NN_topic), title, points (its default share of a total)
    lessons/<module>.md  what the stage teaches (the notebook's text; its title is the record's)
    demos/<module>.py    a script that imports the stage module and prints what it computes
    fixtures.py          one generator per stage module, <module>(ref, public, hidden) (grader.authoring.fixtures)
    samples.py           (optional) the demo's sample submissions, SAMPLES (grader.course.samples)

A record may also say ``requires``: the packages its stages need beyond STUDENT_PACKAGES (pip requirements: the
kernels assignment's "triton>=3.9"), which its release's requirements.txt and its Gradescope image install.

The stages' solutions, stubs, tests and fixtures stay in the kit's flat folders (``SOLUTIONS``,
``EXERCISES``, ``SUITE``, ``FIXTURES``), as a student's folder is flat. Nothing of the engine names a stage:
it reads them here.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from suite_runtime.stage_names import ASSIGNMENTS_FOLDER, RECORD, is_stage_module, marker, records, stage_test_file

from .errors import AssignmentError, CourseError

KIT = Path(__file__).resolve().parent.parent
SOLUTIONS = KIT / "solutions"  # the reference implementation
EXERCISES = KIT / "exercises"  # the stubs learners start from (attnkit stubs writes them)
FIXTURES = KIT / "fixtures"  # stored arrays: public/ ships to students, hidden/ never does
SUITE = KIT / "tests"  # the graded suite: stage tests and their support modules
# What a student installs to work on a release: its modules, tests and notebook import torch, numpy and pytest
# (the suite's own plugin keeps each check's time limit; grader.course.build writes them into requirements.txt).
STUDENT_PACKAGES = ("torch", "numpy", "pytest")
# A reference solution marks the learner's parts with nbgrader's delimiters (attnkit stubs makes each a TODO).
SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"


@dataclass(frozen=True)
class Stage:
    """One stage, as its assignment's record describes it."""

    module: str  # its module's name, <letter>NN_topic
    title: str  # what the notebook, the feedback, Gradescope and the stage's report call it
    points: float  # its default share of an assignment's total
    number: int  # its place in its assignment, from 1
    assignment: str

    @property
    def marker(self) -> str:
        return marker(self.module)

    @property
    def heading(self) -> str:
        """The stage's name wherever it is shown: 'Stage 8: Causal attention, batched'."""
        return f"Stage {self.number}: {self.title}"


@dataclass(frozen=True)
class Assignment:
    """An assignment's record (assignment.toml) and where its files are."""

    name: str
    letter: str
    title: str
    intro: str
    outro: str
    stages: tuple[Stage, ...]
    folder: Path
    requires: tuple[str, ...] = ()  # packages beyond STUDENT_PACKAGES (pip requirements)

    @property
    def requirement_names(self) -> tuple[str, ...]:
        """The distributions ``requires`` names (triton>=3.9 -> triton)."""
        from packaging.requirements import Requirement

        return tuple(Requirement(line).name for line in self.requires)

    def missing(self) -> list[str]:
        """The requirements of ``requires`` this Python lacks (none installed to its version): the assignment cannot
        be graded here until they are."""
        from importlib.metadata import PackageNotFoundError, version

        from packaging.requirements import Requirement

        lacking = []
        for line in self.requires:
            requirement = Requirement(line)
            try:
                if requirement.specifier.contains(version(requirement.name), prereleases=True):
                    continue
            except PackageNotFoundError:
                pass
            lacking.append(line)
        return lacking

    @property
    def modules(self) -> list[str]:
        return [stage.module for stage in self.stages]

    def lesson(self, stage: str) -> str:
        return (self.folder / "lessons" / f"{stage}.md").read_text()

    def demo(self, stage: str) -> Path:
        return self.folder / "demos" / f"{stage}.py"

    def module(self, name: str) -> ModuleType | None:
        """The assignment's Python file ``name``.py (fixtures, samples, or a helper they share) as a module,
        loaded once; None when the assignment has none."""
        return _load(self.folder / f"{name}.py", f"attnkit_assignments.{self.name.replace('-', '_')}.{name}")


def _record(raw: dict) -> Assignment:
    """An Assignment from its parsed record, or an AssignmentError saying what is wrong in which file."""
    where = Path(raw["folder"]) / RECORD
    missing = [key for key in ("name", "letter", "title", "intro", "outro", "stages") if key not in raw]
    if missing:
        raise AssignmentError(f"{where}: no {', '.join(missing)}")
    name, letter = raw["name"], raw["letter"]
    if name != Path(raw["folder"]).name:
        raise AssignmentError(f"{where}: name = {name!r}, but its folder is {Path(raw['folder']).name!r}")
    if not (isinstance(letter, str) and len(letter) == 1 and letter.islower()):
        raise AssignmentError(f"{where}: letter = {letter!r}: one lower-case letter, which its modules start with")
    stages = []
    for number, entry in enumerate(raw["stages"], start=1):
        module = entry.get("module", "")
        if not (is_stage_module(module) and module.startswith(f"{letter}{number:02d}_")):
            raise AssignmentError(f"{where}: stage {number} is {module!r}; stage modules are named "
                                  f"{letter}{number:02d}_topic, in teaching order")
        points = entry.get("points")
        if not (isinstance(points, (int, float)) and points >= 0) or not entry.get("title"):
            raise AssignmentError(f"{where}: stage {module} needs a title and points (a number >= 0)")
        stages.append(Stage(module, entry["title"], float(points), number, name))
    requires = raw.get("requires", [])
    if not (isinstance(requires, list) and all(isinstance(r, str) and r.strip() for r in requires)):
        raise AssignmentError(f"{where}: requires = {requires!r}: a list of pip requirements (\"triton>=3.9\")")
    return Assignment(name, letter, raw["title"], raw["intro"], raw["outro"], tuple(stages), Path(raw["folder"]),
                      tuple(requires))


@cache
def assignments() -> dict[str, Assignment]:
    """The kit's assignments (``ASSIGNMENTS_FOLDER``), in the order a course teaches them. A record the kit
    cannot use is an AssignmentError naming its file."""
    try:
        found = [_record(raw) for raw in records()]
    except ValueError as exc:  # (a record that is no TOML)
        raise AssignmentError(str(exc)) from None
    if not found:
        raise AssignmentError(f"no assignment in {ASSIGNMENTS_FOLDER} (each is a folder holding its {RECORD})")
    for kind, values in (("letter", [a.letter for a in found]), ("marker",
                                                                [s.marker for a in found for s in a.stages])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise AssignmentError(f"two stages or assignments share the {kind} {', '.join(twice)} "
                                  f"({ASSIGNMENTS_FOLDER})")
    return {a.name: a for a in found}


def assignment(name: str | None = None) -> Assignment:
    """The assignment ``name`` (None: the first, which a command means when it names none)."""
    every = assignments()
    if name is None:
        return next(iter(every.values()))
    if name not in every:
        raise AssignmentError(f"no assignment {name!r} in the kit: its assignments are {', '.join(every)}")
    return every[name]


def assignment_of(stage: str) -> str | None:
    """The assignment a stage module belongs to, by its letter (the record's ``letter``), or None."""
    return next((a.name for a in assignments().values() if stage[:1] == a.letter), None)


def stage_info(stage: str) -> Stage:
    """A stage module's record: its title, number, points and assignment."""
    for a in assignments().values():
        for info in a.stages:
            if info.module == stage:
                return info
    raise AssignmentError(f"{stage!r} is no stage of the kit's assignments")


def stage_named(name: str) -> str:
    """The stage module a person means by ``name``: its module (as its file is named) or its pytest marker;
    an AssignmentError listing the markers otherwise."""
    every = stages()
    if name in every:
        return name
    found = [stage for stage in every if marker(stage) == name]
    if not found:
        raise AssignmentError(f"no stage {name!r}: name one by its module or its marker "
                              f"({', '.join(map(marker, every))})")
    return found[0]


def stages(name: str | None = None) -> list[str]:
    """Stage module names in teaching order: those of the assignment ``name``, or of every assignment."""
    chosen = [assignment(name)] if name is not None else assignments().values()
    return [module for a in chosen for module in a.modules]


def suite_files(chosen: list[str] | None = None) -> list[Path]:
    """The graded suite's test files, one per stage (of ``chosen``, or of every stage), in teaching order."""
    return [SUITE / stage_test_file(stage) for stage in (stages() if chosen is None else chosen)]


def module_patterns() -> str:
    """The stage modules' file names, as a student reads them: sNN_*.py or mNN_*.py."""
    return " or ".join(f"{a.letter}NN_*.py" for a in assignments().values())


def plan_points(total: float | None = 100, overrides: dict[str, float] | None = None,
                name: str | None = None) -> dict[str, float]:
    """Points per stage module of the assignment ``name`` (default: the first). ``overrides`` (marker -> points)
    fixes some stages (those of other assignments are left to them); the others share what is left of ``total``
    in proportion to their points in the record. total=None: overrides + the record's points as they are."""
    overrides = dict(overrides or {})
    every = [stage_info(s) for s in stages()]
    unknown = sorted(set(overrides) - {s.marker for s in every})
    if unknown:
        raise CourseError(f"unknown stage(s) {', '.join(unknown)}; stages are: {', '.join(s.marker for s in every)}")
    mine = assignment(name).stages
    overrides = {m: p for m, p in overrides.items() if m in {s.marker for s in mine}}
    for m, p in overrides.items():
        if not p >= 0:
            raise CourseError(f"points for {m} must be >= 0, got {p}")
    free = [s for s in mine if s.marker not in overrides]
    weights = {s.module: s.points for s in free}
    fixed = sum(overrides.values())
    if total is None:
        total = fixed + sum(weights.values())
    if fixed > total + 1e-9 or (not free and abs(fixed - total) > 1e-9):
        raise CourseError(f"the stage points given add up to {fixed:g}, which does not fit a total of {total:g}")
    left = total - fixed
    points, given = {}, 0.0
    for s in mine:
        if s.marker in overrides:
            points[s.module] = float(overrides[s.marker])
        elif s == free[-1]:
            points[s.module] = round(left - given, 2)  # absorbs the rounding
        else:
            points[s.module] = round(left * weights[s.module] / sum(weights.values()), 2)
            given += points[s.module]
    return points


_LOADED: dict[Path, ModuleType] = {}


def _load(path: Path, name: str) -> ModuleType | None:
    """The Python file ``path`` as a module named ``name``, executed once (None: no such file)."""
    if path not in _LOADED:
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (dataclasses and pickling look a module up by name)
        spec.loader.exec_module(module)
        _LOADED[path] = module
    return _LOADED[path]
