"""Stage m06: sliding-window attention with a bounded KV cache.

Spec: sliding_window_mask(num_tokens, window) -> bool (num_tokens, num_tokens), True where key j takes part
for query i: j <= i and i - j < window (window 1: each token sees itself only; window >= num_tokens: causal).
SlidingWindowAttention(d_in, d_out, context_length, num_heads, window, qkv_bias=False): multi-head attention
(W_query, W_key, W_value, out_proj; scale 1/sqrt(head_dim)) masked by that band; forward(x, use_cache=False)
with stage m03's cache API, whose cache_k / cache_v (b, num_heads, cached, head_dim) never hold more than
``window`` positions (the most recent ones), and whose steps equal the full windowed forward's tokens.
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, diagnose, linear, softmax, split_heads
from suite_runtime.cases import draw_weights, normal

pytestmark = pytest.mark.sliding_window
STAGE = "m06_sliding_window"
CLS = "SlidingWindowAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
OFF_BY_ONE = ("the window is off by one: i - j <= window lets window + 1 tokens take part; the query's own token "
              "counts, so key j takes part when j <= i and i - j < window")
SHORT = ("the window is off by one: the query's own token counts as one of the window's, so key j takes part "
         "when j <= i and i - j < window (yours holds window - 1 tokens)")
NOT_CAUSAL = "the band is not causal: keys after the query (j > i) take part; add j <= i"
NO_WINDOW = "the window was not applied: every earlier token takes part (plain causal attention)"
OLDEST = ("the cache kept the OLDEST window positions: keep the most recent ones, keys[:, :, -window:], since a "
          "new token can only reach the last window positions")
ROWS = ("the new queries took the band's first rows: in a cached step they are the last num_new of num_keys "
        "positions, rows num_cached .. num_cached + num_new - 1 of the band")
NO_KEY_NAN = " (a query left with no key got NaN)"


def cut_before(kept):
    return (f"the cache was cut to the last {kept} positions before the new queries attended, so some of them lost "
            "keys they must see (the query at position p attends to keys p - window + 1 .. p); attend over the cached "
            "and the new keys first, then keep the last window positions for the next step")


UNBOUNDED = ("the cache is not bounded: it grows with the sequence, but no query reaches further back than "
             "window positions; keep only the last window positions (keys[:, :, -window:])")


# ---------------------------------------------------------------- NumPy references (float64)

def np_band(num_queries, num_keys, window, first_query=None, rule="right"):
    """Boolean (num_queries, num_keys) mask of queries at positions first_query.. (default: the last
    num_queries of num_keys positions) over keys 0..num_keys-1. rule: "right" (j <= i, i - j < window),
    "off_by_one" (i - j <= window), "short" (i - j < window - 1), "both_sides" (|i - j| < window), "causal"."""
    first_query = num_keys - num_queries if first_query is None else first_query
    i = np.arange(first_query, first_query + num_queries)[:, None]
    j = np.arange(num_keys)[None, :]
    return {"right": (j <= i) & (i - j < window), "off_by_one": (j <= i) & (i - j <= window),
            "short": (j <= i) & (i - j < window - 1), "both_sides": np.abs(i - j) < window,
            "causal": j <= i}[rule]


def mask_mistakes(n, window):
    return {OFF_BY_ONE: np_band(n, n, window, rule="off_by_one"), SHORT: np_band(n, n, window, rule="short"),
            NOT_CAUSAL: np_band(n, n, window, rule="both_sides")}


def check_mask(name, mask, expected, window):
    """A boolean band mask equal to ``expected`` (compared as 0/1, with the band's typical mistakes)."""
    mask = np.asarray(mask)
    assert mask.dtype == bool, f"{name} must be boolean (True = takes part); yours has dtype {mask.dtype}:\n{mask}"
    as_numbers = {why: m.astype(np.float32) for why, m in mask_mistakes(expected.shape[0], window).items()}
    assert_close(f"{name} (1 = takes part)", mask.astype(np.float32), np.asarray(expected, np.float32),
                 mistakes=as_numbers)


def np_attend(q, k, v, allowed, weights):
    """Masked attention of (b, heads, n, head_dim) queries over keys/values; a row with no key gives 0."""
    s = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1]), -np.inf)
    w = np.where(allowed.any(-1, keepdims=True), softmax(np.where(allowed.any(-1, keepdims=True), s, 0)), 0)
    b, h, n, hd = q.shape
    return linear((w @ v).transpose(0, 2, 1, 3).reshape(b, n, h * hd), weights, "out_proj")


def np_window_attention(x, weights, num_heads, window, rule="right"):
    """The full forward: attention masked by the band (np_band's rule)."""
    x = np.asarray(x, dtype=np.float64)
    q, k, v = (split_heads(linear(x, weights, n), num_heads) for n in ("W_query", "W_key", "W_value"))
    return np_attend(q, k, v, np_band(x.shape[1], x.shape[1], window, rule=rule), weights)


