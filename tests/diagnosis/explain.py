"""What a failed check's evidence bears out: the sources of evidence a check can be given, and how their findings
are put together so that none overclaims.

A check passes ``diagnosis=[...]`` to ``compare.assert_close``; only when it fails is each source asked for its
findings on the learner's values:

- ``Searched``: a reference computation with its switches (``diagnosis.search``): the changes whose output
  equals the learner's, separated on a second case where the first cannot tell them apart;
- ``Probed``: behavioural probes of the mechanisms the stage uses (``diagnosis.probes``), run on the learner's
  code;
- ``Listed``: a stage's own mistakes that no switch stands for, as {words: the values that mistake gives}.

``reconcile`` puts the findings in order and never lets two single causes stand side by side as facts: where a
searched change and a listed mistake both match but say different things, they become one finding with both as
possibilities; a probe's evidence stays, and its generic cause gives way to a specific one that the search bore
out for the same mechanism.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .findings import Finding, merged
from .search import NO_EFFECT, Compute, Switch, findings_of, left_out, search, separate


class Evidence(Protocol):
    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]: ...


@dataclass
class Searched:
    """Search ``switches`` of ``compute`` (choices -> the output those choices give on the check's inputs) for the
    learner's ``actual``. ``second``: a function giving (the learner's output, compute) on a second case, drawn
    to tell apart changes the check's case cannot."""

    compute: Compute
    switches: Sequence[Switch]
    what: str = "your output"
    second: Callable[[], tuple[np.ndarray, Compute]] | None = None
    pairs: bool = True

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        found = search(actual, self.compute, self.switches, rtol=rtol, atol=atol, pairs=self.pairs)
        separated = False
        if found and self.second is not None:
            try:
                second = self.second()
            except Exception:  # the learner's code fails on the second case: it tells nothing apart
                second = None
            found, separated = separate(found, second, rtol, atol)
        if not separated:
            # Two changes at once that match one case only prove little: among hundreds of pairs, some can meet a
            # degenerate output (all zeros, every key alike) by chance. A pair is claimed only where a second case
            # bears it out.
            found = [change for change in found if len(change.words) == 1]
        if found and not np.isfinite(np.asarray(actual)).any():
            # An output with no finite value equals every change that gives NaN everywhere, whatever made the
            # learner's. A change is named only where it is the one change of the switches that does so on every
            # case looked at (this check's and a second of other sizes, where the right computation is finite);
            # otherwise no change is reproduced by that, and what the numbers show is the effect alone.
            texts = list(dict.fromkeys(change.text for change in found))
            if separated and len(texts) == 1:
                return [Finding(f"{self.what} has no finite value, on this check's inputs and on a second case of "
                                "other sizes; of every change of the computation tried, this one alone gives that on "
                                "both.", (texts[0],), found[0].mechanisms[0] if found[0].mechanisms else "",
                                "mutation", weight=20)]
            return [Finding(f"{self.what} has no finite value: every entry is NaN or inf, so its numbers cannot be "
                            "matched to a step of the computation.", (), "", "probe", weight=20)]
        return findings_of(found, self.what, separated)


@dataclass
class Probed:
    """Probes run on the learner's code when the check fails (each a function giving findings)."""

    probes: Sequence[Callable[[], list[Finding]]]

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        found = []
        for probe in self.probes:
            try:
                found += probe()
            except Exception:  # a probe that cannot run on this code says nothing
                continue
        return found


@dataclass
class Listed:
    """A stage's own mistakes: {the mistake in words: the values it gives on the check's inputs}, or a function
    returning that (called only when the check fails: some are costly)."""

    mistakes: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]]
    what: str = "your values"

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        mistakes = self.mistakes() if callable(self.mistakes) else self.mistakes
        named = [why for why, values in (mistakes or {}).items() if _matches(actual, values, rtol, atol)]
        if not named:
            return []
        if len(named) == 1 and named[0] in NO_EFFECT:  # (a step left out: what was matched, search.no_effect)
            return [Finding(left_out(named[0], self.what, "this check's inputs"), (named[0],), "", "listed",
                            weight=30)]
        if len(named) == 1:
            return [Finding(f"this mistake gives {self.what} on this check's inputs.", (named[0],), "", "listed",
                            weight=30)]
        return [Finding(f"each of these mistakes gives {self.what} on this check's inputs: these inputs cannot tell "
                        "them apart.", tuple(named), "", "listed", weight=30)]


