"""Assertions whose failure messages teach.

``assert_close`` names the array, shows expected against actual (shape, first
mismatching row) and, when the actual values match a known mistake, says which
one in plain words.
"""
from __future__ import annotations

import re

import numpy as np


def _fmt(a):
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, separator=", ", max_line_width=100)


def _matches(actual, candidate, rtol, atol):
    candidate = np.asarray(candidate)
    return candidate.shape == actual.shape and np.allclose(actual, candidate, rtol=rtol, atol=atol, equal_nan=False)


def diagnose(actual, mistakes, rtol, atol):
    """The descriptions of the mistakes whose result equals ``actual``."""
    if callable(mistakes):
        mistakes = mistakes()
    return [why for why, candidate in (mistakes or {}).items() if _matches(actual, candidate, rtol, atol)]


def assert_close(name, actual, expected, *, rtol=1e-4, atol=1e-6, mistakes=None, hint=None):
    """Assert ``actual`` equals ``expected`` within tolerance, explaining any difference.

    mistakes: {"what the learner probably did": the array that mistake produces}, or a function
    returning that dict (called only when the check fails: some mistakes are costly to compute).
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


# NumPy references for the common mistakes (the trusted side computes them itself).

def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def causal(scores, fill=-np.inf):
    """scores with the strict upper triangle replaced by ``fill``."""
    t = scores.shape[-1]
    return np.where(np.triu(np.ones((t, t), bool), 1), fill, scores)


def linear(x, weights, name):
    out = x @ weights[f"{name}.weight"].T
    bias = weights.get(f"{name}.bias")
    return out if bias is None else out + bias


def multihead(x, weights, num_heads, *, scale_by="head_dim", split="view_transpose", out_proj=True,
              qkv_bias=True, mask="causal", values="W_value"):
    """NumPy multi-head causal attention, with switches that reproduce typical mistakes.

    x: (b, T, d_in); weights: MultiHeadAttention state_dict (W_query/W_key/W_value, out_proj).
    scale_by: "head_dim" (right), "d_out", "none"; split: "view_transpose" (right) or "view_only"
    (reshaping straight to (b, heads, T, head_dim)); mask: "causal", "none", "zero" (fill 0);
    values: "W_value" (right) or "inputs" (x itself, when d_in == d_out).
    """
    if not qkv_bias:
        weights = {k: v for k, v in weights.items() if not (k.startswith("W_") and k.endswith("bias"))}
    b, t, _ = x.shape
    q, k, v = (linear(x, weights, n) for n in ("W_query", "W_key", "W_value"))
    if values == "inputs":
        v = x
    d_out = q.shape[-1]
    hd = d_out // num_heads

    def heads(a):
        if split == "view_only":
            return a.reshape(b, num_heads, t, hd)
        return a.reshape(b, t, num_heads, hd).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(0, 1, 3, 2)
    scores = scores / {"head_dim": np.sqrt(hd), "d_out": np.sqrt(d_out), "none": 1.0}[scale_by]
    if mask == "causal":
        scores = causal(scores)
    elif mask == "zero":
        scores = causal(scores, fill=0.0)
    context = (softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, t, d_out)
    return linear(context, weights, "out_proj") if out_proj else context


def multihead_mistakes(x, weights, num_heads, out_proj=True):
    """What typical multi-head mistakes produce on these inputs, keyed by a plain description.

    Mistakes that happen to give the right answer for this configuration (e.g. a missing
    transpose with a single head) are left out.
    """
    def run(**change):
        return multihead(x, weights, num_heads, out_proj=out_proj, **change)

    candidates = {
        "the scores were scaled by sqrt(d_out), the model width; each head's dot products have "
        "head_dim terms, so divide by sqrt(head_dim)": run(scale_by="d_out"),
        "the scores were not scaled by 1 / sqrt(head_dim)": run(scale_by="none"),
        "the heads were split with view alone: view to (b, num_tokens, num_heads, head_dim), "
        "then transpose(1, 2)": run(split="view_only"),
        "the causal mask is missing: tokens see the future": run(mask="none"),
        "masked with 0 instead of -inf: a masked score of 0 still gets weight": run(mask="zero"),
        "qkv_bias was ignored: pass bias=qkv_bias to W_query, W_key and W_value": run(qkv_bias=False),
    }
    if x.shape[-1] == weights["W_value.weight"].shape[0]:
        candidates["the values were the inputs: mix the projected values W_value(x), not x"] = run(values="inputs")
    if out_proj:
        candidates["out_proj was not applied to the concatenated heads"] = multihead(
            x, weights, num_heads, out_proj=False)
    right = run()
    return {why: c for why, c in candidates.items() if not np.allclose(c, right, rtol=1e-4, atol=1e-6)}


# Errors, not wrong numbers: what the message of an exception usually means.
ERROR_HINTS = [
    (r"must match the size of tensor b.*(?s:.*)mask|mask(?s:.*)must match the size of tensor b",
     "a mask sized for context_length met scores for fewer tokens: cut it to the sequence, "
     "self.mask.bool()[:num_tokens, :num_tokens] (and never hard-code the sequence length)"),
    (r"view size is not compatible with input tensor's size and stride",
     "view() after transpose(): the tensor is no longer contiguous; call .contiguous() first, or use .reshape()"),
    (r"shape '\[[\d, ]+\]' is invalid for input of size",
     "a view/reshape whose sizes do not fit the tensor: take b and num_tokens from x.shape instead of "
     "hard-coding them, and split d_out into (num_heads, head_dim)"),
    (r"mat1 and mat2 shapes cannot be multiplied|size mismatch, got input",
     "a matrix product with mismatched inner sizes: x has shape (..., d_in) and multiplies W of shape "
     "(d_in, d_out) on the right; check for a missing or extra transpose"),
    (r"has no attribute '(\w+)'",
     r"self.\1 is used but never set: assign it in __init__"),
    (r"Expected all tensors to be on the same device",
     "a tensor stayed on the CPU while the module moved: keep the mask as a registered buffer "
     "(self.register_buffer) and create new tensors on x.device"),
    (r"time limit", "the code ran past the time limit: an infinite loop?"),
    (r"maximum recursion depth", "a function or forward() calls itself without end"),
    (r"NotImplementedError", "this part is still a stub: write the code its TODO describes"),
]


def explain_error(text):
    """Plain-words readings of an exception's text (empty if none applies)."""
    found = []
    for pattern, meaning in ERROR_HINTS:
        match = re.search(pattern, text)
        if match:
            found.append(match.expand(meaning) if match.re.groups else meaning)
    return found
