"""Assertions whose failure messages teach.

``assert_close`` names the array, shows expected against actual (shape, first
mismatching row) and, when the actual values match a known mistake, says which
one in plain words.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

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


def assert_close(name, actual, expected, *, rtol=1e-4, atol=1e-6, mistakes=None, probes=(), hint=None):
    """Assert ``actual`` equals ``expected`` within tolerance, explaining any difference.

    mistakes: {"what the learner probably did": the array that mistake produces}, or a function
    returning that dict (called only when the check fails: some mistakes are costly to compute).
    probes: functions of ``actual`` for mistakes no single array stands for, called only when the check
    fails and no mistake's array matched; each tests the property its mistake predicts (it may run the
    learner's code again on inputs of its own) and returns the mistake's description when the evidence
    bears it out, else None.
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
    named = diagnose(actual, mistakes, rtol, atol)
    for probe in () if named else probes:
        why = probe(actual)
        if why:
            named.append(why)
    for why in named:
        lines.append(f"Likely mistake: {why}")
    if hint:
        lines.append(hint)
    raise AssertionError("\n".join(lines))


def assert_mask(name, actual, expected, *, mistakes=None):
    """A boolean mask (True = takes part) equal to ``expected``, compared as 0/1 numbers, with the masks that
    typical mistakes give (``mistakes``: {description: boolean mask})."""
    actual = np.asarray(actual)
    assert actual.dtype == bool, (
        f"{name} must be boolean (True = takes part); yours has dtype {actual.dtype}:\n{actual}")
    assert_close(f"{name} (1 = takes part)", actual.astype(np.float32), np.asarray(expected, np.float32),
                 mistakes={why: np.asarray(m, np.float32) for why, m in (mistakes or {}).items()})


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
    if not np.all(np.abs(trained[~live]) <= atol):
        message = (f"{name}: values that are 0 without dropout (the masked future) are not 0 in training mode: "
                   "dropout may only zero some weights and scale the others, never give weight to a masked key.")
        # Dropout on the scores, before the softmax, puts weight on masked scores it zeroed, and every row of
        # weights still sums to what it sums to without dropout (dropout after the softmax changes the sums).
        if np.allclose(trained.sum(axis=-1), plain.sum(axis=-1), rtol=1e-4, atol=1e-5):
            message += ("\nLikely mistake: dropout acted on the scores before the softmax (each row of the output "
                        "still sums to what it sums to without dropout): apply it to the attention weights, after "
                        "the softmax")
        raise AssertionError(message)
    kept = live & (np.abs(trained) > atol)
    fraction, tolerance = kept.sum() / live.sum(), kept_fraction_tolerance(p, live.sum())
    assert fraction < 1, (
        f"{name}: training mode with dropout p={p} dropped nothing: apply the dropout (a module's "
        "self.dropout) to the attention weights; nn.Dropout acts in training mode only"
    )
    if abs(fraction - (1 - p)) >= tolerance:
        raise AssertionError(
            f"{name}: {fraction:.3f} of the values were kept, expected {1 - p:.2f} +- {tolerance:.3f} for p={p:.3g} "
            "(dropout keeps each value with probability 1 - p)."
            + "".join(f"\nLikely mistake: {why}" for why in rate_mistakes(trained, plain, kept, p)))
    ratio = trained[kept] / plain[kept]
    assert_close(f"{name}: kept values / values without dropout", ratio,
                 np.full(ratio.shape, 1 / (1 - p), np.float32), rtol=1e-4, atol=1e-5,
                 mistakes={"the kept values were not rescaled by 1 / (1 - p)": np.ones(ratio.shape, np.float32),
                           "the kept values were multiplied by (1 - p) instead of divided":
                               np.full(ratio.shape, 1 - p, np.float32)})


