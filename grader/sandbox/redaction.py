"""Hidden material out of every text that learner code can put in front of a student: a second line of defence.

No box holds hidden material in any confinement that holds (the stages a stage builds on run in the reference
process, ``reference``; the probe box proves the rest out of reach). Should any reach learner code all the same,
the texts a box sends back (an exception's message, a traceback, what it printed, strings in its results) reach
students only through ``Redactor.clean``, which replaces every stretch that quotes hidden material with
``REDACTED``.

Hidden material: the solution regions of every reference module (``### BEGIN/END SOLUTION``), the graded
suite's hidden tests (each test file less the public tests a release ships), and the hidden fixtures (their
bytes, in the ways code would print them: repr, base64, hex, and each array as NumPy prints it). A stretch
counts as a quote when at least ``WINDOW`` of its letters and digits, in order, appear in that material and not in
what the student already has: the release of their assignment (its stubs, public tests, the suite's helpers) and
the submission's own modules (quoting a student's own code back to them leaks nothing, and a correct solution is
often written the way the reference is).

Before matching, both sides are normalised (``normalise``): compatibility forms unfolded (NFKD: fullwidth letters,
ligatures, accents split off), case folded, and everything but letters and digits left out (whitespace,
punctuation, symbols, format and invisible characters such as a zero-width space, combining marks). A separator
every few characters, a run of punctuation, a change of case or of width therefore quotes just as much. What it
cannot catch: text encoded by the learner's code (rot13, base64 of its own, a cipher), letters replaced by
look-alikes of another script (Cyrillic for Latin), a letter dropped or changed every fewer than ``WINDOW``
letters, a paraphrase, quotes shorter than ``WINDOW + STEP - 1`` letters and digits, and a quote spread over
several messages.

Matching uses fingerprints of WINDOW-character windows of the normalised text; the material's windows are kept at
every STEP-th position only, so any quote of WINDOW + STEP - 1 letters and digits or more is found.
"""
from __future__ import annotations

import base64
import binascii
import re
import unicodedata
from functools import cache
from pathlib import Path

from suite_runtime.stage_names import module_files, stage_of

from ..kit import EXERCISES, FIXTURES, SOLUTION_BEGIN, SOLUTION_END, SOLUTIONS, SUITE, assignment_of
from ..suite import public_tests

WINDOW = 40  # letters and digits that make a quote
# torch's own messages for slips of shape: their words are torch's, not the learner's process's, so a stretch of hidden
# material that they happen to match (a hidden test quoting the same error) is no quote. Only their fixed words count
# as torch's: the numbers in them are the learner's to choose, and a run that quotes more than FEW letters and digits
# besides torch's words is redacted as any other (a leak dressed as a torch error).
NUMBER, SIZES = r"(-?\d{1,6})", r"(\[[-\d, ]{0,40}\])"
TORCH_PHRASES = [re.compile(r"(?:RuntimeError: )?" + p.replace("<n>", NUMBER).replace("<sizes>", SIZES)) for p in (
    r"The size of tensor a \(<n>\) must match the size of tensor b \(<n>\) at non-singleton dimension <n>",
    r"Expected size for first two dimensions of batch2 tensor to be: <sizes> but got: <sizes>",
    r"shape '<sizes>' is invalid for input of size <n>",
    r"mat1 and mat2 shapes cannot be multiplied \(<n>x<n> and <n>x<n>\)",
    r"Sizes of tensors must match except in dimension <n>\. Expected size <n> but got size <n> for tensor number <n> "
    r"in the list",
    r"view size is not compatible with input tensor's size and stride",
    r"Expected all tensors to be on the same device",
)]
FEW = 8
STEP = 8  # the material's windows kept: one in STEP
REDACTED = "[hidden material removed]"
_NOT_ALNUM = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> tuple[str, list[int]]:
    """``text`` as it is matched: its letters and digits only, compatibility forms unfolded and case folded; and for
    each character of that, the index of the character of ``text`` it comes from."""
    if text.isascii():  # (the usual case, at C speed)
        lowered = text.lower()
        return _NOT_ALNUM.sub("", lowered), [m.start() for m in re.finditer(r"[0-9a-z]", lowered)]
    kept, where = [], []
    for i, c in enumerate(text):
        for n in unicodedata.normalize("NFKD", c).casefold():
            if n.isalnum():
                kept.append(n)
                where.append(i)
    return "".join(kept), where


