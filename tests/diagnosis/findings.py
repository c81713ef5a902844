"""What a diagnosis says, as data: the contract between the diagnosis engine and whoever shows or counts it.

A ``Finding`` is one conclusion drawn from evidence about the learner's code: what the learner's own numbers show
(``shows``: an observation anyone can check, measured on their code), and what produces that (``causes``).

The wording rule: a cause is shown only where it was reproduced on this learner's case (a searched change or a
listed mistake whose output equals theirs: ``source`` "mutation" or "listed"), or where the evidence is the cause
itself (``proven``: an error whose own text says what was done, such as a view of a tensor that is not contiguous;
a reading of the learner's module that finds what it lacks). A probe measures an effect: its ``causes`` are what
could produce that effect, kept as data for ``explain.reconcile`` (they let a probe decide between causes the search
reproduced), never shown; the message states the effect alone (``shows``), as a property the learner can act on.
A false possibility misleads as much as a false fact. An error's sizes show where two tensors met: its single cause
is said with "if" (``POSSIBLE_ONE``). Several reproduced causes are given as "one of these, the inputs cannot tell
them apart", none as fact.

Standard library only: the grader reads findings from a check's report (``FindingRecord``) without importing
the rest of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypedDict

# Where a finding comes from: a searched change of the reference computation whose output equals the learner's
# ("mutation"), a behavioural probe run on the learner's code ("probe"), an exception's message read against the
# operation that raised it ("error"), a comparison with what a stage's listed mistake gives ("listed").
Source = Literal["mutation", "probe", "error", "listed"]

EVIDENCE = "Evidence:"
LIKELY = "Likely mistake:"
POSSIBLE = "Possible mistakes:"
# One cause that the evidence shows the effect of, not the step: the learner checks whether their code does it.
POSSIBLE_ONE = "Possible mistake (if your code does this):"
# Sources whose single cause was reproduced on the learner's case: the computation with it gives their numbers.
REPRODUCED = ("mutation", "listed")


@dataclass(frozen=True)
class Finding:
    shows: str  # what the numbers show, measured on the learner's code ("" when the evidence is the match itself)
    causes: tuple[str, ...] = ()  # what produces that: one likely mistake, or several possible ones
    mechanism: str = ""  # the mechanism it concerns ("causal masking", "scaling", ...)
    source: Source = "probe"
    weight: int = field(default=0, compare=False)  # order among a check's findings: lower first
    proven: bool = field(default=False, compare=False)  # the evidence is the cause itself (see the module's words)

    @property
    def stated(self) -> bool:
        """Whether its one cause may be stated as the likely mistake (the wording rule above)."""
        return len(self.causes) == 1 and (self.source in REPRODUCED or self.proven)

    @property
    def shown(self) -> tuple[str, ...]:
        """The causes a message may show: none of a probe's, unless its evidence is the cause itself (rule above)."""
        return () if self.source == "probe" and not self.proven else self.causes

    def lines(self) -> list[str]:
        """The finding as a failure message shows it: the evidence, then the likely or possible mistakes."""
        found = [f"{EVIDENCE} {self.shows}"] if self.shows else []
        if len(self.shown) == 1:
            cause = self.causes[0]
            # (a cause already worded with "if" needs no second one)
            label = LIKELY if self.stated else "Possible mistake:" if cause.startswith("if ") else POSSIBLE_ONE
            found.append(f"{label} {cause}")
        elif self.shown:
            found.append(f"{POSSIBLE} " + "; OR ".join(f"({i}) {c}" for i, c in enumerate(self.causes, 1)))
        return found

    @property
    def text(self) -> str:
        """One line: what a record lists among a check's mistakes, and a class report counts."""
        if len(self.shown) == 1:
            return self.causes[0]
        return self.shows if self.shows else "; or ".join(self.shown)

    def record(self) -> FindingRecord:
        return {"text": self.text, "shows": self.shows, "causes": list(self.shown), "mechanism": self.mechanism,
                "source": self.source}


class FindingRecord(TypedDict):
    """A finding as it travels in a check's report and lies in a grading record."""
    text: str
    shows: str
    causes: list[str]
    mechanism: str
    source: Source


def merged(findings: list[Finding]) -> list[Finding]:
    """``findings`` without repeats (the same evidence and causes said twice), in their order of weight."""
    seen, kept = set(), []
    for finding in sorted(findings, key=lambda f: f.weight):
        key = (finding.shows, finding.causes)
        if key not in seen:
            seen.add(key)
            kept.append(finding)
    return kept


def diagnosed(message: str, findings: list[Finding]) -> AssertionError:
    """A failed check with what the evidence bears out: an AssertionError (as any failed check is) whose message
    shows them and whose ``findings`` carries them as data (the suite's report hook copies them into the test's
    report, where a grader reads them)."""
    error = AssertionError(message)
    error.findings = list(findings)  # type: ignore[attr-defined]
    return error