@dataclass
class Said:
    """Findings worked out by the check itself (a reading it made of the learner's code)."""

    found: Callable[[np.ndarray], list[Finding]]

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        return self.found(actual)


@dataclass
class About:
    """Evidence drawn from other values than the ones a check compares: the whole output, when the check compares a
    part of it (the weights above the diagonal, the row sums)."""

    values: np.ndarray
    evidence: Sequence[Evidence]
    rtol: float = 1e-4
    atol: float = 1e-6

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        found = []
        for source in self.evidence:
            found += source.findings(np.asarray(self.values), self.rtol, self.atol)
        return found


def _matches(actual, candidate, rtol, atol) -> bool:
    candidate = np.asarray(candidate)
    # NaN matches NaN: some mistakes give NaN in known places (a row of attention with nothing to attend to).
    return candidate.shape == actual.shape and bool(np.allclose(actual, candidate, rtol=rtol, atol=atol,
                                                                equal_nan=True))


def explain(actual, evidence: Sequence[Evidence], rtol: float, atol: float) -> list[Finding]:
    """Every source's findings on ``actual``, reconciled. A source that cannot run says nothing."""
    found = []
    for source in evidence:
        try:
            found += source.findings(np.asarray(actual), rtol, atol)
        except Exception:
            continue
    return reconcile(found)


def reconcile(found: list[Finding]) -> list[Finding]:
    found = merged(found)
    matched = [f for f in found if f.source in ("mutation", "listed")]
    causes = list(dict.fromkeys(c for f in matched for c in f.causes))
    if len(matched) > 1 and len(causes) > 1:
        # Two sources matched the learner's numbers and name different causes: neither is a fact.
        combined = Finding("each of these mistakes gives your values on this check's inputs: these inputs cannot "
                           "tell them apart.", tuple(causes[:4]), matched[0].mechanism, "mutation",
                           weight=min(f.weight for f in matched))
        found = [f for f in found if f not in matched] + [combined]
    elif len(matched) > 1:
        found = [f for f in found if f not in matched[1:]]
    # A probe that bears out one of several causes the search could not tell apart decides between them.
    decided = {c for f in found if f.source == "probe" and len(f.causes) == 1 for c in f.causes}
    kept = []
    for f in found:
        if f.source != "probe" and len(f.causes) > 1 and len(decided & set(f.causes)) == 1:
            f = Finding(f.shows.replace(": these inputs cannot tell them apart.", "; the evidence above tells which."),
                        tuple(decided & set(f.causes)), f.mechanism, f.source, f.weight)
        kept.append(f)
    # A change of the reference computation that gives the learner's numbers exactly accounts for everything the
    # probes measured on them: the probes' evidence stays, their own (more general) causes give way to it.
    settled = any(f.source in ("mutation", "listed") and len(f.causes) == 1 for f in kept)
    specific = {m for f in kept if f.source in ("mutation", "listed") for m in f.mechanism.split(", ") if m}
    kept = [Finding(f.shows, (), f.mechanism, f.source, f.weight)
            if f.source == "probe" and f.causes and (settled or f.mechanism in specific) else f for f in kept]
    # A probe's open list of possibilities gives way to the changes the search reproduced the numbers with, even
    # where the search could not tell its own apart: those are the narrower reading of the same evidence.
    reproduced = any(f.source in ("mutation", "listed") and f.causes for f in kept)
    kept = [Finding(f.shows, (), f.mechanism, f.source, f.weight)
            if reproduced and f.source == "probe" and len(f.causes) > 1 else f for f in kept]
    # (A probe's causes are not shown at all, findings.Finding.shown: what stays of it is its evidence.)
    return [f for f in merged(kept) if f.shows or f.shown]