def _windows(text: str, step: int = 1) -> set[int]:
    """Fingerprints (Python's string hash: the same within a process) of ``text``'s windows, normalised."""
    squeezed = _NOT_ALNUM.sub("", text.lower()) if text.isascii() else normalise(text)[0]
    return {hash(squeezed[i:i + WINDOW]) for i in range(0, max(len(squeezed) - WINDOW + 1, 0), step)}


class Redactor:
    """Finds quotes of ``hidden`` texts (minus what ``known`` texts also hold) in other texts."""

    def __init__(self, hidden: list[str], known: list[str] = ()):
        known_windows = set().union(*map(_windows, known)) if known else set()
        self.hidden = set().union(*(_windows(text, STEP) for text in hidden)) - known_windows if hidden else set()

    def clean(self, text: str, own: set[int] = frozenset()) -> str:
        """``text`` with each stretch that quotes hidden material (and is not in ``own``: the fingerprints of
        the submission's own modules, ``fingerprints``) replaced by REDACTED."""
        if not self.hidden or not isinstance(text, str) or len(text) < WINDOW:
            return text
        squeezed, where = normalise(text)
        quoted = [False] * len(squeezed)
        for i in range(len(squeezed) - WINDOW + 1):
            key = hash(squeezed[i:i + WINDOW])
            if key in self.hidden and key not in own:
                quoted[i:i + WINDOW] = [True] * WINDOW
        if not any(quoted):
            return text
        torch_s = _torch_s_words(text, where)
        out, i = [], 0
        for start, end in _runs(quoted):
            if sum(k not in torch_s for k in range(start, end)) < FEW:
                continue  # (torch's own words, and too few others to quote anything)
            out += [text[i:where[start]], REDACTED]
            i = where[end - 1] + 1
        return "".join(out) + text[i:]


def _torch_s_words(text: str, where: list[int]) -> set[int]:
    """The positions of ``text``'s normalised characters (``normalise``) that are fixed words of a torch message."""
    theirs = set()
    for phrase in TORCH_PHRASES:
        for match in phrase.finditer(text):
            numbers = [match.span(g) for g in range(1, (match.lastindex or 0) + 1)]
            theirs |= {k for k, i in enumerate(where) if match.start() <= i < match.end()
                       and not any(a <= i < b for a, b in numbers)}
    return theirs


def fingerprints(sources: dict[str, bytes]) -> set[int]:
    """The windows of a submission's own modules (see ``Redactor.clean``)."""
    return set().union(*(_windows(data.decode("utf-8", "replace")) for data in sources.values())) if sources else set()


def _runs(flags):
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            yield start, i
            start = None


# ---------------------------------------------------------------- the kit's hidden material

def solution_regions(text: str) -> list[str]:
    """The learner's parts of a reference module: what its ``### BEGIN/END SOLUTION`` regions hold."""
    return re.findall(rf"{re.escape(SOLUTION_BEGIN)}\n(.*?){re.escape(SOLUTION_END)}", text, flags=re.S)


def fixture_texts(path: Path) -> list[str]:
    """A hidden fixture file as code would print it: the bytes' repr, base64 and hex, and every array's values."""
    import numpy as np

    data = path.read_bytes()
    texts = [repr(data), base64.b64encode(data).decode(), binascii.hexlify(data).decode()]
    with np.load(path, allow_pickle=False) as arrays:
        for name in arrays.files:
            array = arrays[name]
            texts += [str(array), repr(array.tolist())]
    return texts


@cache
def kit_redactor(assignment: str) -> Redactor:
    """The redactor of the kit's hidden material for a student of ``assignment``, who has its release (built
    once per process and assignment: about a second). Hidden: every assignment's, whatever the student has."""
    hidden, known = [], []
    for path in module_files(SOLUTIONS):
        hidden += solution_regions(path.read_text())
        if assignment_of(path.stem) == assignment:
            known.append((EXERCISES / path.name).read_text())
    for path in sorted(SUITE.glob("test_*.py")):
        hidden.append(path.read_text())
        public = public_tests(path).source
        if public and assignment_of(stage_of(path.name)) == assignment:
            known.append(public)
    for path in sorted(SUITE.glob("*.py")):
        if not path.name.startswith("test_"):
            known.append(path.read_text())  # the suite's helpers ship with every release
    for path in sorted((FIXTURES / "hidden").glob("*.npz")):
        hidden += fixture_texts(path)
    return Redactor(hidden, known)
