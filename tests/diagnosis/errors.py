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
#
# A shape error shows where two sizes met, never which step made them so: many steps give the same numbers (a query
# split into num_kv_groups heads gives the sizes of a view by x's width where num_kv_groups * head_dim = d_in). Its
# readings state the facts, which named sizes met in which operation at which dimension, and name no cause: nothing
# was run on the learner's code that reproduced one. A cause is said only where the error's own text is the cause (a
# view of a tensor that is not contiguous, a float mask given to masked_fill).

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

    def arrays(self) -> list[tuple[np.ndarray, int | str]]:
        """(array, where it was given) of each array the operation gave the learner's code directly: a function's
        positional arguments (their index), its keyword arguments (their name), a module's input ("x")."""
        if self.op == "call":
            return ([(v, i) for i, v in enumerate(self.kwargs.get("args") or ()) if isinstance(v, np.ndarray)]
                    + [(v, k) for k, v in (self.kwargs.get("kwargs") or {}).items() if isinstance(v, np.ndarray)])
        x = self.kwargs.get("x")
        return [(x, "x")] if isinstance(x, np.ndarray) else []

    def given(self):
        """Every array and whole number the operation gave the learner's code, however deep in its arguments."""
        def visit(value):
            if isinstance(value, dict):
                for v in value.values():
                    yield from visit(v)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    yield from visit(v)
            elif isinstance(value, np.ndarray):
                yield value
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                yield value

        yield from visit(self.kwargs)

    def sizes(self) -> set:
        """Every size the test chose: the dimensions of every array it passed and every whole-number argument."""
        return {int(s) for v in self.given() for s in (v.shape if isinstance(v, np.ndarray) else (v,))}

    def whole_dtypes(self) -> set:
        """The dtype (by name: bool, int64, ...) of every array of integers or booleans the operation gave (the
        adapters put the floating ones in the check's dtype: no dtype of theirs reaches the learner's code)."""
        return {str(v.dtype) for v in self.given() if isinstance(v, np.ndarray) and v.dtype.kind in "biu"}


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


def shifted_axis(match, call):
    """Two sizes that could not be broadcast, at dimension k, that are the sizes of axes k and k - 1 of an input the
    check gave: one operand holds the input's axis k - 1 one place to the right of where the input has it. That is
    what the sizes show (torch lines shapes up from the right, so an axis missing on the left of a tensor moves the
    others one place to the right); which step did it (a reduction without keepdim=True, two axes swapped, ...) is
    not in the error, and none is said."""
    a, b, dim = int(match[1]), int(match[2]), int(match[3])
    for value, where in call.arrays():
        shape, label = tuple(int(s) for s in value.shape), f"argument {where + 1}" if isinstance(where, int) else where
        if not 1 <= dim < len(shape) or shape[dim] == shape[dim - 1] or {a, b} != {shape[dim], shape[dim - 1]}:
            continue
        own, moved = shape[dim], shape[dim - 1]
        # (a size named only as an axis of this input is said as a number: the sentence names the axis already)
        names = {size: [n for n in found if not n.startswith("axis ")] for size, found in named_sizes(call).items()}
        shows = (f"torch could not combine two tensors at dimension {dim}: one holds there {_named(own, names)}, the "
                 f"size of axis {dim} of {label} (shape {shape}); the other holds {_named(moved, names)}, the size of "
                 f"its axis {dim - 1}: one place to the right of where {label} has it.")
        return Finding(shows, (), "shapes", "error")
    return None


def mask_not_cut(match, call):
    """Chapter 3's modules, whose queries and keys are x's num_tokens: two sizes that could not be broadcast, one
    x's num_tokens and the other the constructor's context_length, or 6 where no size of this check is 6 (the
    number of tokens of the book's example). Facts only: which tensor was sized so (a mask, a table of positions,
    another buffer) is not in the error."""
    sizes, dim = broadcast_sizes(match)
    length = call.init.get("context_length")
    for _, num_tokens, num_keys in call.forwards():
        if num_keys != num_tokens:
            continue
        if length and length > num_tokens and sizes == {num_tokens, length}:
            return Finding(f"torch could not combine two tensors at dimension {dim}: one is {length} long there, "
                           f"context_length = {length} (an argument of the constructor), the other {num_tokens}, "
                           f"x's num_tokens (x holds {num_tokens} tokens): a tensor sized by context_length met one "
                           "sized by the sequence.", (), "masking", "error")
        if sizes == {num_tokens, BOOK_LENGTH} and BOOK_LENGTH not in call.sizes():
            return Finding(f"torch could not combine two tensors at dimension {dim}: one is {BOOK_LENGTH} long "
                           f"there, the other {num_tokens}, x's num_tokens (x holds {num_tokens} tokens); no size "
                           f"of this check is {BOOK_LENGTH} ({BOOK_LENGTH} is the number of tokens in the book's "
                           "example): something in the forward has a length that follows neither x nor the "
                           "constructor's arguments.", (), "masking", "error")
    return None