def rate_mistakes(trained, plain, kept, p):
    """The mistakes that a kept fraction away from 1 - p bears out: each predicts both the fraction kept and
    the factor the kept values were scaled by, and is named only when both are what it predicts."""
    live = plain != 0
    n, fraction = live.sum(), kept.sum() / live.sum()
    ratio = trained[kept] / plain[kept]
    found = []
    twice = (1 - p) ** 2  # two independent draws must both keep a value, and each scales it by 1 / (1 - p)
    if (abs(fraction - twice) < kept_fraction_tolerance(1 - twice, n)
            and np.allclose(ratio, 1 / twice, rtol=1e-4, atol=1e-5)):
        found.append(
            f"dropout was applied twice: {fraction:.3f} of the values were kept, about (1 - p)^2 = {twice:.3g}, each "
            f"scaled by 1 / (1 - p)^2 = {1 / twice:.3g}. The chapter's attention drops its weights once, after the "
            "softmax: remove the second dropout (nanoGPT's resid_dropout after the output projection, for one; in "
            "the book's GPT model the transformer block applies that dropout around the attention module)")
    if p != 0.5 and abs(fraction - p) < kept_fraction_tolerance(p, n):
        found.append(f"p was used as the probability of keeping a value ({fraction:.3f} kept, about p = {p:.3g}): p is "
                     "the probability of DROPPING an element (keep where torch.rand_like(x) >= p)")
    return found


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


# ---------------------------------------------------------------- errors
#
# An exception carries no numbers to compare with a mistake's, so what it means is read from its own
# message, and only as far as the evidence goes: each reading is checked against the operation that
# raised (``Call``: the constructor arguments and the sizes of the inputs the test gave), and one the
# evidence does not bear out is not shown. A message that says nothing specific beats a wrong one.

STUB = "this part is still a stub: write the code its TODO describes"
BOOK_LENGTH = 6  # tokens in the book's example ("Your journey starts with one step"): a tell of a hard-coded size


