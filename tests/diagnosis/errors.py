"""What an exception raised by learner code means, read from its own message and checked against the
operation that raised it."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations_with_replacement

import numpy as np

from .findings import Finding

# ---------------------------------------------------------------- errors
#
# An exception carries no numbers to compare with a mistake's, so what it means is read from its own
# message, and only as far as the evidence goes: each reading is checked against the operation that
# raised (``Call``: the constructor arguments and the sizes of the inputs the test gave), and one the
# evidence does not bear out is not shown. A message that says nothing specific beats a wrong one.

# What a stub's NotImplementedError means: no mistake, a part not written yet (a report shows it as such, never as a
# "Likely mistake:"; a student's pytest says it in one line at the stub, its summary "fill in the TODOs").
STUB = "Not written yet: write the code its TODO describes"
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
    needs_call: bool = True  # a function meaning that reads the message alone (its own evidence) says False
    # Whether the error's own text says what was done (a view of a tensor that is not contiguous, an attribute never
    # set): its words are then the likely mistake. A reading of sizes shows where two tensors met, not which step
    # made them so: its cause is said with "if" (findings.POSSIBLE_ONE). Default: a fixed text is proven, a function
    # reading sizes is not.
    proven: bool | None = None

    @property
    def is_proven(self) -> bool:
        return (not callable(self.meaning)) if self.proven is None else self.proven

    def read(self, text, call):
        match = re.search(self.pattern, text, re.S)
        if match is None:
            return None
        if callable(self.meaning):
            return self.meaning(match, call) if call is not None or not self.needs_call else None
        return match.expand(self.meaning)


BROADCAST = r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton dimension (\d+)"
VIEW = r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)"
MATMUL = r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)"
# torch's words when a batched product's operands disagree (bmm, baddbmm): the 2nd and 4th groups are the inner sizes.
# (Kept here, in what every release ships, rather than in a stage's test file: a learner of another assignment meets
# this error too, and text that only a hidden test holds is removed from what a box says.)
BATCHED_PRODUCT = (r"Expected size for first two dimensions of batch2 tensor to be: \[(\d+), (\d+)\] "
                   r"but got: \[(\d+), (\d+)\]")


def broadcast_sizes(match):
    """The two sizes that could not be broadcast, and the dimension (of the result) where they met."""
    return {int(match[1]), int(match[2])}, int(match[3])


def call_inputs(call) -> list[tuple[tuple, str]]:
    """(shape, how to name it) of each array the failing ``call`` gave the learner's code."""
    found = []
    if call.op == "call":
        for index, value in enumerate(call.kwargs.get("args") or ()):
            if isinstance(value, np.ndarray):
                found.append((tuple(int(s) for s in value.shape), f"argument {index + 1}"))
        for key, value in (call.kwargs.get("kwargs") or {}).items():
            if isinstance(value, np.ndarray):
                found.append((tuple(int(s) for s in value.shape), key))
    elif isinstance(call.kwargs.get("x"), np.ndarray):
        found.append((tuple(int(s) for s in call.kwargs["x"].shape), "x"))
    return found


def shifted_axis(match, call):
    """Two sizes that could not be broadcast, at dimension k, that are the sizes of axes k and k - 1 of an input the
    check gave: one operand holds the input's axis k - 1 one place to the right of where the input has it. That is
    what the sizes show, and two kinds of step give exactly that: a reduction over an axis without keepdim=True
    (its result lacks that axis, and torch lines shapes up from the right), and axes k - 1 and k swapped in one
    tensor. The error cannot tell them apart: both are said, each with "if"."""
    a, b, dim = int(match[1]), int(match[2]), int(match[3])
    for shape, label in call_inputs(call):
        if not 1 <= dim < len(shape) or shape[dim] == shape[dim - 1] or {a, b} != {shape[dim], shape[dim - 1]}:
            continue
        own, moved = shape[dim], shape[dim - 1]
        # (a size named only as an axis of this input is said as a number: the sentence names the axis already)
        names = {size: [n for n in found if not n.startswith("axis ")] for size, found in named_sizes(call).items()}
        shows = (f"torch could not combine two tensors at dimension {dim}: one holds there {_named(own, names)}, the "
                 f"size of axis {dim} of {label} (shape {shape}); the other holds {_named(moved, names)}, the size of "
                 f"its axis {dim - 1}: one place to the right of where {label} has it.")
        return Finding(shows, (
            "if a sum, max or mean over an axis feeds this operation: it dropped the reduced axis (no keepdim=True), "
            "so under broadcasting (shapes lined up from the right) its other axes sit one place to the right and "
            "each row meets another row's sum or max; keep the axis, x.sum(dim=dim, keepdim=True) or "
            "x.max(dim=dim, keepdim=True).values",
            f"if one tensor has its axes {dim - 1} and {dim} the other way round: a transpose missing or extra, or a "
            "view or reshape to another order of axes than the tensor holds"), "shapes", "error")
    return None