def view_sizes(match, call):
    """A view/reshape to sizes that do not fit, read against the forward that raised: the tensor's values as
    (b, num_tokens, values per token) of a forward the check ran, and what the view asks for in their place, every
    size by its names. Facts only: which step gave the tensor or the view those sizes is not in the error (a size
    read from another axis, a global, another count of heads: each gives the same numbers), so no cause is said."""
    shape, size = [int(s) for s in match[1].split(",")], int(match[2])
    if len(shape) < 3 or min(shape) < 1:
        return None
    names = named_sizes(call)
    asked = int(np.prod(shape[2:]))
    runs = sorted(call.forwards(), key=lambda run: list(run[:2]) != shape[:2])  # (a forward the view's lead fits first)
    for b, num_tokens, _ in runs:
        if size % (b * num_tokens):
            continue
        held = size // (b * num_tokens)
        if shape[:2] != [b, num_tokens] and held not in names:
            continue
        shows = (f"a view or reshape to {tuple(shape)} of a tensor of {size} values = b x num_tokens x {held} "
                 f"({b} x {num_tokens} x {held}; {held} = {_width(held, names, call)}): ")
        if shape[:2] == [b, num_tokens]:
            shows += (f"the view keeps x's (b, num_tokens) = ({b}, {num_tokens}) first and asks for "
                      f"{_per_token(shape[2:], names)} = {asked} values per token{_also(asked, names, call)}, where "
                      f"the tensor holds {held}." + _by_name(asked, held, names))
        else:
            wrong = [f"its {place} size is {got} where x's {what} is {want}"
                     for place, got, what, want in (("first", shape[0], "batch size b", b),
                                                    ("second", shape[1], "num_tokens", num_tokens)) if got != want]
            shows += ("; ".join(wrong) + (f", and it asks for {asked} values per token{_also(asked, names, call)} "
                                          f"where the tensor holds {held}" if asked != held else "") + ".")
        return Finding(shows, (), "shapes", "error")
    return None


def _width(size: int, names: dict[int, list[str]], call) -> str:
    """A per-token width by its names (features and heads first), and d_out as num_heads x head_dim."""
    found = [n for n in names.get(int(size), ()) if not n.startswith((*TOKEN_NAMES, "axis "))]
    words = " = ".join(found) if found else "no size of this check"
    d_out, h = call.init.get("d_out"), call.init.get("num_heads")
    if d_out and h and size == d_out and d_out % h == 0 and "num_heads * head_dim" not in found:
        words += f" = num_heads x head_dim ({h} x {d_out // h})"
    return words


def _by_name(asked: int, held: int, names: dict[int, list[str]]) -> str:
    """" Per token: the view asks for d_in, the tensor holds d_out.": the two widths by their names, where both have
    names (a width only a count of tokens or the batch shares is said as a number above)."""
    def width(size):
        return " = ".join(n for n in names.get(int(size), ()) if not n.startswith((*TOKEN_NAMES, "axis ")))
    if asked == held or not (width(asked) and width(held)):
        return ""
    return f" Per token: the view asks for {width(asked)}, the tensor holds {width(held)}."


def _also(size: int, names: dict[int, list[str]], call) -> str:
    """" (6 = d_in = num_kv_groups * head_dim)": every name of a per-token count, where it has one."""
    words = _width(size, names, call)
    return "" if words.startswith("no size") else f" ({size} = {words})"


def _per_token(sizes, names) -> str:
    """The view's sizes after (b, num_tokens), each by its names: "num_kv_groups (2) x head_dim (3)"; a count of
    tokens or the batch only where a size has no other name (the view has put b and num_tokens first already)."""
    def widths(found):
        return [n for n in found if n not in TOKEN_NAMES and not n.startswith(TOKEN_NAMES)] or found
    return " x ".join(_named(s, {v: widths(found) for v, found in names.items()}) for s in sizes)


