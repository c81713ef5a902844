"""Stage k01: a fused softmax kernel in Triton, one program per row, the row read in chunks.

Spec: softmax(x, block_size=None) with x (..., n_cols) returns torch.softmax(x, dim=-1), x's shape and dtype, by
softmax_kernel: one program per row, the row read in chunks of block_size lanes (a power of 2; None: n_cols rounded
up to a power of 2), the lanes past the row's end masked; the running max subtracted before exp. Any block_size gives
the same values. Rows of huge values (1e4) and rows far below 0 (-1e4) give no NaN.

Where no GPU is, the kernel runs in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors: the checks use small
sizes. Expected values: NumPy float64 softmax of the same float32 inputs. Tolerance: float32 against float64, a
handful of roundings per value (rtol 1e-5, atol 1e-6); the CUDA case in bfloat16: diagnosis.BFLOAT16.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, Finding, Said, Searched, assert_close
from diagnosis import kernels as K
from suite_plugin import speed
from suite_runtime.cases import normal

pytestmark = pytest.mark.fused_softmax
STAGE = "k01_fused_softmax"
FLOAT32 = dict(rtol=1e-5, atol=1e-6)


def softmax(x):
    """The expected values: float64 softmax over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def other_case(x):
    """A second case of other sizes with the same kind of values (for the search to tell mistakes apart): the rows
    reversed, three more columns, copied from the first ones (a huge value stays where it was)."""
    x = np.asarray(x, dtype=np.float32)
    return np.ascontiguousarray(np.concatenate([x, x[..., :3]], axis=-1)[::-1])


def unread_tail(actual, x, block):
    """A partial last chunk that was never read: the first full chunks of each row are softmax over them alone."""
    cut = K.columns_read(actual, x, block)
    if cut is None:
        return []
    return [Finding(f"each row's first {cut} values are the softmax of those {cut} columns alone, the full chunks "
                    f"of {block}: the last {np.shape(x)[-1] - cut} columns were never read, nor written",
                    ("the loops stop before the partial last chunk (n_cols // BLOCK_SIZE chunks): loop over "
                     "range(0, n_cols, BLOCK_SIZE) and mask the lanes past n_cols",), "masking", "probe")]


def rows_computed(stage, actual, x, block):
    """Fewer programs than rows: the first rows are right and every later one wrong, again when the rows come in
    the other order (a row's values do not decide whether it is computed: its place does). Runs the learner's kernel
    once more."""
    n = np.shape(x)[-1]

    def computed(out, values):
        right = np.isclose(np.asarray(out).reshape(-1, n), softmax(values).reshape(-1, n), **FLOAT32).all(axis=-1)
        first = int(np.argmin(right)) if not right.all() else len(right)
        return None if first == 0 or first == len(right) or right[first:].any() else first

    first = computed(actual, x)
    flipped = np.ascontiguousarray(np.asarray(x, np.float32).reshape(-1, n)[::-1])
    if first is None or computed(stage.softmax(flipped, block_size=block), flipped) != first:
        return []
    rows = flipped.shape[0]
    # (the rows computed are decided by their place alone, the same first rows in both orders: what a grid of fewer
    # programs than rows gives, and it is said as what the rows show)
    return [Finding(f"the first {first} of the {rows} rows are right and none after them, in either order of the rows: "
                    f"only the first {first} rows were computed, by their place (fewer programs than rows did the "
                    "work; one program per row, grid = (n_rows,), each reading tl.program_id(0) as its row).", (),
                    "grid", "probe")]


def chunk(x, block):
    """The chunk length the kernel uses: block_size, or (None) the row's length rounded up to a power of 2, <= 1024."""
    return block or min(1024, 1 << (np.shape(x)[-1] - 1).bit_length())


def evidence(stage, x, block):
    """What a failed check is diagnosed with: the chunked softmax's switches, searched on this case and told apart
    on another; the columns the learner's kernel read."""
    def second():
        x2 = other_case(x)
        return stage.softmax(x2, block_size=block), lambda c: K.chunked_softmax(x2, chunk(x2, block), c)

    return [Searched(lambda c: K.chunked_softmax(x, chunk(x, block), c), K.CHUNKED_SOFTMAX, "your softmax", second),
            Said(lambda actual: unread_tail(actual, x, chunk(x, block)) + rows_computed(stage, actual, x, block))]


