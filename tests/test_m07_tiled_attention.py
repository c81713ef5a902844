"""Stage m07: tiled attention with an online softmax (FlashAttention's algorithm in plain PyTorch).

Spec: tiled_attention(q, k, v, is_causal=False, block_size=64) with q (b, h, n_q, d), k and v
(b, h, n_kv, d) returns softmax(q k^T / sqrt(d)) v, (b, h, n_q, d), in q's dtype. With is_causal query i
attends to keys j <= i (top-left aligned, as F.scaled_dot_product_attention(is_causal=True)). It works
over tiles of block_size queries x block_size keys with a running max, a running sum and a rescaled
accumulator, and never materialises an n_q x n_kv matrix nor calls F.scaled_dot_product_attention.
Its output has no NaN where standard attention has none (a row whose scores are all masked so far, in a tile
visited before any key it sees, must not give NaN), and it stays finite for scores in the thousands (every exp taken
relative to the running max). Expected values come from standard attention in NumPy float64 (the public example's:
from the reference, stored in its fixture).
"""
import numpy as np
import pytest

from diagnosis import (
    BATCHED_PRODUCT,
    BFLOAT16,
    BROADCAST,
    About,
    ErrorReading,
    Finding,
    assert_close,
    broadcast_sizes,
    readings_with,
)
from diagnosis.subjects import Deferred
from diagnosis.tiles import TiledFunction, standard
from suite_runtime.cases import distinct_sizes, normal

pytestmark = pytest.mark.tiled_attention
STAGE = "m07_tiled_attention"
FUNCTION = "tiled_attention"

# float32 against float64: a few float32 roundings per output value, summed over at most a few hundred keys.
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
# Scores of size 1e3..1e4 carry float32 rounding of ~1e-3 in absolute terms; the weights of two keys whose
# scores are that close move by as much, so outputs may differ from float64 by ~1e-3 (a softmax that
# overflows gives NaN, one that forgot a rescaling is off by O(1): both far outside).
LARGE_LOGITS = dict(rtol=1e-3, atol=3e-3)

# When graded, this stage's process may allocate this much beyond what it held when the stage started: the
# sandbox has the kernel enforce it (RLIMIT_AS), so what the learner's code allocates cannot be hidden
# from it. At 8192 tokens (test_never_holds_the_score_matrix) one float32 score matrix is
# 256 MiB; tiles of 256 x 256 scores, q, k, v and the output need about 1 MiB.
MEMORY_HEADROOM = 128 * 2**20


def diagnosis(stage, q, k, v, is_causal, block_size):
    """What a failed check of tiled_attention is diagnosed with (diagnosis.tiles)."""
    def run(q, k, v, is_causal, block_size):
        return stage.tiled_attention(q, k, v, is_causal=is_causal, block_size=block_size)
    return TiledFunction(run).evidence(q, k, v, is_causal, block_size)


def check_against_attention(stage, q, k, v, is_causal, block_size, what, tolerance=FLOAT32):
    out = stage.tiled_attention(q, k, v, is_causal=is_causal, block_size=block_size)
    assert_close(f"tiled_attention({what}, is_causal={is_causal}, block_size={block_size})", out,
                 standard(q, k, v, is_causal), **tolerance, diagnosis=diagnosis(stage, q, k, v, is_causal, block_size))


def tile_sizes(n_q, n_kv, block_size):
    """Every tile length a tiling of n_q queries and n_kv keys can have: query tiles, and key tiles up to n_kv or,
    with is_causal, up to the end of a query tile."""
    ends = {n_kv} | {min(n_kv, q_end) for q_end in range(block_size, n_q + block_size, block_size)}
    return ({min(block_size, n_q - s) for s in range(0, n_q, block_size)}
            | {min(block_size, end - s) for end in ends for s in range(0, end, block_size)})