def np_window_decode(x, weights, num_heads, window, chunks, keep="last", rows="offset", cut_before=0, nan=False):
    """Cached decoding in chunks, as a module does it: the cached keys/values before the new ones, the
    band's rows for the new queries, then the cache cut to ``window`` positions. keep: "last" (right),
    "first" or "all"; rows: "offset" (right: rows num_cached..) or "first" (rows 0..num_new-1);
    cut_before: the cache cut to its last cut_before positions BEFORE the new queries attend, so that they see
    only those keys (0: after, right), a query left with no key giving weights 0 or, with nan, NaN.
    returns: the outputs of every step, concatenated over tokens."""
    x = np.asarray(x, dtype=np.float64)
    q, k, v = (split_heads(linear(x, weights, n), num_heads) for n in ("W_query", "W_key", "W_value"))
    cache_k, cache_v, outputs, start = k[:, :, :0], v[:, :, :0], [], 0
    for size in chunks:
        new = slice(start, start + size)
        keys, values = np.concatenate([cache_k, k[:, :, new]], 2), np.concatenate([cache_v, v[:, :, new]], 2)
        num_cached = cache_k.shape[2]
        allowed = np_band(size, keys.shape[2], window, first_query=num_cached if rows == "offset" else 0)
        cut = {"last": slice(-window, None), "first": slice(None, window), "all": slice(None)}[keep]
        if cut_before:
            cut = slice(-cut_before, None)
            allowed[:, :max(0, keys.shape[2] - cut_before)] = False  # dropped before the queries got to them
        out = np_attend(q[:, :, new], keys, values, allowed, weights)
        if nan:
            out[:, ~allowed.any(axis=-1)] = np.nan
        outputs.append(out)
        cache_k, cache_v, start = keys[:, :, cut], values[:, :, cut], start + size
    return np.concatenate(outputs, axis=1)


def attention_mistakes(x, weights, num_heads, window, rows=slice(None)):
    run = partial(np_window_attention, x, weights, num_heads, window)
    return {OFF_BY_ONE: run(rule="off_by_one")[:, rows], SHORT: run(rule="short")[:, rows],
            NO_WINDOW: run(rule="causal")[:, rows]}


def decoding_mistakes(stage, init, x, weights, chunks, rows):
    """The cache's mistakes, and those of the band that the module's forward without the cache shows too: a
    band mistake makes that forward wrong in its own way (with a right band, a cache that holds too little can
    give the same numbers in a cached step)."""
    num_heads, window = init["num_heads"], init["window"]
    run = partial(np_window_decode, x, weights, num_heads, window, chunks)
    found = {OLDEST: run(keep="first")[:, rows], ROWS: run(rows="first")[:, rows]}
    for kept in sorted({window, max(window - 1, 1)}):  # (a cache of window - 1 positions is enough after attending)
        found[cut_before(kept)] = run(cut_before=kept)[:, rows]
        with_nan = run(cut_before=kept, nan=True)[:, rows]
        if np.isnan(with_nan).any():
            found[cut_before(kept) + NO_KEY_NAN] = with_nan
    band = attention_mistakes(x, weights, num_heads, window)
    try:
        shown = diagnose(stage.forward(CLS, init, x, weights), band, **FLOAT32)
    except Exception:  # (that forward's own check says what is wrong with it)
        shown = []
    return found | {why: c[:, rows] for why, c in band.items() if why in shown}


def window_case(rng, reference, t, window=None, b=None, num_heads=None):
    """Random SlidingWindowAttention constructor arguments (context_length >= t), input and weights."""
    num_heads = num_heads or int(rng.integers(1, 4))
    init = dict(d_in=int(rng.integers(2, 9)), d_out=num_heads * int(rng.integers(1, 5)),
                context_length=t + int(rng.integers(0, 4)), num_heads=num_heads,
                window=window or int(rng.integers(1, t + 2)), qkv_bias=bool(rng.integers(2)))
    x = normal(rng, b or int(rng.integers(1, 4)), t, init["d_in"])
    return init, x, draw_weights(rng, reference.stage(STAGE), CLS, init)