def mask_not_cut(match, call):
    """A causal mask kept at context_length x context_length (or cut to the book's 6 tokens) meeting the
    scores of a sequence of another length: chapter 3's modules, whose queries and keys are x's num_tokens."""
    sizes, _ = broadcast_sizes(match)
    length = call.init.get("context_length")
    for _, num_tokens, num_keys in call.forwards():
        if num_keys != num_tokens:
            continue
        if length and length > num_tokens and sizes == {num_tokens, length}:
            if any(k in call.init for k in ("rope_dim", "theta_base")):  # (RoPE's tables have context_length rows)
                return (f"a tensor of context_length = {length} rows met one of num_tokens = {num_tokens}: if it is "
                        "the causal mask, cut it to the sequence (mask[:num_tokens, :num_tokens]); if it is RoPE's "
                        "cos and sin, a slice of them came out of another length than the tokens it rotates "
                        "(cos[offset:offset + num_tokens] with an offset that runs past the table's end, say)")
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


# What a layer of a module can give (an output width): a matrix made as (this width x something) and applied the wrong
# way round shows this width where the input's belongs.
OUTPUT_WIDTHS = ("d_out", "head_dim", "d_model", "kv_latent_dim", "rope_dim", "index_dim", "num_kv_groups * head_dim",
                 "3 * d_out", "num_heads * head_dim", "num_heads * d_out")


def input_widths(call) -> dict[str, set[int]]:
    """The widths (last sizes) of the x and of the context that each forward of the failing ``call`` was given."""
    found: dict[str, set[int]] = {}

    def add(name, value):
        if isinstance(value, np.ndarray) and value.ndim >= 2:
            found.setdefault(name, set()).add(int(value.shape[-1]))

    add("x", call.kwargs.get("x"))
    for step in call.kwargs.get("steps") or ():
        if step.get("method") == "forward" and step.get("args"):
            add("x", step["args"][0])
            add("context", (step.get("kwargs") or {}).get("context"))
    return found


def matmul_sizes(match, call):
    """A product whose inner sizes differ: which named sizes met, of which operands (a tensor of one width, a
    matrix made for another: an nn.Linear(in, out) is applied as such a product, its second operand (in x out)).
    A class of mistake is said, with "if", only where the named sizes are exactly what it gives: the second operand
    (output width x input width), a weight applied without its transpose or made with its sizes swapped; a width
    that is no size of this check at all, one that came from somewhere else than the constructor's arguments.
    Otherwise the sizes are the evidence (a layer made for the context's width that got x's says so), with the
    general classes of a meeting of those kinds of size (``_meeting_causes``), as the general reading has them."""
    m, inner, other, n = (int(g) for g in match.groups())
    d_in = call.init.get("d_in")
    names = named_sizes(call)
    shows = (f"a product ({m}x{inner}) @ ({other}x{n}) whose inner sizes differ: a tensor of width "
             f"{_named(inner, names)} met a matrix made for width {_named(other, names)} (if that matrix is a "
             f"layer's weight: a layer nn.Linear({other}, {n}), made for width {other}, got a tensor of width "
             f"{inner}).")
    # (the second operand transposed would fit, and it is shaped (an output width, the input's width) as a weight is)
    as_a_weight = n == inner and any(name in OUTPUT_WIDTHS for name in names.get(other, ()))
    if as_a_weight:  # (nn.Linear(d_out, d_in), its arguments swapped, shows the same sizes)
        return Finding(shows + f" The second matrix transposed, ({n}x{other}), would fit.",
                       ("if a weight is applied by hand: is a transpose missing or extra? x @ W takes W of shape "
                        "(d_in, d_out); nn.Linear(d_in, d_out)'s weight has shape (d_out, d_in) and is applied as "
                        "x @ weight.T",
                        "if the layer is an nn.Linear: its two sizes are swapped (nn.Linear(in_features, "
                        "out_features))",
                        "if several projections share one weight (q, k and v fused): the output is split or viewed "
                        "in another layout than the weight was made in"), "shapes", "error")
    if bool(d_in) and inner == d_in and other not in names:
        return Finding(shows + f" No size of this check is {other}.",
                       (f"if a layer's width came from a global or the book's example: it was made for width {other} "
                        f"and got x, of width d_in = {d_in}; build every layer from the constructor's arguments "
                        "(nn.Linear(d_in, ...)), never from globals",), "shapes", "error")
    widths = input_widths(call)
    if widths.get("x") == {inner} and widths.get("context") == {other}:
        shows += (f" This check gave x of width {inner} and a context of width {other}: the matrix made for the "
                  "context's width got a tensor as wide as x.")
    if "features" in _kinds(inner, names) & _kinds(other, names):
        # Two widths of the module's own met (a layer made for the context's width got x's): the names say all the
        # sizes show, and another name one of them shares (cached tokens, say) would only suggest a wrong story.
        return Finding(shows, (), "shapes", "error")
    return Finding(shows, _meeting_causes(inner, other, names), "shapes", "error")