def full_tile(sizes, call):
    """Something of a full tile's size (block_size) meeting a shorter tile, both ``sizes`` of the error being those of
    a tiled_attention call the check made. Facts only: a mask, a buffer or a slice bound sized by block_size all give
    these numbers, so no cause is said; that per-tile tensors follow the tile is said as the rule."""
    for args, kwargs in call.function_calls(FUNCTION):
        if len(args) < 2 or len(np.shape(args[0])) < 2 or len(np.shape(args[1])) < 2:
            continue
        block_size = int(kwargs.get("block_size", 64))
        n_q, n_kv = np.shape(args[0])[-2], np.shape(args[1])[-2]
        for size in tile_sizes(n_q, n_kv, block_size) - {block_size}:
            if sizes == {block_size, size}:
                return Finding(f"two tensors that could not be combined hold block_size = {block_size} and "
                               f"{size}: {size} is the length of one of this call's shorter tiles (n_q = {n_q} "
                               f"queries and n_kv = {n_kv} keys in tiles of {block_size}): something sized for a full "
                               "tile met a shorter one. Every per-tile tensor takes its sizes from the tile itself "
                               "(q_end - q_start rows, k_end - k_start columns), e.g. a causal mask from the tile's "
                               "own positions.", (), "tiling", "error")
    return None


ERROR_READINGS = [  # (conftest reads a stage's readings here)
    *readings_with(BROADCAST, lambda match, call: full_tile(broadcast_sizes(match)[0], call)),
    # a product of a (bq, block_size) tile of weights with a shorter tile of values: its inner sizes
    ErrorReading(BATCHED_PRODUCT, lambda match, call: full_tile({int(match[2]), int(match[4])}, call)),
]


def measured(stage, q, k, v, device="cpu", dtype="float32", peak_memory=False, **kwargs):
    """tiled_attention run under the adapters' watch: {"result", "largest", "functions", "peak_bytes"} (the
    bytes it held at once on ``device`` beyond its inputs, read when peak_memory is true; else None)."""
    step = {"function": FUNCTION, "args": [q, k, v], "kwargs": kwargs, "measure": True, "peak_memory": peak_memory}
    [run] = stage.session(None, steps=[step], device=device, dtype=dtype)
    return run


def check_memory(run, q_shape, n_kv, block_size):
    """No n_q x n_kv matrix, no fused kernel. The bound: a tiled computation holds tensors the size of q, k,
    v or the output (b*h*n*d) and tiles of b*h*block_size*block_size scores; twice the larger of the two
    leaves room for a copy or a concatenation of those. An n_q x n_kv score matrix is b*h*n_q*n_kv, a strip
    of block_size queries x all keys b*h*block_size*n_kv: at the sizes used here both are far above it."""
    b, h, n_q, d = q_shape
    assert "scaled_dot_product_attention" not in run["functions"], (
        "tiled_attention called F.scaled_dot_product_attention: this stage computes the attention itself, "
        "tile by tile (the fused kernel is what it explains)"
    )
    bound = 2 * max(b * h * max(n_q, n_kv) * d, b * h * block_size * block_size)
    largest = run["largest"]
    if largest <= bound:
        return
    why = (f"tiled_attention created a tensor of {largest} elements; tiles of {block_size} queries x {block_size} "
           f"keys need at most {bound} (twice the larger of q, k, v or the output, b*h*n*d, and one tile of "
           f"scores, b*h*block_size^2). ")
    if largest >= b * h * n_q * n_kv:
        why += (f"Likely mistake: the full score matrix was materialised ({b}*{h}*{n_q}*{n_kv} = {b * h * n_q * n_kv} "
                "elements): score one tile of keys at a time and fold it into the running max, sum and accumulator")
    elif largest >= n_q * n_kv:
        why += "Likely mistake: an n_q x n_kv matrix (a mask for every query and key?): build masks per tile"
    elif largest >= b * h * block_size * n_kv:
        why += "Likely mistake: a block of queries was scored against all keys at once: tile the keys too"
    raise AssertionError(why)


def qkv(rng, b, h, n_q, n_kv, d):
    return normal(rng, b, h, n_q, d), normal(rng, b, h, n_kv, d), normal(rng, b, h, n_kv, d)


# ---------------------------------------------------------------- public

@pytest.mark.public
@pytest.mark.parametrize("is_causal", [False, True])
def test_small_example(stage, public_fx, is_causal):
    """10 tokens, 2 heads of size 4, tiles of 3: the last tile is smaller, and with is_causal the tiles
    above the diagonal add nothing (skip them)."""
    q, k, v, block_size = public_fx.q, public_fx.k, public_fx.v, int(public_fx.block_size)
    out = stage.tiled_attention(q, k, v, is_causal=is_causal, block_size=block_size)
    assert_close(f"tiled_attention(q, k, v, is_causal={is_causal}, block_size={block_size})", out,
                 public_fx["output_causal" if is_causal else "output"], **FLOAT32,
                 diagnosis=diagnosis(stage, q, k, v, is_causal, block_size))


