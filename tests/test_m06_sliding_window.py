"""Stage m06: sliding-window attention with a bounded KV cache.

Spec: sliding_window_mask(num_tokens, window) -> bool (num_tokens, num_tokens), True where key j takes part
for query i: j <= i and i - j < window (window 1: each token sees itself only; window >= num_tokens: causal).
SlidingWindowAttention(d_in, d_out, context_length, num_heads, window, qkv_bias=False): multi-head attention
(W_query, W_key, W_value, out_proj; scale 1/sqrt(head_dim)) masked by that band; forward(x, use_cache=False)
with stage m03's cache API, whose cache_k / cache_v (b, num_heads, cached, head_dim) never hold more than
``window`` positions (the most recent ones: the last min(window, tokens so far), or window - 1 once a step's new
token brings its own), and whose steps equal the full windowed forward's tokens; reset_cache() empties the cache
(cache_k = cache_v = None).
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, BROADCAST, Attention, assert_close, readings_with
from diagnosis.attention import allowed_keys, forward
from diagnosis.caches import UNBOUNDED, CachedModule, cache_mask_sizes
from diagnosis.masks import MaskFunction
from diagnosis.subjects import sizes_as_given
from suite_runtime.cases import distinct_sizes, draw_weights, normal

pytestmark = pytest.mark.sliding_window
STAGE = "m06_sliding_window"
CLS = "SlidingWindowAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
ERROR_READINGS = readings_with(BROADCAST, cache_mask_sizes)  # (conftest reads a stage's readings here)


def spec_of(init):
    """What the module computes (diagnosis.attention): causal multi-head attention with out_proj over the last
    ``window`` tokens; a query with no key (a mistake's) gets weights 0, as F.scaled_dot_product_attention gives."""
    return Attention(num_heads=init["num_heads"], window=init["window"], empty_rows="zero")


def module(stage, init, **options):
    """The module as the diagnoser runs it again (diagnosis.caches): its attention and a cache bounded by the
    window."""
    return CachedModule(stage, CLS, init, spec_of(init), sized=sizes_as_given, options=options)


def band(num_tokens, window):
    """The band (num_tokens, num_tokens), True where key j takes part for query i: j <= i and i - j < window."""
    positions = np.arange(num_tokens)
    return allowed_keys(Attention(window=window), positions, positions)


def check_mask(name, mask, expected, window):
    """A boolean band mask equal to ``expected`` (compared as 0/1), diagnosed by the band's switches and a
    reading of the mask itself (diagnosis.masks)."""
    mask = np.asarray(mask)
    assert mask.dtype == bool, f"{name} must be boolean (True = takes part); yours has dtype {mask.dtype}:\n{mask}"
    assert_close(f"{name} (1 = takes part)", mask.astype(np.float32), np.asarray(expected, np.float32),
                 diagnosis=MaskFunction(Attention(window=window), "your band").evidence(len(expected)))


def window_attention(init, x, weights):
    """The full forward in NumPy float64 (diagnosis.attention): attention masked by the band."""
    return forward(spec_of(init), x, weights)


def window_case(rng, reference, t, window=None, num_heads=None):
    """Random SlidingWindowAttention constructor arguments (context_length >= t), input and weights: batch, heads,
    head_dim, d_out, d_in, tokens and window pairwise distinct."""
    ranges = dict(b=(1, 4), num_heads=(num_heads or 1, num_heads or 4), head_dim=(2, 6), d_in=(2, 10))
    fixed = {"t": t} | ({} if window is None else {"window": window})
    if window is None:
        ranges["window"] = (1, t + 1)
    sizes = distinct_sizes(rng, ranges, lambda s: fixed | {"d_out": s["num_heads"] * s["head_dim"]})
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], context_length=t + int(rng.integers(0, 4)),
                num_heads=sizes["num_heads"], window=sizes["window"], qkv_bias=bool(rng.integers(2)))
    x = normal(rng, sizes["b"], t, init["d_in"])
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
    subject = module(stage, init)
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
                     expected[:, rows], **FLOAT32, diagnosis=subject.step_evidence(x, weights, chunks, step))


def call(init):
    return f"{CLS}({', '.join(f'{k}={v}' for k, v in init.items())})"


# ---------------------------------------------------------------- public: the small examples

@pytest.mark.public
def test_mask_on_the_example(stage, public_fx):
    check_mask("sliding_window_mask(6, 3)", stage.sliding_window_mask(6, 3), public_fx.mask, 3)