def parameter_sizes(match, call):
    """A layer whose input width (the last size of a weight) is not the documented one: what the sizes are, by the
    names the constructor's arguments give them. Which step made the layer so is not in the error: a layer built
    from another width (a global, the book's example), or built as wide as something else the module holds (all
    heads side by side)."""
    name = match[1]
    given, built = ([int(s) for s in re.findall(r"\d+", group)] for group in (match[2], match[3]))
    d_in = call.init.get("d_in")
    if not (d_in and len(given) == len(built) == 2 and given[-1] == d_in != built[-1] and given != built[::-1]):
        return None
    names = named_sizes(call)
    what = _named(built[-1], names)
    return Finding(f"{name} has shape {tuple(built)} where the documented one is {tuple(given)}: it takes inputs of "
                   f"width {what}, not d_in = {d_in}.",
                   ("if the layer is built from a global or the book's example: build it from the constructor's "
                    "arguments (nn.Linear(d_in, ...)), never from globals",
                    f"if it was sized as another tensor of the module ({what}), size it for what it is applied to"),
                   "shapes", "error")


def parameter_rows(match, call):
    """A key or value projection built with another number of heads than num_kv_groups: its rows read as the
    constructor's arguments give them, (num_heads / num_kv_groups) * head_dim being the group size taken for the
    number of key/value heads."""
    name = match[1]
    given, built = ([int(s) for s in re.findall(r"\d+", group)] for group in (match[2], match[3]))
    h, g, d_out = (call.init.get(k) for k in ("num_heads", "num_kv_groups", "d_out"))
    if not (h and g and d_out and given and built and given[0] != built[0] and given[1:] == built[1:]):
        return None
    head_dim = d_out // h
    if g not in (1, h) and given[0] == g * head_dim and built[0] == (h // g) * head_dim:  # (else d_out's, a head's)
        return (f"{name} has {built[0]} rows = (num_heads / num_kv_groups) * head_dim = ({h} / {g}) * {head_dim}, "
                f"where num_kv_groups * head_dim = {given[0]} is documented: num_kv_groups was read as the group size "
                "(query heads per key/value head); it is the number of key/value heads, so W_key and W_value give "
                "num_kv_groups * head_dim features and each serves num_heads // num_kv_groups query heads")
    return None


def not_batch_first(match, call):
    """nn.MultiheadAttention without batch_first=True reads x (b, num_tokens, d) as (num_tokens, b, d): a mask of
    num_tokens x num_tokens then meets what it takes for b x b."""
    mask, wanted = {int(match[1]), int(match[2])}, {int(match[3]), int(match[4])}
    steps = [a for step in call.kwargs.get("steps") or () for a in step.get("args") or ()]
    for value in [*call.kwargs.get("args", ()), *(call.kwargs.get("kwargs") or {}).values(), call.kwargs.get("x"),
                  *steps]:
        shape = np.shape(value)
        if len(shape) == 3 and shape[0] != shape[1] and mask == {shape[1]} and wanted == {shape[0]}:
            return (f"the attention took x {tuple(shape)} for (num_tokens, b, d) = ({shape[0]}, {shape[1]}, "
                    f"{shape[2]}): a mask for x's {shape[1]} tokens met what it expected for {shape[0]}, the batch "
                    "size. nn.MultiheadAttention reads (seq, batch, embed) unless built with batch_first=True: pass "
                    "batch_first=True (or transpose x to (num_tokens, b, d) and the output back)")
    return None


def parameters_not_registered(match, call):
    """The module's parameters, as the test found them, against the documented ones: none at all, or only some
    (the others kept where nn.Module does not look)."""
    expected = re.findall(r"'([\w.]+)'", match[1])
    yours = re.findall(r"'([\w.]+)'", match[2])
    if expected and not yours:
        return ("your module registers no parameters at all: layers kept in a plain Python list, dict or tuple, and "
                "tensors that are not nn.Parameter, are invisible to nn.Module (parameters(), state_dict(), .to()): "
                "use nn.ModuleList / nn.ModuleDict and nn.Linear or nn.Parameter")
    missing = sorted(set(expected) - set(yours))
    if missing and set(yours) < set(expected):
        prefixes = sorted({name.split(".")[0] for name in missing})
        return (f"your module registers only some of its parameters ({', '.join(prefixes)} missing): layers kept in "
                "a plain Python list, dict or tuple are invisible to nn.Module; use nn.ModuleList / nn.ModuleDict")
    return None


def attribute_never_set(match, call):
    """An attribute of the module under test read before anything was assigned to it."""
    if match[1] != call.cls:
        return None
    return f"self.{match[2]} is used but never set: assign it in __init__"


DTYPE_NAMES = {"float": "float32", "Float": "float32", "double": "float64", "Double": "float64", "Half": "float16",
               "half": "float16", "BFloat16": "bfloat16", "c10::BFloat16": "bfloat16", "c10::Half": "float16",
               "long": "int64", "Long": "int64", "Int": "int32", "int": "int32", "Bool": "bool", "bool": "bool"}
DTYPES = r"(c10::BFloat16|c10::Half|BFloat16|Half|half|Float|float|Double|double|Long|long|Int|int|Bool|bool)"


def dtypes_met(match, call):
    """Two tensors of different dtypes met in an operation: when the check ran the learner's code in one of them
    (its parameters and inputs), the other was made inside the code with a fixed dtype."""
    found = [DTYPE_NAMES[g] for g in match.groups() if g in DTYPE_NAMES]
    if len(set(found)) < 2:
        return None
    ran = (call.kwargs.get("dtype") or "float32") if call.op in ("forward", "session") else None
    if ran not in found:
        return None
    other = next(d for d in found if d != ran)
    return (f"tensors of two dtypes met ({' and '.join(dict.fromkeys(found))}): this check ran your code with its "
            f"parameters and inputs in {ran}, so a {other} tensor was made inside it with a fixed dtype "
            "(torch.tensor/ones/zeros/full/empty without dtype=, or .float()): make new tensors with dtype=x.dtype "
            "and device=x.device, or keep constant ones as buffers (module.to(dtype) converts those)")


# torch's names of a dtype in "value cannot be converted to type ... without overflow": (its name in Python, the
# largest finite value, whether it is a floating dtype).
OVERFLOW = r"value cannot be converted to type ([\w:]+) without overflow"
BFLOAT16_MAX, INT64_MAX = 3.3895313892515355e38, 2 ** 63 - 1
DTYPE_RANGES = {
    "c10::BFloat16": ("bfloat16", BFLOAT16_MAX, True), "at::BFloat16": ("bfloat16", BFLOAT16_MAX, True),
    "c10::Half": ("float16", 65504.0, True), "at::Half": ("float16", 65504.0, True),
    "float": ("float32", 3.4028234663852886e38, True), "double": ("float64", 1.7976931348623157e308, True),
    "int64_t": ("int64", INT64_MAX, False), "long": ("int64", INT64_MAX, False), "int": ("int32", 2 ** 31 - 1, False),
    "int16_t": ("int16", 2 ** 15 - 1, False), "short": ("int16", 2 ** 15 - 1, False),
    "int8_t": ("int8", 2 ** 7 - 1, False), "uint8_t": ("uint8", 2 ** 8 - 1, False),
}
FLOAT32_MIN = -3.4028234663852886e38


def value_overflows(match, call):
    """A value given to fill a tensor (masked_fill, fill_, torch.full, ...) that its dtype cannot hold: read from the
    exception itself, which names the dtype; the range is that dtype's."""
    known = DTYPE_RANGES.get(match[1])
    if known is None:
        return None
    name, top, floating = known
    if not floating:
        low = 0 if name.startswith("uint") else -top - 1
        return (f"a value given to fill a tensor (masked_fill, fill_, torch.full, ...) does not fit its dtype, {name}, "
                f"whose values run from {low} to {top}: an integer tensor holds no -inf and no float's min; fill a "
                "floating-point tensor (the scores), or use a value in that range")
    outside = (f" (torch.finfo(torch.float32).min = {FLOAT32_MIN:.4g} lies outside it)" if top < -FLOAT32_MIN
               else "")
    return (f"a value given to fill a tensor (masked_fill, fill_, torch.full, ...) does not fit its dtype, {name}, "
            f"whose finite values run from {-top:.4g} to {top:.4g}{outside}: take the fill value from the tensor's "
            f"own dtype, torch.finfo(scores.dtype).min, or use float('-inf'), which every floating dtype holds")


ERROR_READINGS = [
    ErrorReading(BROADCAST, shifted_axis),
    ErrorReading(r"parameter names differ from the documented ones\.\s*expected \(given by the test\): \[(.*?)\]\s*"
                 r"yours: \[(.*?)\]", parameters_not_registered, needs_call=False, proven=True),
    ErrorReading(rf"expected m1 and m2 to have the same dtype, but got: {DTYPES} != {DTYPES}", dtypes_met, proven=True),
    ErrorReading(rf"[Ee]xpected scalar type {DTYPES} but found {DTYPES}", dtypes_met, proven=True),
    ErrorReading(rf"query\.dtype: {DTYPES},? key\.dtype: {DTYPES}", dtypes_met, proven=True),
    ErrorReading(rf"result type {DTYPES} can't be cast to the desired output type {DTYPES}", dtypes_met, proven=True),
    ErrorReading(rf"Input type \({DTYPES}\) and (?:bias|weight) type \({DTYPES}\) should be the same", dtypes_met,
                 proven=True),
    ErrorReading(BROADCAST, mask_not_cut),
    ErrorReading(OVERFLOW, value_overflows, needs_call=False, proven=True),
    ErrorReading(r"view size is not compatible with input tensor's size and stride",
                 "view() on a tensor that is not contiguous in memory (what transpose() returns): call .contiguous() "
                 "first, or use .reshape()"),
    ErrorReading(VIEW, view_sizes),
    ErrorReading(MATMUL, matmul_sizes),
    ErrorReading(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                 r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)", parameter_sizes),
    ErrorReading(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                 r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)", parameter_rows),
    ErrorReading(r"The shape of the 2D attn_mask is torch\.Size\(\[(\d+), (\d+)\]\), but should be \((\d+), (\d+)\)",
                 not_batch_first),
    ErrorReading(r"'(\w+)' object has no attribute '(\w+)'", attribute_never_set, proven=True),
    ErrorReading(r"Expected all tensors to be on the same device",
                 "tensors on two devices met: create every new tensor on x.device, and keep constant tensors such as "
                 "the mask as registered buffers (self.register_buffer), which module.to(device) moves"),
    ErrorReading(r"time limit", "the code ran past the time limit: an infinite loop?", proven=False),
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


def error_findings(text, call=None, readings=None) -> list[Finding]:
    """What an exception's ``text`` (error_text) means, as far as the failing ``call`` bears it out: one finding per
    reading that holds; where none does, what the sizes torch quotes are by the names of the case (``size_reading``).
    readings: a stage's own (its test module's ERROR_READINGS)."""
    found: list[Finding] = []
    for reading in ERROR_READINGS if readings is None else readings:
        try:
            meaning = reading.read(text, call)
        except Exception:  # evidence it cannot read (sizes of an unexpected form): it says nothing
            meaning = None
        if isinstance(meaning, str) and meaning:
            meaning = Finding("", (meaning,), "", "error", proven=reading.is_proven)
        if meaning and meaning not in found:
            found.append(meaning)
    if not found:
        try:
            general = size_reading(text, call)
        except Exception:
            general = None
        found += [general] if general else []
    return found


def explain_error(text, call=None, readings=None):
    """``error_findings`` in words: one entry per finding (its evidence and its causes)."""
    return [" ".join(f.lines()) if f.shows or not f.causes else f.causes[0]
            for f in error_findings(text, call, readings)]


# ---------------------------------------------------------------- sizes by their names
#
# A shape error quotes numbers; the case that raised chose every size, pairwise distinct where it can, so a number
# names a size. One reading serves every stage: it says which named sizes met where, and the class of mistake that
# makes such a meeting where the names leave one (heads not repeated, a transpose of the wrong axes, tensors joined
# on the wrong axis), always with "if": the sizes show where two tensors met, not which step made them so.

HEADS = ("num_heads", "num_kv_groups", "index_heads")
TOKENS = ("num_tokens", "num_keys", "cached tokens", "context_length", "block_size", "window", "top_k")
FEATURES = ("d_in", "d_out", "head_dim", "d_model", "kv_latent_dim", "rope_dim", "index_dim", "d_context")


def named_sizes(call) -> dict[int, list[str]]:
    """{size: its names} for the failing ``call``: the constructor's whole-number arguments and the call's, the
    sizes they make (head_dim = d_out // num_heads, the key/value width), and each forward's batch size, number of
    new tokens and of keys (a cached step's keys: every token fed since the cache was emptied)."""
    names: dict[int, list[str]] = {}

    def add(value, name):
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0:
            names.setdefault(int(value), [])
            if name not in names[int(value)]:
                names[int(value)].append(name)

    init = call.init
    for key, value in {**init, **(call.kwargs.get("kwargs") or {} if call.op == "call" else {})}.items():
        add(value, key)
    for step in call.kwargs.get("steps") or ():
        for key, value in (step.get("kwargs") or {}).items():
            add(value, key)
    d, h = init.get("d_out") or init.get("d_model"), init.get("num_heads")
    if d and h and d % h == 0 and "head_dim" not in init:
        add(d // h, "head_dim")
        if init.get("num_kv_groups"):
            add(init["num_kv_groups"] * (d // h), "num_kv_groups * head_dim")
        add(3 * d, "3 * d_out (q, k and v side by side)")
    if init.get("head_dim") and h:
        add(init["head_dim"] * h, "num_heads * head_dim")
    if init.get("d_out") and h:
        add(init["d_out"] * h, "num_heads * d_out")
    for b, new, keys in call.forwards():
        add(b, "the batch size b")
        add(new, "num_tokens")
        if keys != new:
            add(keys, "num_keys (cached and new tokens)")
            add(keys - new, "cached tokens")
        add(b * new, "b * num_tokens")
    if call.op == "call":
        for index, value in enumerate(call.kwargs.get("args") or ()):
            shape = np.shape(value) if isinstance(value, np.ndarray) else ()
            for axis, size in enumerate(shape):
                if len(shape) >= 2 and int(size) not in names:
                    add(int(size), f"axis {axis} of argument {index + 1} {tuple(int(s) for s in shape)}")
    return names


def _named(size: int, names: dict[int, list[str]]) -> str:
    """``size`` with its names: "num_heads (6)", "head_dim or num_tokens (4)" where two share it, "5" if none."""
    found = names.get(int(size))
    return f"{' or '.join(found)} ({size})" if found else str(size)


def _kinds(size, names) -> set[str]:
    kinds = set()
    for name in names.get(int(size), ()):
        kinds |= {kind for kind, group in (("heads", HEADS), ("tokens", TOKENS), ("features", FEATURES))
                  if any(name.startswith(g) for g in group)}
        kinds |= {"batch"} if name == "the batch size b" else set()
    return kinds


def _meeting_causes(a: int, b: int, names) -> tuple[str, ...]:
    """The classes of mistake that make a tensor sized ``a`` meet one sized ``b`` on one axis, where the names
    leave them; none where they do not (the sizes alone are then the evidence)."""
    names_a, names_b = set(names.get(int(a), ())), set(names.get(int(b), ()))
    kinds_a, kinds_b = _kinds(a, names), _kinds(b, names)
    causes = []
    heads = ({"num_heads"}, {"num_kv_groups"})
    if any(x <= names_a and y <= names_b for x, y in (heads, heads[::-1])):
        causes.append("if these are the query heads and the key/value heads: the key/value heads were not repeated "
                      "to the query heads' count (repeat_interleave(num_heads // num_kv_groups, dim=<the heads "
                      "axis>)), or one projection was built for the other count")
    if ("heads" in kinds_a and "tokens" in kinds_b) or ("tokens" in kinds_a and "heads" in kinds_b):
        causes.append("if a size or a table was taken from the wrong axis: after the split into heads the layout is "
                      "(b, num_heads, num_tokens, head_dim), so x.shape[1] is num_heads there and num_tokens before; "
                      "or a transpose(1, 2) is missing or extra (a tensor kept token-major where head-major is meant)")
    if ("tokens" in kinds_a and "features" in kinds_b) or ("features" in kinds_a and "tokens" in kinds_b):
        causes.append("if an operand was transposed on the wrong axes: .T (or .t(), .mT on the wrong tensor) on a "
                      "batched tensor reverses or swaps other axes than the last two; use .transpose(-2, -1)")
    if ("batch" in kinds_a) != ("batch" in kinds_b) and ("batch" in kinds_a | kinds_b):
        causes.append("if a size was read from the batch axis (shape[0]) where another axis was meant, or the batch "
                      "axis was moved by a transpose or a view")
    lengths = ("num_tokens", "num_keys", "cached tokens")
    if any(n.startswith(lengths) for n in names_a) and any(n.startswith(lengths) for n in names_b):
        causes.append("if one tensor is sized for the new tokens and the other for every key (cached and new): a "
                      "mask, a table of positions or a cache cut to the wrong length, or a cache joined on another "
                      "axis than the token axis")
    return tuple(causes)


CAT = r"Sizes of tensors must match except in dimension (\d+)\. Expected size (\d+) but got size (\d+)"


INDEX = r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)"
INDEX_SELF = r"IndexError: index out of range in self"
DIMENSION = r"Dimension out of range \(expected to be in range of \[(-?\d+), (\d+)\], but got (-?\d+)\)"


def index_reading(text: str, names: dict[int, list[str]]) -> Finding | None:
    """An index out of range read against the case's named sizes: which axis, the index against that axis's size by
    its name. The evidence is where the index went wrong, not which step computed it: no cause is named (an index
    that happens to equal some other size is no evidence of which)."""
    if match := re.search(INDEX, text):
        index, dim, size = int(match[1]), int(match[2]), int(match[3])
        shows = (f"index {index} is out of range for dimension {dim} of a tensor, an axis of size "
                 f"{_named(size, names)}: its indices run from 0 to {size - 1}"
                 + (f" (or -{size} to -1)" if index < 0 else ""))
        return Finding(shows + ".", (), "indexing", "error")
    if re.search(INDEX_SELF, text):
        return Finding("an embedding or index_select looked up an index out of range of its table (negative, or not "
                       "below the table's number of rows): the indices given to it are not the table's.", (),
                       "indexing", "error")
    if match := re.search(DIMENSION, text):
        axes, got = int(match[2]) + 1, int(match[3])
        return Finding(f"an operation asked for dimension {got} of a tensor that has {axes} dimensions (valid: "
                       f"{-axes} to {axes - 1}): the tensor has fewer axes than the code expects there.", (),
                       "indexing", "error")
    return None


def size_reading(text: str, call) -> Finding | None:
    """torch's shape and index errors read against the sizes the failing case named (``named_sizes``)."""
    names = named_sizes(call) if call is not None else {}
    if found := index_reading(text, names):
        return found
    if not names:
        return None
    if match := re.search(BROADCAST, text):
        a, b, dim = int(match[1]), int(match[2]), int(match[3])
        shows = (f"torch could not combine a tensor whose dimension {dim} is {_named(a, names)} with one whose "
                 f"dimension {dim} is {_named(b, names)}.")
        return Finding(shows, _meeting_causes(a, b, names), "shapes", "error")
    if match := re.search(CAT, text):
        dim, a, b = int(match[1]), int(match[2]), int(match[3])
        causes = (f"if they were meant to be joined along the axis where one is {a} and the other {b}: torch.cat "
                  f"joins along dim={dim}, and every other axis must agree; join along the axis that differs (for a "
                  "cache, the token axis)",)
        return Finding(f"torch.cat along dimension {dim} got tensors that differ on another axis: "
                       f"{_named(a, names)} against {_named(b, names)}.", causes + _meeting_causes(a, b, names),
                       "shapes", "error")
    if match := re.search(MATMUL, text):
        m, inner, other, n = (int(g) for g in match.groups())
        return Finding(f"a product ({m}x{inner}) @ ({other}x{n}) whose inner sizes differ: {_named(inner, names)} met "
                       f"{_named(other, names)}.", _meeting_causes(inner, other, names), "shapes", "error")
    if match := re.search(VIEW, text):
        shape, size = [int(s) for s in match[1].split(",")], int(match[2])
        factors = _factors(size, names)
        shows = (f"a view or reshape to [{', '.join(_named(s, names) if s > 0 else str(s) for s in shape)}] of a "
                 f"tensor of {size} values" + (f" = {factors}" if factors else "") + ": the sizes asked for do not "
                 "multiply to that.")
        return Finding(shows, ("if a size in the view was taken from another tensor or axis than the one it "
                               "describes (x.shape[...] of the wrong axis, a global, the book's example)",),
                       "shapes", "error")
    if match := re.search(BATCHED_PRODUCT, text):
        a, b, c, d = (int(g) for g in match.groups())
        pairs = [(x, y) for x, y in ((a, c), (b, d)) if x != y]
        shows = (f"a batched product expected its second operand to start with [{_named(a, names)}, "
                 f"{_named(b, names)}] and got [{_named(c, names)}, {_named(d, names)}].")
        causes = tuple(dict.fromkeys(c for x, y in pairs for c in _meeting_causes(x, y, names)))
        return Finding(shows, causes, "shapes", "error")
    return None


def _factors(size: int, names: dict[int, list[str]]) -> str:
    """``size`` as a product of two to four named sizes (the first such, fewest factors first), in words."""
    values = sorted(v for v in names if 1 < v < size)
    for count in (2, 3, 4):
        for combo in combinations_with_replacement(values, count):
            if int(np.prod(combo)) == size:
                return " x ".join(_named(v, names) for v in combo)
    return ""


# ---------------------------------------------------------------- a mask of the wrong dtype

FLOAT_MASK = r"masked_fill_? only supports boolean masks, but got mask with dtype ([\w:]+)"


def mask_not_boolean(match, call):
    """masked_fill given a mask of numbers (a float buffer, a triu of ones without dtype=torch.bool): the error's own
    text says which dtype the mask had, so the reading needs nothing else."""
    dtype = DTYPE_NAMES.get(match[1], match[1])
    return (f"the mask given to masked_fill has dtype {dtype}, and masked_fill takes a boolean mask (True where a "
            "score is replaced): convert it with .bool() (a float buffer cut to the tokens: self.mask.bool()[:n, :n]) "
            "or build it boolean (torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), or a comparison such as "
            "j > i)")


NONE_FLOAT = r"argument '(\w+)' must be float, not NoneType"


def none_for_a_float(match, call):
    """A None passed where torch wants a number (SDPA's dropout_p = p if training else None): the text names it."""
    name = match[1]
    if name == "dropout_p":
        return ("dropout_p was None: it takes a float, 0.0 where nothing is dropped (dropout_p=self.dropout_p if "
                "self.training else 0.0)")
    return f"{name} was None: it takes a float"


HEAD_ROWS = (r"size mismatch for (heads\.\d+\.[\w.]+\.weight): copying a param with shape "
             r"torch\.Size\(\[(\d+), (\d+)\]\) from checkpoint, the shape in current model is "
             r"torch\.Size\(\[(\d+), (\d+)\]\)")


def heads_split_in_width(match, call):
    """A wrapper of heads (one module per head, each of d_out outputs) whose heads have d_out // num_heads rows:
    the width of one head of MultiHeadAttention. The shapes are the evidence; the sentence says them by name."""
    name, given, built = match[1], int(match[2]), int(match[4])
    d_out, h = call.init.get("d_out"), call.init.get("num_heads")
    if not (d_out and h and h > 1 and given == d_out and built == d_out // h and match[3] == match[5]):
        return None
    return Finding(f"{name} has shape ({built}, {match[5]}): a head of width d_out // num_heads = {d_out} // {h} = "
                   f"{built}, where each head of this wrapper "
                   f"has d_out = {d_out} outputs (the output is num_heads * d_out = {h * d_out} wide, the heads side "
                   "by side): your heads are as wide as one head of MultiHeadAttention.", (), "heads", "error")


ERROR_READINGS += [ErrorReading(HEAD_ROWS, heads_split_in_width),
                   ErrorReading(FLOAT_MASK, mask_not_boolean, needs_call=False, proven=True),
                   ErrorReading(NONE_FLOAT, none_for_a_float, needs_call=False, proven=True)]