@dataclass(frozen=True)
class Call:
    """An operation on the learner's code that raised, as the test asked for it: ``op`` and the keyword
    arguments of ``adapters.OPS[op]``."""

    op: str
    kwargs: dict

    @property
    def init(self) -> dict:
        return self.kwargs.get("init") or {}

    @property
    def cls(self):
        return self.kwargs.get("cls")

    def forwards(self):
        """(b, num_new, num_keys) of each forward the operation ran, in order: a batch of num_new queries
        attending over num_keys keys (a cached step's keys: every token fed since the cache was emptied)."""
        if self.op in ("forward", "heads_forward"):
            shape = np.shape(self.kwargs.get("x"))
            return [(shape[0], shape[1], shape[1])] if len(shape) >= 2 else []
        runs, cached = [], 0
        for step in (self.kwargs.get("steps") or ()) if self.op == "session" else ():
            if step.get("method") == "reset_cache":
                cached = 0
            if step.get("method") != "forward" or not step.get("args") or len(np.shape(step["args"][0])) < 2:
                continue
            b, n = np.shape(step["args"][0])[:2]
            options = step.get("kwargs") or {}
            if options.get("use_cache"):
                cached += n
                runs.append((b, n, cached))
            else:
                context = options.get("context")
                runs.append((b, n, n if context is None else np.shape(context)[1]))
        return runs

    def function_calls(self, name):
        """(args, kwargs) of each call of the stage module's function ``name`` in this operation."""
        if self.op == "call" and self.kwargs.get("func") == name:
            return [(list(self.kwargs.get("args") or ()), self.kwargs.get("kwargs") or {})]
        return [(list(s.get("args") or ()), s.get("kwargs") or {}) for s in self.kwargs.get("steps") or ()
                if self.op == "session" and s.get("function") == name]

    def sizes(self) -> set:
        """Every size the test chose: the dimensions of every array it passed and every whole-number argument."""
        found = set()

        def visit(value):
            if isinstance(value, np.ndarray):
                found.update(int(s) for s in value.shape)
            elif isinstance(value, dict):
                for v in value.values():
                    visit(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    visit(v)
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                found.add(int(value))

        visit(self.kwargs)
        return found


@dataclass(frozen=True)
class ErrorReading:
    """What an error probably means. ``pattern``: a regex over the exception's type and message ("RuntimeError:
    ..."), never its traceback, which quotes the learner's code. ``meaning``: the words to show (a template for
    the match's groups) when the message alone is evidence enough, or a function (match, call) giving the words
    when the failing ``Call`` (None when unknown) bears the reading out, else None."""

    pattern: str
    meaning: str | Callable

    def read(self, text, call):
        match = re.search(self.pattern, text)
        if match is None:
            return None
        if callable(self.meaning):
            return self.meaning(match, call) if call is not None else None
        return match.expand(self.meaning)


BROADCAST = r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton dimension (\d+)"


def broadcast_sizes(match):
    """The two sizes that could not be broadcast, and the dimension (of the result) where they met."""
    return {int(match[1]), int(match[2])}, int(match[3])


def mask_not_cut(match, call):
    """A causal mask kept at context_length x context_length (or cut to the book's 6 tokens) meeting the
    scores of a sequence of another length: chapter 3's modules, whose queries and keys are x's num_tokens."""
    sizes, _ = broadcast_sizes(match)
    length = call.init.get("context_length")
    for _, num_tokens, num_keys in call.forwards():
        if num_keys != num_tokens:
            continue
        if length and length > num_tokens and sizes == {num_tokens, length}:
            return (f"the causal mask is context_length x context_length ({length} x {length}) and met the scores of "
                    f"num_tokens = {num_tokens} tokens: cut it to the sequence, self.mask.bool()[:num_tokens, "
                    ":num_tokens] with num_tokens = x.shape[1] (never hard-code the sequence length)")
        if sizes == {num_tokens, BOOK_LENGTH} and BOOK_LENGTH not in call.sizes():
            return (f"something sized for {BOOK_LENGTH} tokens (the book's example; no size of this check is "
                    f"{BOOK_LENGTH}) met the scores of num_tokens = {num_tokens} tokens: never hard-code the sequence "
                    "length or read it from a global: size the mask buffer with the constructor's context_length "
                    "and cut it with num_tokens = x.shape[1]")
    return None


def view_sizes(match, call):
    """A view/reshape to sizes that do not fit: which of the sizes the test gave it got wrong."""
    shape, size = [int(s) for s in match[1].split(",")], int(match[2])
    if len(shape) < 3 or min(shape) < 1:
        return None
    d_in, d_out, num_heads = (call.init.get(k) for k in ("d_in", "d_out", "num_heads"))
    lead, width = shape[:2], int(np.prod(shape[2:]))
    for b, num_tokens, _ in call.forwards():
        if size == b * num_tokens * width and lead != [b, num_tokens]:
            which = "the batch size b" if shape[0] != b else "num_tokens"
            return (f"a view to sizes ({shape[0]}, {shape[1]}, ...) where x holds (b, num_tokens) = "
                    f"({b}, {num_tokens}): take {which} from x.shape instead of hard-coding it")
        if lead != [b, num_tokens] or not (d_in and d_out) or d_in == d_out:
            continue
        if size == b * num_tokens * d_out and width == d_in:
            return (f"a tensor of width d_out = {d_out} was viewed with x's width d_in = {d_in}: take the width from "
                    "the constructor (self.d_out), never from x's last size")
        if size == b * num_tokens * d_in and width == d_out:
            return (f"a tensor of x's width d_in = {d_in} was viewed as d_out = {d_out} wide: the heads split the "
                    "projections' outputs W_query(x), W_key(x), W_value(x) (width d_out), not x itself")
        if size == b * num_tokens * d_out and len(shape) == 4 and num_heads and shape[2] != num_heads:
            return (f"the heads were split as {shape[2]} x {shape[3]} where the constructor's arguments give num_heads "
                    f"= {num_heads}, head_dim = d_out // num_heads = {d_out // num_heads}: take both from the "
                    "constructor's arguments (num_heads, d_out), never from a global or the book's example")
    return None


def matmul_sizes(match, call):
    """A product whose inner sizes differ: a layer built for another input width, or a transposed operand."""
    m, inner, other, n = (int(g) for g in match.groups())
    d_in = call.init.get("d_in")
    transposed = n == inner  # (the second operand transposed would fit)
    others = {call.init.get("d_out"), call.init.get("head_dim")}
    wrong_layer = bool(d_in) and inner == d_in and other != d_in and d_in not in others
    if transposed:  # (nn.Linear(d_out, d_in), its arguments swapped, shows the same sizes)
        return (f"({m}x{inner}) @ ({other}x{n}): the inner sizes differ but the second matrix transposed, "
                f"({n}x{other}), would fit: is a transpose missing or extra? x @ W takes W of shape (d_in, d_out); "
                "nn.Linear(d_in, d_out)'s weight has shape (d_out, d_in) and is applied as x @ weight.T")
    if wrong_layer:
        return (f"a layer built for inputs of width {other} got x, whose width is d_in = {d_in}: build every layer "
                "from the constructor's arguments (nn.Linear(d_in, ...)), never from globals")
    return None


def parameter_sizes(match, call):
    """A layer whose input width (the last size of a weight) is not the documented d_in the constructor was given:
    the module took it from somewhere else."""
    name = match[1]
    given, built = ([int(s) for s in re.findall(r"\d+", group)] for group in (match[2], match[3]))
    d_in = call.init.get("d_in")
    if not (d_in and len(given) == len(built) == 2 and given[-1] == d_in != built[-1] and given != built[::-1]):
        return None
    return (f"{name} has shape {tuple(built)}: a layer built for inputs of width {built[-1]}, but the constructor's "
            f"d_in is {d_in}: build it as nn.Linear(d_in, ...) from the constructor's arguments, never from globals "
            "or the book's example")


def attribute_never_set(match, call):
    """An attribute of the module under test read before anything was assigned to it."""
    if match[1] != call.cls:
        return None
    return f"self.{match[2]} is used but never set: assign it in __init__"


ERROR_READINGS = [
    ErrorReading(BROADCAST, mask_not_cut),
    ErrorReading(r"view size is not compatible with input tensor's size and stride",
                 "view() on a tensor that is not contiguous in memory (what transpose() returns): call .contiguous() "
                 "first, or use .reshape()"),
    ErrorReading(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)", view_sizes),
    ErrorReading(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)", matmul_sizes),
    ErrorReading(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                 r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)", parameter_sizes),
    ErrorReading(r"'(\w+)' object has no attribute '(\w+)'", attribute_never_set),
    ErrorReading(r"Expected all tensors to be on the same device",
                 "tensors on two devices met: create every new tensor on x.device, and keep constant tensors such as "
                 "the mask as registered buffers (self.register_buffer), which module.to(device) moves"),
    ErrorReading(r"time limit", "the code ran past the time limit: an infinite loop?"),
    ErrorReading(r"maximum recursion depth", "a function or forward() calls itself without end"),
    # What the kit's stubs raise (grader/authoring/stubs.py), and nbgrader's: NotImplementedError() with no message.
    ErrorReading(r"\ANotImplementedError(:\s*(\w+: .*see its TODO)?)?\s*\Z", STUB),
]


def readings_with(pattern, meaning):
    """ERROR_READINGS with the reading of ``pattern`` replaced by ``meaning``: a test module's ERROR_READINGS,
    for a stage where that error means something else (a cached step's mask, a tile's)."""
    return [ErrorReading(pattern, meaning) if r.pattern == pattern else r for r in ERROR_READINGS]


def error_text(typename, message):
    """An exception as readings read it: "Type: message", without the traceback a grading sandbox appends
    (its frames quote the learner's code, which is no evidence of what the error means)."""
    text = message if typename == "SubmissionError" else f"{typename}: {message}"
    return text.split("\nwhere (most recent call last):", 1)[0].strip()


def explain_error(text, call=None, readings=None):
    """What an exception's ``text`` (error_text) means, as far as the failing ``call`` bears it out: one entry
    per reading that holds (empty if none). readings: a stage's own (its test module's ERROR_READINGS)."""
    found = []
    for reading in ERROR_READINGS if readings is None else readings:
        try:
            meaning = reading.read(text, call)
        except Exception:  # evidence it cannot read (sizes of an unexpected form): it says nothing
            meaning = None
        if meaning and meaning not in found:
            found.append(meaning)
    return found


# Rotary position embeddings in NumPy (float64), Llama's halves layout and the typical mistakes' other layouts:
# the stages that rotate queries and keys (m05, f01) compute their expected values with these.

def np_angles(head_dim, positions, theta_base=10_000.0, layout="halves", frequency="pairs"):
    """(len(positions), head_dim) angles. layout "halves" (right: cat([freqs, freqs])) or "interleaved"
    (each repeated twice); frequency "pairs" (right: exponent 2i/head_dim) or "features" (i/head_dim)."""
    step = 2 if frequency == "pairs" else 1
    inv_freq = float(theta_base) ** (-np.arange(0, step * head_dim // 2, step, dtype=np.float64) / head_dim)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # (T, head_dim/2)
    return np.concatenate([freqs, freqs], axis=-1) if layout == "halves" else np.repeat(freqs, 2, axis=-1)


def np_rope(x, positions, theta_base=10_000.0, pairs="halves", angles="halves", sign=1):
    """x (..., T, head_dim) rotated at positions (T,). pairs "halves" (right: i with i + head_dim/2) or
    "interleaved" (2i with 2i + 1); angles: np_angles' layout; sign=-1 rotates the other way."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    a = sign * np_angles(d, positions, theta_base, angles)
    if pairs == "halves":
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    else:
        rotated = np.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
    return x * np.cos(a) + rotated * np.sin(a)
