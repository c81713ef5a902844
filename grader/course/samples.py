"""Submissions made from the kit's own modules: the demo's samples, and the one way to make them.

A made-up submission is the reference solutions (or the untouched stubs) with a few small source
edits, the way real mistakes look (``edited``), written out as a folder of stage modules
(``write_modules``). Each assignment's samples (``samples``: its reference, its untouched stubs, and the
typical mistakes of its samples.py) are graded by ``attnkit demo`` and the kit's tests, and ``attnkit samples``
puts them into an instructor's own course for a trial run (``load_into``); the kit's tests also build their
catalogue of mistakes and their tamper corpus this way. ``breaks`` names the stages a sample should lose points
on; every other stage must get full marks.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from shlex import quote

from .. import kit
from ..errors import SampleError
from ..kit import EXERCISES, SOLUTIONS, stages


@dataclass(frozen=True)
class Sample:
    student: str  # an nbgrader student id (no underscores: zip_collect splits on the first one)
    description: str
    base: str = "solutions"  # or "exercises"
    edits: dict = field(default_factory=dict)  # stage module -> [(old, new), ...] (see ``edited``)
    breaks: tuple = ()  # markers of the stages this sample should lose points on ("*": all)
    assignment: str = ""  # the assignment it is a submission of (set where it is read: ``samples``)

    @property
    def base_folder(self) -> Path:
        return SOLUTIONS if self.base == "solutions" else EXERCISES

    def modules(self) -> dict[str, str]:
        """The sample's edited modules (stage module -> source); the others are its base's."""
        return {stage: edited((self.base_folder / f"{stage}.py").read_text(), edits, f"{self.student}/{stage}")
                for stage, edits in self.edits.items()}

    def write(self, dest: Path) -> Path:
        """The sample's stage modules in folder ``dest`` (created if needed)."""
        return write_modules(dest, self.base_folder, self.modules(), self.assignment)

    def expected(self) -> str:
        """What grading should give it, in words."""
        if "*" in self.breaks:
            return "no points"
        return f"loses points on {', '.join(self.breaks)} only" if self.breaks else "full marks"


# Every assignment's first samples: its reference solutions, and its stubs as released.
GENERIC = (Sample("reference", "the reference solutions"),
           Sample("untouched", "the stubs as released, nothing written", base="exercises", breaks=("*",)))


def samples(assignment: str | None = None) -> list[Sample]:
    """The samples of ``assignment`` (None: of every assignment): the reference, the untouched stubs, then those
    of its samples.py (assignments/<name>/samples.py, SAMPLES), each told its assignment."""
    found = []
    for a in ([kit.assignment(assignment)] if assignment else kit.assignments().values()):
        module = a.module("samples")
        own = list(getattr(module, "SAMPLES", [])) if module is not None else []
        found += [replace(sample, assignment=a.name) for sample in [*GENERIC, *own]]
    return found


def by_student(student: str, assignment: str | None = None) -> Sample:
    """The sample ``student`` of ``assignment`` (default: the kit's first)."""
    for sample in samples(assignment or kit.assignment().name):
        if sample.student == student:
            return sample
    raise KeyError(student)


def edited(text: str, edits, where: str) -> str:
    """``text`` with every occurrence of each ``old`` replaced by its ``new``, edit after edit. An edit
    whose ``old`` does not occur is an error: the module it was written for has changed."""
    for old, new in edits:
        if old not in text:
            raise ValueError(f"an edit for {where} no longer applies (the module changed): {old!r}")
        text = text.replace(old, new)
    return text


def write_modules(dest: Path, base: Path = SOLUTIONS, replaced: dict | None = None,
                  assignment: str | None = None) -> Path:
    """Every stage module of ``assignment`` (None: of every assignment) from ``base`` into folder
    ``dest`` (created if needed), those named in ``replaced`` (stage module -> source) replaced by theirs."""
    replaced = dict(replaced or {})
    unknown = set(replaced) - set(stages(assignment))
    if unknown:
        raise ValueError(f"not stage modules of {assignment or 'the kit'}: {sorted(unknown)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for stage in stages(assignment):
        text = replaced[stage] if stage in replaced else (base / f"{stage}.py").read_text()
        (dest / f"{stage}.py").write_text(text)
    return dest


def write_submission(sample: Sample, release: Path, dest: Path) -> Path:
    """A student's submission folder: the released assignment with the sample's modules in it."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(release, dest)
    return sample.write(dest)



def samples_of(assignment: str, students=None) -> list[Sample]:
    """The samples of ``assignment`` (those of the ids in ``students``, if given)."""
    mine = samples(assignment)
    if students:
        unknown = sorted(set(students) - {s.student for s in mine})
        if unknown:
            raise SampleError(f"no sample {', '.join(map(repr, unknown))} of {assignment}; its samples: "
                              f"{', '.join(s.student for s in mine)}")
        mine = [s for s in mine if s.student in students]
    return mine


def planned(root: Path, assignment: str, students=None, force: bool = False) -> list[Sample]:
    """The samples ``load_into`` would write, or the SampleError it would raise (before writing anything)."""
    root = Path(root)
    release = root / "release" / assignment
    if not release.is_dir():
        raise SampleError(f"{assignment} has no release yet ({quote(str(release))}): run `nbgrader "
                          f"generate_assignment {assignment}` in {quote(str(root))} first")
    chosen = samples_of(assignment, students)
    taken = [s.student for s in chosen if (root / "submitted" / s.student / assignment).exists()]
    if taken and not force:
        raise SampleError(f"submitted/ already holds {assignment} of {', '.join(taken)}: nothing was written; "
                          "give --force to replace them with the samples, or --student to choose others")
    return chosen


def load_into(root: Path, assignment: str, students=None, force: bool = False) -> list[Sample]:
    """Submissions of ``assignment``'s samples in an nbgrader course, as `nbgrader collect` leaves them:
    ``root/submitted/<sample>/<assignment>/``, the release with the sample's modules and a timestamp.txt
    of now. A submission already there is replaced only with ``force`` (it may be a real student's)."""
    chosen = planned(root, assignment, students, force)
    release = Path(root) / "release" / assignment
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")  # (nbgrader's own format)
    for sample in chosen:
        dest = write_submission(sample, release, root / "submitted" / sample.student / assignment)
        (dest / "timestamp.txt").write_text(now)
    return chosen