@pytest.mark.public
def test_small_example_never_holds_the_score_matrix(stage, public_fx):
    """256 tokens in tiles of 32: the largest tensor stays far below the 2 x 256 x 256 scores."""
    q, k, v = public_fx["long/q"], public_fx["long/k"], public_fx["long/v"]
    block_size = int(public_fx["long/block_size"])
    check_memory(measured(stage, q, k, v, block_size=block_size), q.shape, k.shape[-2], block_size)


# ---------------------------------------------------------------- hidden

SHAPES = {  # name: what it exercises (the arrays are in the hidden fixture)
    "ragged": "37 tokens in tiles of 8: the last tile is partial",
    "fewer_queries": "5 queries, 37 keys: with is_causal most key tiles are above the diagonal",
    "more_queries": "37 queries, 5 keys: with is_causal queries 5.. see every key",
    "block_one": "tiles of a single query and key",
    "block_beyond": "a tile larger than the sequence",
}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_equals_standard_attention(stage, hidden_fx, case, is_causal):
    q, k, v = hidden_fx[f"{case}/q"], hidden_fx[f"{case}/k"], hidden_fx[f"{case}/v"]
    check_against_attention(stage, q, k, v, is_causal, int(hidden_fx[f"{case}/block_size"]),
                            f"{case}: {SHAPES[case]}; q {q.shape}, k {k.shape}")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("case", ["large_1e3", "large_1e4"])
def test_very_large_logits(stage, hidden_fx, case, is_causal):
    """q scaled by 1e3 or 1e4: scores in the thousands, whose exp overflows unless each is taken relative to
    the running max; the keys with the largest scores come first, so later tiles have much smaller maxima."""
    q, k, v = hidden_fx[f"{case}/q"], hidden_fx[f"{case}/k"], hidden_fx[f"{case}/v"]
    check_against_attention(stage, q, k, v, is_causal, int(hidden_fx[f"{case}/block_size"]),
                            f"q scaled by {case.split('_')[1]}", tolerance=LARGE_LOGITS)


def test_fully_masked_tiles_give_no_nan(stage, rng):
    """Causal, 6 queries and 41 keys in tiles of 4: of the 11 key tiles, 10 lie wholly above the diagonal for
    queries 0-3 and 9 for queries 4-5 (skipped or masked, they must add nothing), and inside the diagonal
    tiles the rows see 1 to 4 keys. No NaN, the right values."""
    q, k, v = qkv(rng, 2, 3, 6, 41, 8)
    check_against_attention(stage, q, k, v, True, 4, "6 queries, 41 keys")


def test_random_cases(stage, rng):
    for _ in range(3):
        sizes = distinct_sizes(rng, dict(b=(1, 3), h=(1, 4), d=(2, 9), n_q=(2, 40), n_kv=(2, 40), block_size=(1, 20)))
        b, h, d, n_q, n_kv, block_size = (sizes[k] for k in ("b", "h", "d", "n_q", "n_kv", "block_size"))
        q, k, v = qkv(rng, b, h, n_q, n_kv, d)
        is_causal = bool(rng.integers(2))
        check_against_attention(stage, q, k, v, is_causal, block_size, f"q {q.shape}, k {k.shape}")


