"""What grading reads of a submission folder, and what it stands for.

A submission is graded as its ``sources``: the stage modules of its folder (regular files, each
at most MAX_MODULE_BYTES), taken once. The same sources go to the sandbox, name the record (its
``fingerprint``) and draw the randomized cases (its ``seed``), whether ``attnkit grade`` or an
nbgrader autograder cell grades it, so that both give the same verdicts.

A module submitted as a symbolic link is graded as a module that fails on import, saying so: a
link could point at the solutions. nbgrader's copy of a submission into ``autograded/`` follows
links, so there only the ``submitted/`` twin tells which modules were links, and ``defuse_links``
replaces what came through them before any feedback is made from that folder.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from suite_runtime.stage_names import is_stage_module, module_files

MAX_MODULE_BYTES = 1 << 20  # a stage module larger than this is not graded
LINK_NOTE = "This file was submitted as a symbolic link; what the link pointed at is not copied.\n"


def sources(folder, linked: list[str] | None = None, expected=()) -> dict[str, bytes]:
    """File name -> contents of the stage modules grading runs. ``linked``: names of modules that
    were submitted as symbolic links (default: the folder's own links); each becomes a module
    that fails on import with a message that says so. Each stage module of ``expected`` (stage module
    names) that the folder lacks becomes a module that fails on import saying what the student should
    submit instead (``missing_note``)."""
    found = {path.name: path.read_bytes() for path in module_files(folder)
             if path.stat().st_size <= MAX_MODULE_BYTES}
    for name in linked_modules(folder) if linked is None else linked:
        found[name] = (f"raise ImportError('{name} was submitted as a symbolic link, not a file: "
                       "submit the module itself')\n").encode()
    for name in (f"{stage}.py" for stage in expected):
        if name not in found:  # (the suite's adapter shows a SubmissionError's words as they are)
            note = missing_note(folder, name)
            found[name] = (f"from suite_runtime.adapters import SubmissionError\n"
                           f"raise SubmissionError({note!r})\n").encode()
    return dict(sorted(found.items()))


ARCHIVES = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar")


def missing_note(folder, name: str) -> str:
    """What a student reads when stage module ``name`` is not in their submission ``folder``: what they
    should upload, from what the folder holds instead (the module inside a folder, an archive)."""
    folder = Path(folder)
    nested = sorted(p for pattern in (f"*/{name}", f"*/*/{name}") for p in folder.glob(pattern)
                    if p.is_file() and not p.is_symlink())
    if nested:
        inside = nested[0].parent.relative_to(folder)
        return (f"{name} is not at the top of your submission but in the folder {inside}/: submit the stage "
                "modules themselves, not a folder that holds them")
    archives = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in ARCHIVES)
    if archives:
        shown = ", ".join(repr(a) for a in archives[:3]) + (" ..." if len(archives) > 3 else "")
        return (f"{name} is not in your submission, which holds the archive {shown}: submit the stage modules "
                f"themselves ({name} and the others, unpacked), not an archive of them")
    return (f"{name} is not in your submission: submit it under that exact name (the stub the assignment gave "
            "you, with its TODOs filled in)")


def fingerprint(graded: dict[str, bytes]) -> str:
    """sha256 (hex) of the graded modules' names and contents: what a record of grades stands for."""
    digest = hashlib.sha256()
    for name, data in sorted(graded.items()):
        digest.update(name.encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


def seed_of(fingerprint: str) -> int:
    """The seed of the randomized hidden cases: fixed by the graded modules, so that regrading gives
    the same grades while two different submissions get different cases."""
    return int(fingerprint[:8], 16) & 0x7FFFFFFF


def linked_modules(folder) -> list[str]:
    """Names of the entries of ``folder`` named like stage modules that are symbolic links."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if p.suffix == ".py" and is_stage_module(p.stem) and p.is_symlink())


# ---------------------------------------------------------------- nbgrader's autograded copies

def submitted_twin(folder: Path) -> Path | None:
    """nbgrader's submitted/<student>/<assignment>/ folder of the autograded folder ``folder``, if any."""
    folder = Path(folder)
    if len(folder.parents) < 3 or folder.parents[1].name != "autograded":
        return None
    submitted = folder.parents[2] / "submitted" / folder.parent.name / folder.name
    return submitted if submitted.is_dir() else None


def autograded_sources(folder: Path, expected=()) -> dict[str, bytes]:
    """``sources`` of nbgrader's autograded copy ``folder``, with the modules that its submitted/ twin
    holds as symbolic links graded as such (the copy followed them). Any other folder: ``sources``."""
    twin = submitted_twin(folder)
    return sources(folder, linked_modules(twin) if twin is not None else None, expected)


def defuse_links(folder: Path) -> list[str]:
    """In nbgrader's autograded copy ``folder``, replace what came through a symbolic link of the
    submission with a short note; returns the paths replaced. ``nbgrader generate_feedback`` hands
    the autograded folder to the student: a link to the solutions (or any file of the grader's
    machine) would otherwise reach them."""
    submitted = submitted_twin(folder)
    if submitted is None:
        return []
    replaced = []
    for link in sorted(p for p in submitted.rglob("*") if p.is_symlink()):
        copy = Path(folder) / link.relative_to(submitted)
        if copy.is_dir() and not copy.is_symlink():
            shutil.rmtree(copy)
        elif copy.exists() or copy.is_symlink():
            copy.unlink()
        else:
            continue  # not copied (an ignored name)
        copy.write_text(LINK_NOTE)
        replaced.append(str(link.relative_to(submitted)))
    return replaced
