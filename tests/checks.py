"""Assertions whose failure messages teach.

``assert_close`` names the array, shows expected against actual (shape, first
mismatching row) and, when the actual values match a known mistake, says which
one in plain words.
"""
from __future__ import annotations

import re

import numpy as np

# pytest leaves this module's frames out of a failure's traceback: it ends at the test's line, then the
# message says what differs (`pytest --fulltrace` shows every frame).
__tracebackhide__ = True

# The CUDA cases in bfloat16 against a float64 reference: bf16 keeps 8 bits of mantissa (about 2-3 significant
# digits), and the kernels round differently from one GPU to another.
BFLOAT16 = dict(rtol=3e-2, atol=3e-2)


def _fmt(a):
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, separator=", ", max_line_width=100)


def _matches(actual, candidate, rtol, atol):
    candidate = np.asarray(candidate)
    # NaN matches NaN: some mistakes give NaN in known places (a row of attention with nothing to attend to).
    return candidate.shape == actual.shape and np.allclose(actual, candidate, rtol=rtol, atol=atol, equal_nan=True)


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
        if expected.ndim <= 1:
            lines.append(f"  expected: {_fmt(expected)}\n  actual:   {_fmt(actual)}")
        else:  # the row with the first non-finite value: whole arrays would bury what follows
            row = bad[:-1]
            lines.append(f"  row {name}[{', '.join(map(str, row))}]:\n"
                         f"    expected: {_fmt(expected[row])}\n    actual:   {_fmt(actual[row])}")
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


def safe_softmax(x, axis=-1):
    """softmax, with 0 (not NaN) for a row that is -inf everywhere, as F.scaled_dot_product_attention gives."""
    x = np.asarray(x, dtype=np.float64)
    empty = np.all(np.isneginf(x), axis=axis, keepdims=True)
    return np.where(empty, 0.0, softmax(np.where(empty, 0.0, x), axis=axis)).astype(np.float32)


