"""The residual probe: what the learner's output minus the expected values is, read against the arrays the check
gave the learner's code. Where it equals one of them (or a fixed multiple of it) within the check's own tolerance,
the learner's result is the expected one plus that input: something adds it. That is a fact about the numbers,
whatever the code looks like, so it holds in every stage; it runs once, in ``compare.assert_close``, for any check
that fails with values of the expected shape.

The arrays come from the operations the check ran on the learner's code (``note``, called by the suite's backend
for each operation it runs), kept for the test that is running only.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import Call
from .findings import Finding

KEPT = 8  # the latest operations of the running test: a check compares what its last few calls gave
_recent: list[tuple] = []  # (test id, op, its keyword arguments, a function giving its parameter names or None)


def _test_id() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def note(op: str, kwargs: dict, parameters: Callable[[], list[str] | None] | None = None) -> None:
    """Remember the arrays an operation on the learner's code was given: a function's arguments, a module's input
    x. ``parameters``: gives the function's own names, where known (asked only when a check fails)."""
    test = _test_id()
    _recent[:] = [entry for entry in _recent if entry[0] == test][-(KEPT - 1):] + [(test, op, kwargs, parameters)]


def _arrays(op, kwargs, parameters) -> list[tuple[np.ndarray, tuple[str, str]]]:
    """(array, (its short name, its name with where it was given)) of one operation."""
    func, names, arrays = kwargs.get("func", "the function"), None, []
    if op not in ("call", "forward", "heads_forward"):  # (the operations whose result a check compares)
        return arrays
    for value, where in Call(op, kwargs).arrays():
        if where == "x":
            arrays.append((value, ("x", "the input x")))
        elif isinstance(where, int):
            if names is None:
                names = (parameters() if parameters is not None else None) or []
            name = names[where] if where < len(names) else f"argument {where + 1}"
            arrays.append((value, (name, f"{name} (argument {where + 1} of {func})")))
        else:
            arrays.append((value, (where, f"{where} (given to {func})")))
    return arrays


def inputs() -> list[tuple[np.ndarray, tuple[str, str]]]:
    """The arrays given to the learner's code in the running test, latest first, each once."""
    test, seen, found = _test_id(), set(), []
    for entry_test, op, kwargs, parameters in reversed(_recent):
        if entry_test != test:
            continue
        for value, name in _arrays(op, kwargs, parameters):
            if id(value) not in seen:
                seen.add(id(value))
                found.append((value, name))
    return found


@dataclass
class Residual:
    """Evidence: the learner's values minus the ``expected`` ones, against the inputs of the running test."""

    expected: np.ndarray
    what: str = "your output"
    label: str = "expected"

    def findings(self, actual: np.ndarray, rtol: float, atol: float) -> list[Finding]:
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(self.expected, dtype=np.float64)
        if actual.shape != expected.shape or not (np.isfinite(actual).all() and np.isfinite(expected).all()):
            return []
        residual = actual - expected
        found = []
        for value, (short, name) in inputs():
            v = np.asarray(value, dtype=np.float64)
            if v.shape != actual.shape or not np.isfinite(v).all() or not np.any(v):
                continue
            if np.allclose(expected, (expected * v).sum() / (v * v).sum() * v, rtol=rtol, atol=atol):
                continue  # (the expected values are a multiple of this input: the residual would only restate a scale)
            factor = float((residual * v).sum() / (v * v).sum())  # (the multiple that fits best)
            if abs(factor - round(factor)) < 1e-3:
                factor = float(round(factor))
            if factor == 0 or not np.allclose(actual, expected + factor * v, rtol=rtol, atol=atol):
                continue
            if factor == 1:
                equals, does = name, f"something adds {short} to the result"
            elif factor == -1:
                equals, does = f"minus {name}", f"something subtracts {short} from the result"
            else:
                equals, does = f"{factor:.4g} x {name}", f"something adds {factor:.4g} x {short} to the result"
            found.append(Finding(f"{self.what} minus the {self.label} values equals {equals}, entry by entry within "
                                 f"this check's tolerance: {does}.", (), "residual", "probe", weight=5))
        return found