def check_decoding(stage, init, x, weights, chunks, expected, what):
    """Each cached step equals the full windowed forward's tokens, and the cache holds the last
    min(window, tokens so far) positions, never more than window."""
    steps = []
    for start, size in zip(np.cumsum([0, *chunks[:-1]]), chunks):
        steps += [{"method": "forward", "args": [x[:, start:start + size]], "kwargs": {"use_cache": True}},
                  {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    window, head_dim = init["window"], init["d_out"] // init["num_heads"]
    start = 0
    for step, (size, out, cache) in enumerate(zip(chunks, results[0::2], results[1::2])):
        rows = slice(start, start + size)
        start += size
        cached = 0 if cache is None else np.shape(cache)[2]
        assert cached <= window, (
            f"{what}: after cached step {step} ({start} tokens so far) cache_k holds {cached} positions, more than "
            f"window={window}: {UNBOUNDED}")
        # The last window positions, or the last window - 1: a new token brings its own key, so those are enough.
        sizes = sorted({min(window - 1, start), min(window, start)})
        shape = None if cache is None else np.shape(cache)
        heads_of = (x.shape[0], init["num_heads"])
        fits = (cache is None and 0 in sizes) or (len(shape) == 4 and cached in sizes and shape[:2] == heads_of
                                                   and shape[3] == head_dim)
        expected_shape = (x.shape[0], init["num_heads"], min(window, start), head_dim)
        assert fits, (
            f"{what}: after cached step {step} ({start} tokens so far) cache_k has shape {shape}; expected "
            f"(b, num_heads, min(window, tokens so far), head_dim) = {expected_shape} (or the last window - 1 "
            "positions)")
        assert_close(f"{what}: output of cached step {step} (tokens {rows.start}..{rows.stop - 1})", out,
                     expected[:, rows], **FLOAT32,
                     mistakes=partial(decoding_mistakes, stage, init, x, weights, chunks, rows))


# ---------------------------------------------------------------- public: the small examples

@pytest.mark.public
def test_mask_on_the_example(stage, public_fx):
    check_mask("sliding_window_mask(6, 3)", stage.sliding_window_mask(6, 3), public_fx.mask, 3)


@pytest.mark.public
def test_sliding_window_attention_on_the_example(stage, public_fx):
    init, x, weights = public_fx.init(), public_fx.x, public_fx.sub("weights/")
    assert_close("SlidingWindowAttention(6, 8, 8, 2, window=3) output", stage.forward(CLS, init, x, weights),
                 public_fx.output, **FLOAT32, mistakes=lambda: attention_mistakes(x, weights, 2, 3))


@pytest.mark.public
def test_cached_decoding_on_the_example(stage, public_fx):
    """A prompt of 2 tokens, then one token at a time, past the window of 3."""
    check_decoding(stage, public_fx.init(), public_fx.x, public_fx.sub("weights/"), [2, 1, 1, 1, 1, 1],
                   public_fx.output, "SlidingWindowAttention(6, 8, 8, 2, window=3)")


# ---------------------------------------------------------------- sliding_window_mask

def test_mask_is_exact(stage, hidden_fx, rng):
    cases = [(int(n), int(w)) for n, w in (name.split("_") for name in hidden_fx.sub("mask/"))]
    cases += [(int(rng.integers(1, 12)), int(rng.integers(1, 12))) for _ in range(3)]
    for n, window in cases:
        stored = hidden_fx.sub("mask/").get(f"{n}_{window}", np_band(n, n, window))
        assert np.array_equal(stored, np_band(n, n, window))  # the stored masks are the NumPy reference's
        check_mask(f"sliding_window_mask({n}, {window})", stage.sliding_window_mask(n, window), stored, window)


def test_mask_extremes(stage):
    """window 1: each token sees itself only; window >= num_tokens: plain causal attention."""
    check_mask("sliding_window_mask(5, 1): only the query's own token", stage.sliding_window_mask(5, 1),
               np.eye(5, dtype=bool), 1)
    for window in (5, 6, 50):
        check_mask(f"sliding_window_mask(5, {window}): the causal mask", stage.sliding_window_mask(5, window),
                   np.tril(np.ones((5, 5), bool)), window)


# ---------------------------------------------------------------- SlidingWindowAttention

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_forward_equals_attention_masked_by_the_band(stage, hidden_fx, case):
    init, x, weights = hidden_fx.init(f"{case}/"), hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    out = stage.forward(CLS, init, x, weights)
    mistakes = partial(attention_mistakes, x, weights, init["num_heads"], init["window"])
    assert_close(f"SlidingWindowAttention({init}) output", out, hidden_fx[f"{case}/output"], **FLOAT32,
                 mistakes=mistakes)
    assert_close(f"SlidingWindowAttention({init}) output against the NumPy reference", out,
                 np_window_attention(x, weights, init["num_heads"], init["window"]), **FLOAT32, mistakes=mistakes)


def test_cache_stays_within_the_window(stage, reference, rng):
    """A prompt shorter than the window, single tokens well past it, a chunk longer than the window and more
    single tokens: every step equals the full windowed forward, the cache never holds more than window."""
    init, x, weights = window_case(rng, reference, t=16, window=3)
    check_decoding(stage, init, x, weights, [2, 1, 1, 1, 1, 5, 1, 1, 2, 1],
                   np_window_attention(x, weights, init["num_heads"], 3), f"SlidingWindowAttention({init})")


def test_cached_decoding_after_reset(stage, reference, rng):
    init, x, weights = window_case(rng, reference, t=8, window=2)
    other = normal(rng, x.shape[0], 5, init["d_in"])
    steps = [{"method": "forward", "args": [x[:, :6]], "kwargs": {"use_cache": True}}, {"method": "reset_cache"},
             {"get": "cache_k"}]
    steps += [{"method": "forward", "args": [other[:, i:i + 1]], "kwargs": {"use_cache": True}} for i in range(5)]
    results = stage.session(CLS, init, weights, steps=steps)
    assert results[2] is None, f"after reset_cache(), cache_k should be None (empty); it holds {np.shape(results[2])}"
    assert_close("a new sequence decoded token by token after reset_cache()", np.concatenate(results[3:], axis=1),
                 np_window_attention(other, weights, init["num_heads"], 2), **FLOAT32,
                 mistakes=partial(decoding_mistakes, stage, init, other, weights, [1] * 5, slice(None)))


def test_parameters_and_mask_buffer(stage):
    init = dict(d_in=6, d_out=8, context_length=7, num_heads=2, window=3)
    info = stage.inspect(CLS, init)
    expected = {"W_query.weight": [8, 6], "W_key.weight": [8, 6], "W_value.weight": [8, 6],
                "out_proj.weight": [8, 8], "out_proj.bias": [8]}
    assert info["parameters"] == expected, f"{CLS}(6, 8, 7, 2, window=3) parameters {info['parameters']}; " \
        f"expected {expected}"
    assert "band" in info["buffers"], "register the band sliding_window_mask(context_length, window) as buffer 'band'"
    check_mask("the buffer band of SlidingWindowAttention(6, 8, 7, 2, window=3)", info["buffers"]["band"],
               np_band(7, 7, 3), 3)


def test_random_cases(stage, reference, rng, device):
    for _ in range(3):
        init, x, weights = window_case(rng, reference, t=int(rng.integers(1, 10)))
        assert_close(f"{CLS}({init}) on x {x.shape}", stage.forward(CLS, init, x, weights, device=device),
                     reference.stage(STAGE).forward(CLS, init, x, weights), **FLOAT32,
                     mistakes=partial(attention_mistakes, x, weights, init["num_heads"], init["window"]))


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs Llama 2 7B's attention size with a window
    "cpu": dict(b=2, t=40, d_model=64, num_heads=4, window=9),
    "cuda": dict(b=1, t=4096, d_model=4096, num_heads=32, window=1024),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_model=256, num_heads=32, window=16),
}