def split_heads(a, num_heads):
    """(b, num_tokens, d_out) -> (b, num_heads, num_tokens, head_dim): chapter 3's view and transpose."""
    b, t, d = a.shape
    return a.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def multihead(x, weights, num_heads, *, scale="head_dim", split="view_transpose", out_proj=True,
              qkv_bias=True, mask="causal", values="W_value", scores="queries_keys", softmaxes=1):
    """NumPy multi-head causal attention, with switches that reproduce typical mistakes.

    x: (b, T, d_in); weights: MultiHeadAttention state_dict (W_query/W_key/W_value, out_proj).
    scale: "head_dim" (right: divide by sqrt(head_dim)), "d_out" (divide by sqrt(d_out)), "none",
    "times_head_dim" (multiply by sqrt(head_dim)); split: "view_transpose" (right) or "view_only"
    (reshaping straight to (b, heads, T, head_dim)); mask: "causal", "none", "zero" (fill 0),
    "inverted" (only the future takes part: a boolean mask given to F.scaled_dot_product_attention
    as it is; a row with nothing left gives 0) or "inverted_nan" (the same where that row gives NaN);
    values: "W_value" (right) or "inputs" (x itself, when d_in == d_out); scores: "queries_keys"
    (right: queries @ keys^T) or "keys_queries" (transposed); softmaxes: how often softmax is applied.
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
        return split_heads(a, num_heads)

    q, k, v = heads(q), heads(k), heads(v)
    s = q @ k.transpose(0, 1, 3, 2) if scores == "queries_keys" else k @ q.transpose(0, 1, 3, 2)
    s = {"head_dim": s / np.sqrt(hd), "d_out": s / np.sqrt(d_out), "none": s,
         "times_head_dim": s * np.sqrt(hd)}[scale]
    future = np.triu(np.ones((t, t), bool), 1)
    if mask == "causal":
        s = causal(s)
    elif mask == "zero":
        s = causal(s, fill=0.0)
    elif mask.startswith("inverted"):
        s = np.where(future, s, -np.inf)
    with np.errstate(invalid="ignore"):  # "inverted_nan": a row of -inf gives NaN, on purpose
        w = safe_softmax(s) if mask == "inverted" else softmax(s)
    for _ in range(softmaxes - 1):
        w = softmax(w)
    context = (w @ v).transpose(0, 2, 1, 3).reshape(b, t, d_out)
    return linear(context, weights, "out_proj") if out_proj else context


def multihead_mistakes(x, weights, num_heads, out_proj=True, head_counts=True):
    """What typical multi-head mistakes produce on these inputs, keyed by a plain description.

    out_proj=False, head_counts=False: a single head (CausalAttention). Mistakes that happen to give
    the right answer for this configuration (e.g. a missing transpose with a single head) are left out.
    """
    def run(**change):
        return multihead(x, weights, num_heads, out_proj=out_proj, **change)

    sdpa = ("the boolean mask is inverted: F.scaled_dot_product_attention takes attn_mask True where a "
            "token takes part, so pass the allowed positions, ~mask (the causal buffer marks the future)")
    candidates = {
        "the scores were scaled by sqrt(d_out), the model width; each head's dot products have "
        "head_dim terms, so divide by sqrt(head_dim)": run(scale="d_out"),
        "the scores were not scaled by 1 / sqrt(head_dim)": run(scale="none"),
        "the scores were multiplied by sqrt(d_k) (d_k = head_dim, the width of one head's keys); "
        "divide by it": run(scale="times_head_dim"),
        "keys @ queries^T: the scores are transposed (row i must hold query i's scores, "
        "queries @ keys.transpose(...))": run(scores="keys_queries"),
        "softmax was applied twice: the weights were already normalised, and a second softmax "
        "flattens them and gives the masked future weight exp(0) > 0": run(softmaxes=2),
        "the heads were split with view alone: view to (b, num_tokens, num_heads, head_dim), "
        "then transpose(1, 2)": run(split="view_only"),
        "the causal mask is missing: tokens see the future": run(mask="none"),
        "masked with 0 instead of -inf: a masked score of 0 still gets weight": run(mask="zero"),
        sdpa: run(mask="inverted"),
        sdpa + " (here a row left with nothing to attend to gives NaN)": run(mask="inverted_nan"),
        "qkv_bias was ignored: pass bias=qkv_bias to W_query, W_key and W_value": run(qkv_bias=False),
    }
    if x.shape[-1] == weights["W_value.weight"].shape[0]:
        candidates["the values were the inputs: mix the projected values W_value(x), not x"] = run(values="inputs")
    if out_proj:
        candidates["out_proj was not applied to the concatenated heads"] = multihead(
            x, weights, num_heads, out_proj=False)
    d_out = weights["W_query.weight"].shape[0]
    for other in range(1, d_out + 1) if head_counts else ():
        if d_out % other == 0 and other != num_heads:
            candidates[f"the output is that of {other} heads, not num_heads={num_heads}: take every size from "
                       "the constructor's arguments (num_heads, d_out), never from a global or the book's "
                       "example"] = multihead(x, weights, other, out_proj=out_proj)
    right = run()
    return {why: c for why, c in candidates.items() if not np.allclose(c, right, rtol=1e-4, atol=1e-6)}


def single_head_mistakes(x, weights):
    """multihead_mistakes for CausalAttention: one head, no out_proj."""
    return multihead_mistakes(x, weights, 1, out_proj=False, head_counts=False)


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


# Dropout is random and torch's random stream differs across platforms and devices: it is judged by
# its properties against the same computation without dropout, never against stored masks.

def kept_fraction_tolerance(p, n):
    """How far the kept fraction of n draws may stray from 1 - p: 5 standard deviations (a fixed seed
    makes each check deterministic; this keeps it true for any seed), at least 0.02."""
    return max(0.02, 5 * np.sqrt(p * (1 - p) / n))


def check_dropout(trained, plain, p, name, *, atol=1e-6):
    """Training-mode dropout of rate p: ``trained`` is ``plain`` (the same values without dropout) with
    each nonzero value either dropped (|value| <= atol) or kept and scaled by exactly 1 / (1 - p), about
    a fraction 1 - p of them kept; the zeros of ``plain`` (e.g. the masked future) stay 0."""
    trained, plain = np.asarray(trained), np.asarray(plain)
    assert trained.shape == plain.shape, f"{name}: shape {trained.shape}, expected {plain.shape}"
    live = plain != 0
    assert np.all(np.abs(trained[~live]) <= atol), (
        f"{name}: values that are 0 without dropout (the masked future) became nonzero in training mode; "
        "apply dropout to the attention weights after the softmax"
    )
    kept = live & (np.abs(trained) > atol)
    fraction, tolerance = kept.sum() / live.sum(), kept_fraction_tolerance(p, live.sum())
    assert fraction < 1, (
        f"{name}: training mode with dropout p={p} dropped nothing: apply the dropout (a module's "
        "self.dropout) to the attention weights; nn.Dropout acts in training mode only"
    )
    assert abs(fraction - (1 - p)) < tolerance, (
        f"{name}: {fraction:.3f} of the values were kept, expected {1 - p:.2f} +- {tolerance:.3f} for p={p}. "
        "p is the probability of DROPPING an element."
    )
    ratio = trained[kept] / plain[kept]
    assert_close(f"{name}: kept values / values without dropout", ratio,
                 np.full(ratio.shape, 1 / (1 - p), np.float32), rtol=1e-4, atol=1e-5,
                 mistakes={"the kept values were not rescaled by 1 / (1 - p)": np.ones(ratio.shape, np.float32),
                           "the kept values were multiplied by (1 - p) instead of divided":
                               np.full(ratio.shape, 1 - p, np.float32)})


def check_module_dropout(stage, cls, init, x, weights, p, exposed, device="cpu"):
    """A module's dropout, by its properties. Give a case whose output exposes the attention weights
    (cases.exposing_case) and those weights (``exposed``: ``multihead`` on that case): in training mode with
    dropout=p each output value is dropped or scaled by 1 / (1 - p) (check_dropout); in eval mode the
    output is the dropout=0 module's, whatever the seed."""
    plain = stage.forward(cls, dict(init, dropout=0.0), x, weights, device=device)
    # Dropout can only be judged on a module that is right without it: otherwise this check would
    # blame dropout for another mistake of the stage (which its own checks name).
    if plain.shape != exposed.shape or not np.allclose(plain, exposed, rtol=1e-4, atol=1e-5):
        raise AssertionError(
            f"{cls} with dropout=0 does not compute the expected output on this test's case (one-hot "
            "tokens whose output is the attention weights), so its dropout cannot be checked yet: fix this "
            "stage's other failures first."
        )
    init = dict(init, dropout=p)
    for seed in (1, 2):
        assert_close(f"{cls} output in eval mode with dropout={p} (seed {seed})",
                     stage.forward(cls, init, x, weights, seed=seed, device=device), plain,
                     hint="In eval mode dropout must do nothing: use nn.Dropout, which follows the module's "
                     "train()/eval(), or pass training=self.training to F.dropout.")
    trained = stage.forward(cls, init, x, weights, train=True, seed=0, device=device)
    check_dropout(trained, plain, p, f"{cls} output in training mode with dropout={p}")


STUB = "this part is still a stub: write the code its TODO describes"
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
    (r"NotImplementedError", STUB),
]


def explain_error(text):
    """Plain-words readings of an exception's text (empty if none applies)."""
    found = []
    for pattern, meaning in ERROR_HINTS:
        match = re.search(pattern, text)
        if match:
            found.append(match.expand(meaning) if match.re.groups else meaning)
    return found