def check(stage, x, block, what, stored=None):
    """softmax(x, block_size=block) against the float64 softmax (or the values stored for the public example)."""
    out = stage.softmax(x, block_size=block)
    assert_close(f"softmax({what}, block_size={block})", out, softmax(x) if stored is None else stored, **FLOAT32,
                 diagnosis=evidence(stage, x, block))


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_small_example(stage, public_fx):
    """4 rows of 37 values in chunks of 16: two full chunks and a partial one of 5."""
    check(stage, public_fx.x, int(public_fx.block_size), "x (4, 37)", stored=public_fx.softmax)


@pytest.mark.public
def test_one_chunk_per_row(stage, public_fx):
    """block_size=None: the row in one chunk of 64 lanes, 27 of them masked."""
    check(stage, public_fx.x, None, "x (4, 37)")


# ---------------------------------------------------------------- hidden

CASES = {  # name: what it exercises (arrays in the hidden fixture)
    "long_rows": "rows of 70 in chunks of 16: four full chunks and a tail of 6",
    "short_rows": "rows of 5 in one chunk of 32: 27 masked lanes",
    "leading_axes": "x (2, 3, 21) in chunks of 8: every leading axis is rows",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_other_shapes(stage, hidden_fx, case):
    check(stage, hidden_fx[f"{case}/x"], int(hidden_fx[f"{case}/block_size"]), f"{case}: {CASES[case]}")


def test_huge_values(stage, hidden_fx):
    """Rows whose values reach 1e4, the largest in the first chunk: exp(x) overflows to inf unless the row's max,
    carried over every chunk, is subtracted first."""
    check(stage, hidden_fx["huge/x"], int(hidden_fx["huge/block_size"]), "values up to 1e4")


def test_rows_far_below_zero(stage, hidden_fx):
    """Rows of values between -1e4 and -9e3: a max that starts at 0 (or takes 0 from a masked lane) underflows every
    exp(x - max) to 0, and 0 / 0 is NaN."""
    check(stage, hidden_fx["negative/x"], int(hidden_fx["negative/block_size"]), "values around -1e4")


def test_random_cases(stage, rng):
    for _ in range(2):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 60)))
        block = int(rng.choice([4, 8, 16, 32]))
        x = normal(rng, *shape, scale=float(rng.choice([1.0, 30.0, 3000.0])))
        check(stage, x, block, f"x {shape}")


SIZES = {  # the CPU twin small (the interpreter); the CUDA case a language model's logits: Llama 2's vocabulary
    "cpu": dict(rows=6, cols=300, block=64, dtypes=("float32", "bfloat16")),
    "cuda": dict(rows=4096, cols=32000, block=None, dtypes=("float32", "bfloat16")),
    "dry run": dict(rows=8, cols=500, block=None, dtypes=("float32", "bfloat16")),
}


def test_vocabulary_sized_rows(stage, target):
    """Softmax over a vocabulary's logits (rows of 32000 on CUDA), in float32 and bfloat16 (read and written as
    such), compared with torch.softmax in float32 on the same rounded inputs, on the device."""
    import torch

    size = SIZES[target.size]
    rng = np.random.default_rng(32000)
    x = normal(rng, size["rows"], size["cols"], scale=4.0)
    for dtype in size["dtypes"]:
        [out] = stage.session(None, steps=[{"function": "softmax", "args": [x],
                                            "kwargs": {"block_size": size["block"]}}],
                              device=target.device, dtype=dtype)
        rounded = torch.from_numpy(x).to(device=target.device, dtype=getattr(torch, dtype)).float()
        expected = torch.softmax(rounded, dim=-1).cpu().numpy()
        assert_close(f"softmax ({target.device}, {dtype}, {size['rows']} x {size['cols']})", out, expected,
                     **(BFLOAT16 if dtype == "bfloat16" else FLOAT32),
                     diagnosis=() if target.cuda or dtype != "float32" else evidence(stage, x, size["block"]))


# ---------------------------------------------------------------- speed (a GPU only)

@pytest.mark.speed
@pytest.mark.parametrize("fraction", speed.FRACTIONS, ids=speed.ids)
def test_speed(stage, impl, request, fraction):
    """4096 rows of 32000 logits in bfloat16 on a GPU: your kernel's throughput against the reference kernel's
    (torch.softmax's shown beside them)."""
    import torch

    speed.require(impl, request.config)
    x = normal(np.random.default_rng(7), 4096, 32000, scale=4.0)
    speed.check(stage, fraction, STAGE, "softmax", [x],
                others={"torch.softmax": lambda t: torch.softmax(t, dim=-1)}, what="bfloat16, 4096 rows of 32000")
