"""Comparisons whose failure messages teach: what was expected, what the learner computed, and what the
learner's own numbers show about why.

``assert_close`` names the array, shows expected against actual (shape, first mismatching row) and, when it
fails, asks the diagnosis it was given (``diagnosis.explain``) what the learner's numbers bear out.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .explain import Evidence, Listed, Said, explain
from .findings import Finding, diagnosed
from .residual import Residual

# pytest leaves this module's frames out of a failure's traceback: it ends at the test's line, then the
# message says what differs (`pytest --fulltrace` shows every frame).
__tracebackhide__ = True

# The CUDA cases in bfloat16 against a float64 reference: bf16 keeps 8 bits of mantissa (about 2-3 significant
# digits), and the kernels round differently from one GPU to another.
BFLOAT16 = dict(rtol=3e-2, atol=3e-2)


def _fmt(a):
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, separator=", ", max_line_width=100)


def diagnose(actual, mistakes, rtol, atol):
    """The descriptions of the listed mistakes whose values equal ``actual`` (no search, no probe)."""
    found = Listed(mistakes).findings(np.asarray(actual), rtol, atol)
    return [cause for finding in found for cause in finding.causes]


def assert_close(name, actual, expected, *, rtol=1e-4, atol=1e-6, diagnosis: Sequence[Evidence] = (),
                 mistakes=None, probes=(), hint=None, labels=("expected", "actual")):
    """Assert ``actual`` equals ``expected`` within tolerance, explaining any difference.

    diagnosis: the sources of evidence (``diagnosis.explain``) asked, only when the check fails, what the
    learner's values bear out: searched changes of a reference computation, probes of the mechanisms the stage
    uses, the stage's own listed mistakes.
    mistakes: {"the mistake in words": the values it gives}, or a function returning that (a ``Listed``
    source, for mistakes no switch stands for).
    probes: functions of ``actual`` giving a mistake's words when the evidence they gather on the learner's code
    bears it out, else None (the stage's own readings).
    hint: a sentence added to any failure (what the value means).
    labels: what the two sides are called ("expected", "actual"; for two forms of the learner's own code compared
    with each other, their names).
    """
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    first_label, second_label = labels
    width = max(len(first_label), len(second_label)) + 1
    lines = []

    def sides(a, b, indent):
        return (f"{indent}{(first_label + ':').ljust(width)} {_fmt(a)}\n"
                f"{indent}{(second_label + ':').ljust(width)} {_fmt(b)}")

    if actual.shape != expected.shape:
        lines.append(f"{name} has shape {actual.shape}, {first_label} {expected.shape}.")
        diagnosis = [*diagnosis, Said(lambda values: shape_findings(values.shape, expected.shape, values, expected))]
    elif not np.all(np.isfinite(actual)) and np.all(np.isfinite(expected)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(actual))[0])
        lines.append(f"{name} contains {actual[bad]} at index {bad}; {first_label}: finite values.")
        if expected.ndim <= 1:
            lines.append(sides(expected, actual, "  "))
        else:  # the row with the first non-finite value: whole arrays would bury what follows
            row = bad[:-1]
            lines.append(f"  row {name}[{', '.join(map(str, row))}]:\n" + sides(expected[row], actual[row], "    "))
    elif not np.allclose(actual, expected, rtol=rtol, atol=atol):
        off = ~np.isclose(actual, expected, rtol=rtol, atol=atol)
        first = tuple(int(i) for i in np.argwhere(off)[0])
        diff = np.abs(actual - expected)
        lines.append(
            f"{name} differs from the {first_label} values in {int(off.sum())} of {off.size} entries "
            f"(largest difference {diff.max():.4g}; tolerance rtol={rtol:g}, atol={atol:g})."
        )
        if expected.ndim <= 1:
            lines.append(sides(expected, actual, "  "))
        else:
            row = first[:-1]
            lines.append(f"  first mismatching row {name}[{', '.join(map(str, row))}]:\n"
                         + sides(expected[row], actual[row], "    "))
    else:
        return
    sources = list(diagnosis)
    if actual.shape == expected.shape:  # (every stage's: the output minus the expected values, against the inputs)
        sources.append(Residual(expected, name, first_label))
    if mistakes is not None:
        sources.append(Listed(mistakes))
    if probes:
        sources.append(Said(lambda values: [Finding("", (why,), "", "probe", weight=15)
                                            for why in (probe(values) for probe in probes) if why]))
    findings = explain(actual, sources, rtol, atol)
    lines += [line for finding in findings for line in finding.lines()]
    if hint:
        lines.append(hint)
    raise diagnosed("\n".join(lines), findings)


def shape_findings(actual: tuple, expected: tuple, values=None, expected_values=None) -> list[Finding]:
    """What a wrong shape shows, when it holds the expected number of values: axes swapped, or an axis that grew by
    the factor another shrank by (parts joined along the wrong axis). A cause is named only where the expected
    values rearranged that way give the learner's (``values``, ``expected_values``): otherwise the shape alone is
    the evidence."""
    if actual == expected or int(np.prod(actual)) != int(np.prod(expected)) or len(actual) != len(expected):
        return []
    if sorted(actual) == sorted(expected) and len(actual) >= 2:
        swapped = [i for i, (a, e) in enumerate(zip(actual, expected)) if a != e]
        if len(swapped) == 2:
            i, j = swapped
            swapped_back = _rearranged(values, expected_values, lambda e: np.swapaxes(e, i, j))
            return [Finding(f"your shape is the expected one with axes {i} and {j} swapped"
                            + (", and so are your values: they are the expected ones transposed." if swapped_back
                               else "."),
                            (f"a transpose is missing or extra (of axes {i} and {j})",), "shapes",
                            "listed" if swapped_back else "probe", weight=1)]
    grew = [i for i, (a, e) in enumerate(zip(actual, expected)) if a > e and a % e == 0]
    shrank = [i for i, (a, e) in enumerate(zip(actual, expected)) if a < e and e % a == 0]
    if len(grew) == 1 and len(shrank) == 1:
        i, j = grew[0], shrank[0]
        factor = actual[i] // expected[i]
        if expected[j] // actual[j] == factor:
            last = "the last axis" if j == len(expected) - 1 else f"axis {j}"
            return [Finding(f"your values fill axis {i} {factor} times over ({actual[i]} = {factor} x {expected[i]}) "
                            f"and {last} {factor} times less ({actual[j]} = {expected[j]} / {factor}).",
                            (f"{factor} parts were joined along axis {i} instead of {last} (torch.cat(..., "
                             f"dim={j if j < len(expected) - 1 else -1}))",),
                            "shapes", "listed" if _rearranged(values, expected_values, lambda e: np.concatenate(
                                np.split(e, factor, axis=j), axis=i)) else "probe", weight=1)]
    return []


def _rearranged(values, expected, rearrange) -> bool:
    """Whether the expected values, rearranged, are the learner's (what reproduces a shape mistake)."""
    if values is None or expected is None:
        return False
    try:
        return bool(np.allclose(np.asarray(values, np.float64), rearrange(np.asarray(expected, np.float64)),
                                rtol=1e-4, atol=1e-5, equal_nan=True))
    except Exception:
        return False


def assert_mask(name, actual, expected, *, mistakes=None, diagnosis: Sequence[Evidence] = ()):
    """A boolean mask (True = takes part) equal to ``expected``, compared as 0/1 numbers, with the masks that
    typical mistakes give (``mistakes``: {description: boolean mask}) and the sources of evidence ``diagnosis``
    (given the learner's mask as 0/1 numbers)."""
    actual = np.asarray(actual)
    assert actual.dtype == bool, (
        f"{name} must be boolean (True = takes part); yours has dtype {actual.dtype}:\n{actual}")
    assert_close(f"{name} (1 = takes part)", actual.astype(np.float32), np.asarray(expected, np.float32),
                 mistakes={why: np.asarray(m, np.float32) for why, m in (mistakes or {}).items()}, diagnosis=diagnosis)


def parameter_count(info):
    """Number of trainable values of an inspected module, however its parameters are laid out."""
    return int(sum(np.prod(shape) for shape in info["parameters"].values()))


def check_causal_mask(mask, context_length):
    """A causal mask buffer: (context_length, context_length), possibly with leading 1s for broadcasting;
    nonzero (True) strictly above the diagonal, zero elsewhere."""
    mask = np.asarray(mask)
    t = context_length
    assert mask.shape[-2:] == (t, t) and mask.size == t * t, (
        f"mask has shape {mask.shape}; expected (context_length, context_length) = ({t}, {t})"
    )
    mask = mask.reshape(t, t)
    future = np.triu(np.ones((t, t), bool), 1)
    assert np.all(mask[future] != 0) and np.all(mask[~future] == 0), (
        f"mask should be 1 (True) strictly above the diagonal (the future) and 0 elsewhere; yours:\n{mask}"
    )




def check_sizes_from_arguments(info, init, expected_count, what):
    """A module built with sizes unlike the book's (info: its ``inspect``) has the parameters and the
    causal mask that its constructor's arguments call for; one that reads a global (the book's
    d_out = 2, context_length = 6) has not."""
    count, t = parameter_count(info), init["context_length"]
    # The causal mask, wherever it lives (heads.0.mask in a module of heads); a missing one is another check's.
    masks = [np.asarray(b) for n, b in info["buffers"].items() if n.split(".")[-1] == "mask"]
    problems = []
    if count != expected_count:
        problems.append(f"{count} trainable values, expected {expected_count} (parameters: {info['parameters']})")
    if masks and masks[0].size != t * t:
        mask = masks[0]
        problems.append(f"a mask of shape {mask.shape}, expected ({t}, {t}) for context_length={t}")
    assert not problems, (
        f"{what}({', '.join(f'{k}={v}' for k, v in init.items())}) has " + " and ".join(problems)
        + ": take every size from the constructor's arguments, never from a global or the book's example."
    )