# The names a forward gives its counts of tokens and its batch (``named_sizes``).
TOKEN_NAMES = ("the batch size b", "b * num_tokens", "num_tokens", "num_keys", "cached tokens")


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
    Facts only: the second operand transposed would fit (a weight's layout, output width x input width), a width
    that is no size of this check at all, a layer made for the context's width that got x's. Which step made the
    sizes so is not in the error, and no cause is said."""
    m, inner, other, n = (int(g) for g in match.groups())
    d_in = call.init.get("d_in")
    names = named_sizes(call)
    shows = (f"a product ({m}x{inner}) @ ({other}x{n}) whose inner sizes differ: a tensor of width "
             f"{_named(inner, names)} met a matrix made for width {_named(other, names)} (if that matrix is a "
             f"layer's weight: a layer nn.Linear({other}, {n}), made for width {other}, got a tensor of width "
             f"{inner}).")
    # (the second operand transposed would fit, and it is shaped (an output width, the input's width) as a weight is)
    as_a_weight = n == inner and any(name in OUTPUT_WIDTHS for name in names.get(other, ()))
    if as_a_weight:
        shows += f" The second matrix transposed, ({n}x{other}), would fit."
    elif bool(d_in) and inner == d_in and other not in names:
        shows += f" No size of this check is {other}."
    widths = input_widths(call)
    if widths.get("x") == {inner} and widths.get("context") == {other}:
        shows += (f" This check gave x of width {inner} and a context of width {other}: the matrix made for the "
                  "context's width got a tensor as wide as x.")
    return Finding(shows, (), "shapes", "error")


def parameter_sizes(match, call):
    """A layer whose input width (the last size of a weight) is not the documented one: what the sizes are, by the
    names the constructor's arguments give them. Which step made the layer so is not in the error (a global, the
    book's example, the width of another tensor of the module: each gives these sizes), and none is said."""
    name = match[1]
    given, built = ([int(s) for s in re.findall(r"\d+", group)] for group in (match[2], match[3]))
    d_in = call.init.get("d_in")
    if not (d_in and len(given) == len(built) == 2 and given[-1] == d_in != built[-1] and given != built[::-1]):
        return None
    names = named_sizes(call)
    what = _named(built[-1], names)
    return Finding(f"{name} has shape {tuple(built)} where the documented one is {tuple(given)}: it takes inputs of "
                   f"width {what}, not d_in = {d_in}.", (), "shapes", "error")


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
    """Two tensors of different dtypes met in an operation, in a check that ran the learner's code with every
    parameter and input in one of them: the other was made or converted inside the code. Which tensor, and whether
    by torch.tensor/ones/zeros without dtype=, an arange or a .float(), is not in the error, so none is said; the rule
    that avoids all of them is."""
    found = [DTYPE_NAMES[g] for g in match.groups() if g in DTYPE_NAMES]
    if len(set(found)) < 2:
        return None
    ran = (call.kwargs.get("dtype") or "float32") if call.op in ("forward", "session") else None
    if ran not in found:
        return None
    other = next(d for d in found if d != ran)
    if other in call.whole_dtypes():  # (the check gave a tensor of that dtype too: a mask, positions)
        return None
    return Finding(f"tensors of two dtypes met ({' and '.join(dict.fromkeys(found))}); this check ran your code with "
                   f"its parameters and floating-point inputs in {ran}, so the {other} tensor was made or converted "
                   "inside your code. Tensors made in a forward take dtype=x.dtype and device=x.device, and constant "
                   "ones kept as buffers follow module.to(dtype).", (), "dtypes", "error")


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
    ErrorReading(rf"expected m1 and m2 to have the same dtype, but got: {DTYPES} != {DTYPES}", dtypes_met),
    ErrorReading(rf"[Ee]xpected scalar type {DTYPES} but found {DTYPES}", dtypes_met),
    ErrorReading(rf"query\.dtype: {DTYPES},? key\.dtype: {DTYPES}", dtypes_met),
    ErrorReading(rf"result type {DTYPES} can't be cast to the desired output type {DTYPES}", dtypes_met),
    ErrorReading(rf"Input type \({DTYPES}\) and (?:bias|weight) type \({DTYPES}\) should be the same", dtypes_met),
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
# names a size. One reading serves every stage: it says which named sizes met where, in which operation, and nothing
# more: the sizes show where two tensors met, not which step made them so (heads not repeated, a table of positions
# read along the heads, a transpose of the wrong axes all give a num_heads meeting a num_tokens).

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
        return Finding(shows, (), "shapes", "error")
    if match := re.search(CAT, text):
        dim, a, b = int(match[1]), int(match[2]), int(match[3])
        return Finding(f"torch.cat joined tensors along dimension {dim}, where every other axis must agree, and on "
                       f"another axis one has {_named(a, names)} and another {_named(b, names)}.", (), "shapes",
                       "error")
    if match := re.search(MATMUL, text):
        m, inner, other, n = (int(g) for g in match.groups())
        return Finding(f"a product ({m}x{inner}) @ ({other}x{n}) whose inner sizes differ: {_named(inner, names)} met "
                       f"{_named(other, names)}.", (), "shapes", "error")
    if match := re.search(VIEW, text):
        shape, size = [int(s) for s in match[1].split(",")], int(match[2])
        factors = _factors(size, names)
        shows = (f"a view or reshape to [{', '.join(_named(s, names) if s > 0 else str(s) for s in shape)}] of a "
                 f"tensor of {size} values" + (f" = {factors}" if factors else "") + ": the sizes asked for do not "
                 "multiply to that.")
        return Finding(shows, (), "shapes", "error")
    if match := re.search(BATCHED_PRODUCT, text):
        a, b, c, d = (int(g) for g in match.groups())
        shows = (f"a batched product expected its second operand to start with [{_named(a, names)}, "
                 f"{_named(b, names)}] and got [{_named(c, names)}, {_named(d, names)}].")
        return Finding(shows, (), "shapes", "error")
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