@pytest.mark.parametrize("is_causal", [False, True])
def test_never_holds_the_score_matrix(stage, rng, is_causal):
    """8192 tokens, one head of 8, tiles of 256: one float32 score matrix is 256 MiB, the tiles need about 1 MiB.
    When graded, an allocation beyond MEMORY_HEADROOM fails (the kernel refuses it), so the full matrix cannot
    be computed however it is hidden; the adapters' watch (check_memory) says what was built. Rows spread
    over the sequence are compared with standard attention."""
    from suite_runtime.adapters import SubmissionError

    n, block_size, rows = 8192, 256, [0, 1, 2047, 4096, 8191]
    q, k, v = qkv(rng, 1, 1, n, n, 8)
    try:
        run = measured(stage, q, k, v, is_causal=is_causal, block_size=block_size)
    except SubmissionError as exc:
        if "out of memory" not in str(exc) and "can't allocate" not in str(exc):
            raise
        raise AssertionError(
            f"tiled_attention ran out of memory at {n} tokens: {exc}\nLikely mistake: the full score matrix was "
            f"materialised (1 x 1 x {n} x {n} float32 = 256 MiB): score one tile of keys at a time and fold it "
            "into the running max, sum and accumulator") from None
    out = run["result"]
    assert np.shape(out) == q.shape, f"tiled_attention returned shape {np.shape(out)}, expected {q.shape}"
    expected = np.concatenate([standard(q[..., i:i + 1, :], k[..., :i + 1, :] if is_causal else k,
                                        v[..., :i + 1, :] if is_causal else v, False) for i in rows], axis=-2)
    # (the evidence: the learner's output on the first 64 tokens in tiles of 16, where the search and the probes run
    # quickly, worked out only if this check fails)
    small = tuple(a[..., :64, :] for a in (q, k, v))
    evidence = Deferred(lambda: [About(stage.tiled_attention(*small, is_causal=is_causal, block_size=16),
                                       diagnosis(stage, *small, is_causal, 16), **FLOAT32)])
    assert_close(f"rows {rows} of tiled_attention at {n} tokens (is_causal={is_causal})", out[..., rows, :],
                 expected, **FLOAT32, diagnosis=[evidence])
    check_memory(run, q.shape, n, block_size)


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs a Llama layer's attention: 32 heads of 128
    "cpu": dict(b=1, h=4, t=256, d=32, dtype="float32"),
    "cuda": dict(b=1, h=32, t=4096, d=128, dtype="bfloat16"),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, h=4, t=512, d=16, dtype="bfloat16"),
}


def peak_bound(b, h, t, d, itemsize):
    """The most memory the CUDA case lets tiled_attention hold beyond its inputs: four times the bytes of q, k,
    v and the output together (512 MiB at the CUDA size). That leaves room for float32 copies of all four beside
    the output (half the bound) and tiles of scores, not for one score matrix, b*h*t*t*itemsize, which is
    larger whenever t > 16 d (1 GiB at the CUDA size, 2 MiB at the dry run's)."""
    return 4 * 4 * b * h * t * d * itemsize


def test_llama_sized_heads(stage, target):
    """Causal attention compared with F.scaled_dot_product_attention (float32, on the same rounded inputs); the
    CUDA case also bounds the memory tiled_attention holds at once (its peak on the device, read by the adapters)."""
    import torch
    import torch.nn.functional as F

    size, device = SIZES[target.size], target.device
    rng = np.random.default_rng(4096)
    q, k, v = qkv(rng, size["b"], size["h"], size["t"], size["t"], size["d"])
    run = measured(stage, q, k, v, device=device, dtype=size["dtype"], peak_memory=target.cuda, is_causal=True,
                   block_size=64)
    dtype = getattr(torch, size["dtype"])
    rounded = [torch.from_numpy(a).to(device=device, dtype=dtype).float() for a in (q, k, v)]
    expected = F.scaled_dot_product_attention(*rounded, is_causal=True).cpu().numpy()
    assert_close(f"tiled_attention ({device}, {size['dtype']}, T={size['t']}, {size['h']} heads)", run["result"],
                 expected, **(BFLOAT16 if size["dtype"] == "bfloat16" else FLOAT32),
                 # (the evidence is computed in NumPy: on the CPU twin only)
                 diagnosis=[] if target.cuda else diagnosis(stage, q, k, v, True, 64))
    if target.cuda:
        b, h, t, d, itemsize = size["b"], size["h"], size["t"], size["d"], dtype.itemsize
        bound, matrix = peak_bound(b, h, t, d, itemsize), b * h * t * t * itemsize
        assert run["peak_bytes"] <= bound, (
            f"tiled_attention held up to {mib(run['peak_bytes'])} on {device} beyond its inputs, expected at most "
            f"{mib(bound)} (four times q, k, v and the output; one {size['dtype']} score matrix alone is "
            f"{mib(matrix)}): the full score matrix was materialised"
        )


def mib(n):
    return f"{n / 2**20:.1f} MiB"