@pytest.mark.public
def test_sliding_window_attention_on_the_example(stage, public_fx):
    init, x, weights = public_fx.init(), public_fx.x, public_fx.sub("weights/")
    assert_close(f"{call(init)} output", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 diagnosis=module(stage, init).evidence(x, weights))


@pytest.mark.public
def test_cached_decoding_on_the_example(stage, public_fx):
    """A prompt of 2 tokens, then one token at a time, past the window."""
    init, x = public_fx.init(), public_fx.x
    check_decoding(stage, init, x, public_fx.sub("weights/"), [2, *([1] * (x.shape[1] - 2))], public_fx.output,
                   call(init))


# ---------------------------------------------------------------- sliding_window_mask

def test_mask_is_exact(stage, hidden_fx, rng):
    cases = [(int(n), int(w)) for n, w in (name.split("_") for name in hidden_fx.sub("mask/"))]
    cases += [(int(rng.integers(1, 12)), int(rng.integers(1, 12))) for _ in range(3)]
    for n, window in cases:
        stored = hidden_fx.sub("mask/").get(f"{n}_{window}", band(n, window))
        assert np.array_equal(stored, band(n, window))  # the stored masks are the NumPy reference's
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
    evidence = module(stage, init).evidence(x, weights)
    assert_close(f"{call(init)} output", out, hidden_fx[f"{case}/output"], **FLOAT32, diagnosis=evidence)
    assert_close(f"{call(init)} output against the NumPy reference", out, window_attention(init, x, weights),
                 **FLOAT32, diagnosis=evidence)


def test_cache_stays_within_the_window(stage, reference, rng):
    """A prompt shorter than the window, single tokens well past it, a chunk longer than the window and more
    single tokens: every step equals the full windowed forward, the cache never holds more than window."""
    init, x, weights = window_case(rng, reference, t=16, window=3)
    check_decoding(stage, init, x, weights, [2, 1, 1, 1, 1, 5, 1, 1, 2, 1], window_attention(init, x, weights),
                   call(init))


def test_cached_decoding_after_reset(stage, reference, rng):
    """Six tokens, reset_cache(), then a new sequence token by token: each step equals that sequence's own full
    windowed forward."""
    init, x, weights = window_case(rng, reference, t=8, window=2)
    other = normal(rng, x.shape[0], 5, init["d_in"])
    steps = [{"method": "forward", "args": [x[:, :6]], "kwargs": {"use_cache": True}}, {"method": "reset_cache"},
             {"get": "cache_k"}]
    steps += [{"method": "forward", "args": [other[:, i:i + 1]], "kwargs": {"use_cache": True}} for i in range(5)]
    results = stage.session(CLS, init, weights, steps=steps)
    assert results[2] is None, f"after reset_cache(), cache_k should be None (empty); it holds {np.shape(results[2])}"
    expected, subject = window_attention(init, other, weights), module(stage, init)
    for step, out in enumerate(results[3:]):
        assert_close(f"after reset_cache(), a new sequence's token {step} (use_cache=True)", out,
                     expected[:, step:step + 1], **FLOAT32,
                     diagnosis=subject.step_evidence(other, weights, [1] * 5, step, past=x[:, :6]))


def test_parameters_and_mask_buffer(stage):
    init = dict(d_in=6, d_out=10, context_length=7, num_heads=2, window=3)
    info = stage.inspect(CLS, init)
    expected = {"W_query.weight": [10, 6], "W_key.weight": [10, 6], "W_value.weight": [10, 6],
                "out_proj.weight": [10, 10], "out_proj.bias": [10]}
    assert info["parameters"] == expected, f"{call(init)} parameters {info['parameters']}; expected {expected}"
    assert "band" in info["buffers"], "register the band sliding_window_mask(context_length, window) as buffer 'band'"
    check_mask(f"the buffer band of {call(init)}", info["buffers"]["band"], band(7, 3), 3)


def test_random_cases(stage, reference, rng, device):
    for _ in range(3):
        init, x, weights = window_case(rng, reference, t=int(rng.integers(3, 10)))
        assert_close(f"{call(init)} on x {x.shape}", stage.forward(CLS, init, x, weights, device=device),
                     reference.stage(STAGE).forward(CLS, init, x, weights), **FLOAT32,
                     diagnosis=module(stage, init, device=device).evidence(x, weights))


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
    allowed = torch.from_numpy(band(t, window)).to(device)
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
                 # (the evidence is computed in NumPy: at the CPU twin's size only)
                 diagnosis=[] if target.cuda else module(stage, init, device=device).evidence(x, weights))
