"""Mistakes as changes of one reference computation, searched rather than listed.

A mechanism's reference computation is written once with its ``Switch``es: every choice a learner makes there
(an axis, a transpose, a scale, an offset, a mask, a step left out or done twice) with its right value and its
wrong ones, each described in words. When a check fails, ``search`` tries every single change of the switches the
check's computation has, then every pair of changes, and keeps those whose output equals the learner's. A match
is evidence of the effect, stated as such: "your output equals the right computation with <change>". Where
several changes give the learner's numbers, a second case, drawn to tell them apart, decides
(``separate``); what it cannot separate is shown as possibilities, none as fact.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np

from .findings import Finding

Choices = Mapping[str, Any]  # switch name -> the value chosen (a switch not named keeps its right value)

# What a step left out gives, for the words of each such change (``no_effect``): a match shows that the learner's
# numbers equal the computation without the step, that is, that the step as their code does it changes nothing; it
# does not show that the code lacks it (a call whose result is dropped, a rotation along an axis where every token
# gets the same angle, an in-place change of a copy give the same numbers).
NO_EFFECT: dict[str, str] = {}


def no_effect(matched: str, step: str, fix: str) -> str:
    """The words of a wrong value that leaves ``step`` out: "<step> is missing or, as written, has no effect: <fix>".
    Both are causes of such a match (RoPE turned along an axis where every position is the same leaves the scores
    as no RoPE does), so neither is said alone; a search that matches it says what was matched (``matched``: "with
    no rotation at all")."""
    words = f"{step} is missing or, as written, has no effect on the result: {fix}"
    NO_EFFECT[words] = matched
    return words


def left_out(words: str, what: str, where: str) -> str:
    """The evidence of a match with the step of ``words`` (``no_effect``) left out: what the right computation gives
    without it, never that the code lacks it."""
    return f"the right computation gives {what} {NO_EFFECT[words]}, on {where}."


@dataclass(frozen=True)
class Switch:
    """One choice a learner makes in a mechanism's computation: its name (the keyword the computation reads), the
    mechanism it belongs to, and each wrong value with the mistake it stands for, in words."""

    name: str
    mechanism: str
    wrong: Mapping[Any, str] = field(default_factory=dict)

    def only(self, *values) -> Switch:
        """This switch with only the wrong ``values`` (those the case at hand can show)."""
        return Switch(self.name, self.mechanism, {v: w for v, w in self.wrong.items() if v in values})

    def without(self, *values) -> Switch:
        return Switch(self.name, self.mechanism, {v: w for v, w in self.wrong.items() if v not in values})

    def plus(self, more: Mapping[Any, str]) -> Switch:
        return Switch(self.name, self.mechanism, {**self.wrong, **more})


@dataclass(frozen=True)
class Change:
    """A set of wrong choices (one value per switch) and what they are in words."""

    choices: tuple[tuple[str, Any], ...]
    words: tuple[str, ...]
    mechanisms: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.choices)

    @property
    def text(self) -> str:
        if len(self.words) == 1:
            return self.words[0]
        return "two mistakes at once: " + "; and ".join(self.words)


def changes(switches: Sequence[Switch], size: int) -> Iterator[Change]:
    """Every change of ``size`` switches at once (1: single changes, 2: pairs), one wrong value per switch."""
    singles = [(s, value, words) for s in switches for value, words in s.wrong.items()]
    for group in combinations(singles, size):
        if len({s.name for s, _, _ in group}) < size:
            continue
        yield Change(tuple((s.name, v) for s, v, _ in group), tuple(w for _, _, w in group),
                     tuple(dict.fromkeys(s.mechanism for s, _, _ in group)))


def _close(actual: np.ndarray, candidate, rtol: float, atol: float) -> bool:
    candidate = np.asarray(candidate)
    return (candidate.shape == actual.shape
            and bool(np.allclose(actual, candidate, rtol=rtol, atol=atol, equal_nan=True)))


Compute = Callable[[Choices], np.ndarray]


def search(actual, compute: Compute, switches: Sequence[Switch], *, rtol: float, atol: float,
           pairs: bool = True) -> list[Change]:
    """The changes (single ones first; pairs only if no single change does it) whose output equals ``actual``,
    leaving out those that give the right output here (they would match a right answer too)."""
    actual = np.asarray(actual)
    try:
        right = np.asarray(compute({}))
    except Exception:  # (the reference computation cannot run on these inputs: nothing to search)
        return []
    for size in (1, 2) if pairs else (1,):
        found = []
        for change in changes(switches, size):
            try:
                candidate = compute(change.as_dict())
            except Exception:  # a combination the case's sizes do not allow
                continue
            if _close(actual, candidate, rtol, atol) and not _close(right, candidate, rtol, atol):
                found.append(change)
        if found:
            return found
    return []


def separate(found: list[Change], second: tuple[np.ndarray, Compute] | None, rtol: float,
             atol: float) -> tuple[list[Change], bool]:
    """Of the ``found`` changes, those that also give the learner's output on a second case of other sizes
    (``second``: the learner's output there and the computation of that case), and whether it was used. A change
    that matched the check's case only because its sizes coincide (a divisor of 2 that is sqrt(d_out) and
    sqrt(num_heads) there) is dropped; where none holds on the second case, none is claimed."""
    if not found or second is None:
        return found, False
    actual, compute = second
    kept = []
    for change in found:
        try:
            if _close(np.asarray(actual), compute(change.as_dict()), rtol, atol):
                kept.append(change)
        except Exception:
            continue
    return kept, True


def findings_of(found: list[Change], what: str, separated: bool = False) -> list[Finding]:
    """What a search found, as findings: the evidence (the learner's values equal the right computation with this
    change) and the change as the likely mistake, or several changes as possible ones."""
    found = list({change.text: change for change in found}.values())  # (two values in the same words: one mistake)
    if not found:
        return []
    mechanisms = ", ".join(dict.fromkeys(m for change in found for m in change.mechanisms))
    also = " and on a second case of other sizes" if separated else ""
    if len(found) == 1:
        change = found[0]
        if len(change.words) == 1 and change.words[0] in NO_EFFECT:  # (a step left out: what was matched)
            return [Finding(left_out(change.words[0], what, f"this check's inputs{also}"), (change.text,), mechanisms,
                            "mutation", weight=20)]
        count = "one change" if len(change.words) == 1 else "two changes"
        return [Finding(f"the right computation with {count} gives {what}, on this check's inputs{also}.",
                        (change.text,), mechanisms, "mutation", weight=20)]
    shows = (f"the right computation with any of {len(found)} changes gives {what}, on this check's inputs: "
             "these inputs cannot tell them apart.")
    return [Finding(shows, tuple(change.text for change in found[:4]), mechanisms, "mutation", weight=20)]