def torch_window_attention(x, weights, num_heads, window, device):
    """The same attention computed by the test in float32 on ``device``, with F.scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    x = torch.from_numpy(x).to(device)
    b, t, d = x.shape
    q, k, v = (F.linear(x, w[f"{n}.weight"], w.get(f"{n}.bias")).view(b, t, num_heads, d // num_heads).transpose(1, 2)
               for n in ("W_query", "W_key", "W_value"))
    allowed = torch.from_numpy(np_band(t, t, window)).to(device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return F.linear(out.transpose(1, 2).reshape(b, t, d), w["out_proj.weight"], w["out_proj.bias"]).cpu().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_sized(stage, target, dtype):
    """Sliding-window attention at Llama sizes on CUDA (its CPU twin is small), against
    F.scaled_dot_product_attention with the band as attn_mask in float32; bfloat16 at bf16 tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(6)
    d = size["d_model"]
    init = dict(d_in=d, d_out=d, context_length=size["t"], num_heads=size["num_heads"], window=size["window"])
    # Normal weights of std 1/sqrt(d): queries, keys, values of unit size and scores of std 1, so that bf16's
    # rounding (~0.4% of a score) stays within its tolerance; the outputs are of unit size.
    weights = {f"{n}.weight": (r.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32)
               for n in ("W_query", "W_key", "W_value", "out_proj")}
    weights["out_proj.bias"] = np.zeros(d, np.float32)
    x = normal(r, size["b"], size["t"], d)
    expected = torch_window_attention(x, weights, size["num_heads"], size["window"], device)
    out = stage.forward(CLS, init, x, weights, device=device, dtype=dtype)
    assert_close(f"{CLS} output ({device}, {dtype})", out, expected, **TOLERANCE[dtype],
                 mistakes=lambda: {} if target.cuda else  # (the NumPy mistakes take minutes at the CUDA size)
                 attention_mistakes(x, weights, size["num_heads"], size["window"]))
