"""Assertions whose failure messages teach.

``assert_close`` names the array, shows expected against actual (shape, first
mismatching row) and, when the actual values match a known mistake, says which
one in plain words.
"""
from __future__ import annotations

import numpy as np

F32 = dict(rtol=1e-4, atol=1e-6)  # float32 default tolerance


def _fmt(a):
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, separator=", ", max_line_width=100)


def _matches(actual, candidate, rtol, atol):
    candidate = np.asarray(candidate)
    return candidate.shape == actual.shape and np.allclose(actual, candidate, rtol=rtol, atol=atol, equal_nan=False)


def diagnose(actual, mistakes, rtol, atol):
    """The descriptions of the mistakes whose result equals ``actual``."""
    return [why for why, candidate in (mistakes or {}).items() if _matches(actual, candidate, rtol, atol)]


def assert_close(name, actual, expected, *, rtol=1e-4, atol=1e-6, mistakes=None, hint=None):
    """Assert ``actual`` equals ``expected`` within tolerance, explaining any difference.

    mistakes: {"what the learner probably did": the array that mistake produces}.
    hint: a sentence added to any failure (what the value means).
    """
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    lines = []
    if actual.shape != expected.shape:
        lines.append(f"{name} has shape {actual.shape}, expected {expected.shape}.")
        if actual.shape == expected.shape[::-1] and actual.ndim >= 2:
            lines.append("The shape is the expected one reversed: is a transpose missing or extra?")
    elif not np.all(np.isfinite(actual)) and np.all(np.isfinite(expected)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(actual))[0])
        lines.append(f"{name} contains {actual[bad]} at index {bad}; expected finite values.")
        lines.append(f"  expected: {_fmt(expected)}\n  actual:   {_fmt(actual)}")
    elif not np.allclose(actual, expected, rtol=rtol, atol=atol):
        off = ~np.isclose(actual, expected, rtol=rtol, atol=atol)
        first = tuple(int(i) for i in np.argwhere(off)[0])
        diff = np.abs(actual - expected)
        lines.append(
            f"{name} differs from the expected values in {int(off.sum())} of {off.size} entries "
            f"(largest difference {diff.max():.4g}; tolerance rtol={rtol:g}, atol={atol:g})."
        )
        if expected.ndim <= 1:
            lines.append(f"  expected: {_fmt(expected)}\n  actual:   {_fmt(actual)}")
        else:
            row = first[:-1]
            lines.append(
                f"  first mismatching row {name}[{', '.join(map(str, row))}]:\n"
                f"    expected: {_fmt(expected[row])}\n    actual:   {_fmt(actual[row])}"
            )
    else:
        return
    for why in diagnose(actual, mistakes, rtol, atol):
        lines.append(f"Likely mistake: {why}")
    if hint:
        lines.append(hint)
    raise AssertionError("\n".join(lines))


# NumPy references for the common mistakes (the trusted side computes them itself).

def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def causal(scores, fill=-np.inf):
    """scores with the strict upper triangle replaced by ``fill``."""
    t = scores.shape[-1]
    return np.where(np.triu(np.ones((t, t), bool), 1), fill, scores)
