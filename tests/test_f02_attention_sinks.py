"""Stage f02: attention sinks (StreamingLLM's cache, gpt-oss's learned sink logits).

Spec: sink_window_mask(query_positions, key_positions, window=None, num_sink_tokens=0) -> bool (n_q, n_k), True
where j <= i and (window None, or j < num_sink_tokens, or i - j < window). softmax_with_sinks(scores, sinks):
exp(s_j - m) / (sum_k exp(s_k - m) + exp(sinks[h] - m)), m the max of the row's scores and its head's sink logit;
rows with nothing finite give 0. SinkAttention(d_in, d_out, context_length, num_heads, num_kv_groups=None,
window=None, num_sink_tokens=0, qkv_bias=False): W_query, W_key, W_value (num_kv_groups heads, repeat_interleave),
out_proj, sinks (num_heads,); scores / sqrt(head_dim) under the mask, softmax_with_sinks (sinks unscaled);
forward(x, use_cache=False) with a cache (cache_k, cache_v: (b, num_kv_groups, kept, head_dim)) that keeps the
first num_sink_tokens positions and the last window, so every cached step equals the full forward.
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, assert_mask, linear, multihead, split_heads
from suite_runtime.cases import cached_steps, linear_shapes, normal, random_weights, spans

pytestmark = pytest.mark.attention_sinks
STAGE = "f02_attention_sinks"
CLS = "SinkAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
SINKS_IGNORED = ("the sink logits were left out: softmax_with_sinks adds exp(sinks[h]) to the denominator of every "
                 "row of head h, so the weights sum to less than 1 (the sink mixes no value)")
SINK_SCALED = ("the sink logits were scaled by 1/sqrt(head_dim) with the scores: a sink is a logit of its own, "
               "added to the softmax as it is")
WINDOW_OFF = ("the window is off by one: key j is inside it when i - j < window (window tokens, the query's own "
              "included)")
SINK_TOKENS_OFF = ("one sink token too many: the sink tokens are positions 0 .. num_sink_tokens - 1 "
                   "(j < num_sink_tokens)")
NO_SINK_TOKENS = ("the sink tokens were not kept: the first num_sink_tokens positions stay visible to every query "
                  "(and in the cache) however far the window has moved")
EVICTED = ("the sink tokens were evicted from the cache: keep the first num_sink_tokens positions for good, besides "
           "the last window")
NOT_CAUSAL = "the mask lets queries see later keys: j <= i must hold as well"
OVERFLOW = ("exp overflowed: subtract the larger of the row's max score and its sink logit before exp (softmax is "
            "unchanged by it, and every exp is then at most 1)")


# ---------------------------------------------------------------- NumPy references (float64)

def np_mask(query_positions, key_positions, window=None, num_sink_tokens=0, *, window_le=False, causal=True):
    i, j = np.asarray(query_positions)[:, None], np.asarray(key_positions)[None, :]
    keep = j <= i if causal else np.ones((i.size, j.size), bool)
    if window is None:
        return keep
    inside = i - j <= window if window_le else i - j < window
    return keep & ((j < num_sink_tokens) | inside)


def mask_mistakes(query_positions, key_positions, window, num_sink_tokens):
    run = partial(np_mask, query_positions, key_positions)
    found = {NOT_CAUSAL: run(window, num_sink_tokens, causal=False)}
    if window is None:
        return found
    return found | {WINDOW_OFF: run(window, num_sink_tokens, window_le=True),
                    SINK_TOKENS_OFF: run(window, num_sink_tokens + 1), NO_SINK_TOKENS: run(window, 0)}


def np_softmax_with_sinks(scores, sinks, *, use_sinks=True, shift=True, dtype=np.float64):
    """softmax_with_sinks in NumPy. use_sinks=False: a plain softmax; shift=False: exp without subtracting the max
    (in ``dtype``: float32 overflows as the learner's would)."""
    s = np.asarray(scores, dtype)
    z = np.asarray(sinks, dtype).reshape(-1, 1, 1) if use_sinks else np.full((s.shape[1], 1, 1), -np.inf, dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        m = np.maximum(s.max(axis=-1, keepdims=True), z) if shift else np.zeros_like(s[..., :1])
        m = np.where(np.isneginf(m), 0, m)
        e = np.exp(s - m)
        total = e.sum(axis=-1, keepdims=True) + np.exp(z - m)
        return e / np.where(total == 0, 1, total)


def softmax_mistakes(scores, sinks):
    return {SINKS_IGNORED: np_softmax_with_sinks(scores, sinks, use_sinks=False),
            OVERFLOW: np_softmax_with_sinks(scores, sinks, shift=False, dtype=np.float32)}


def np_sink_attention(x, weights, init, *, positions=None, key_positions=None, sink_scale=1.0, use_sinks=True,
                      **mask_options):
    """SinkAttention's full forward in NumPy (queries at ``positions``, default 0..T-1, attending to the keys at
    ``key_positions``, default the same): mask_options go to np_mask (window, num_sink_tokens and the mistakes'
    switches), sink_scale multiplies the sink logits (a mistake scales them by 1/sqrt(head_dim))."""
    x = np.asarray(x, dtype=np.float64)
    b, t, _ = x.shape
    num_heads = init["num_heads"]
    kv = init.get("num_kv_groups") or num_heads
    q = split_heads(linear(x, weights, "W_query"), num_heads)
    k, v = (np.repeat(split_heads(linear(x, weights, n), kv), num_heads // kv, axis=1) for n in ("W_key", "W_value"))
    hd = q.shape[-1]
    positions = np.arange(t) if positions is None else positions
    mask_options = {"window": init.get("window"), "num_sink_tokens": init.get("num_sink_tokens", 0), **mask_options}
    allowed = np_mask(positions, positions if key_positions is None else key_positions, **mask_options)
    scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
    w = np_softmax_with_sinks(scores, weights["sinks"] * sink_scale, use_sinks=use_sinks)
    return linear((w @ v).transpose(0, 2, 1, 3).reshape(b, t, -1), weights, "out_proj")


def attention_mistakes(x, weights, init, rows=slice(None), cached=False):
    """{description: the output's tokens ``rows``} of the typical mistakes (cached: those of a cached decoding)."""
    run = partial(np_sink_attention, x, weights, init)
    hd = init["d_out"] // init["num_heads"]
    found = {SINKS_IGNORED: run(use_sinks=False), SINK_SCALED: run(sink_scale=1 / np.sqrt(hd)),
             NOT_CAUSAL: run(causal=False)}
    if init.get("window") is not None:
        found[WINDOW_OFF] = run(window_le=True)
        if init.get("num_sink_tokens", 0):
            found[SINK_TOKENS_OFF] = run(num_sink_tokens=init["num_sink_tokens"] + 1)
            found[EVICTED if cached else NO_SINK_TOKENS] = run(num_sink_tokens=0)
    return {why: out[:, rows] for why, out in found.items()}


def sink_shapes(d_in, d_out, num_heads, num_kv_groups=None, qkv_bias=False, **_):
    kv_width = (num_kv_groups or num_heads) * (d_out // num_heads)
    return {**linear_shapes("W_query", d_in, d_out, qkv_bias), **linear_shapes("W_key", d_in, kv_width, qkv_bias),
            **linear_shapes("W_value", d_in, kv_width, qkv_bias), **linear_shapes("out_proj", d_out, d_out),
            "sinks": (num_heads,)}


def sink_weights(rng, init):
    weights = random_weights(rng, sink_shapes(**init))
    weights["sinks"] = normal(rng, init["num_heads"])  # logits of the size of the scores
    return weights


def check_steps(outputs, expected, chunks, x, weights, init, what=""):
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **FLOAT32, mistakes=partial(attention_mistakes, x, weights, init, slice(a, e), cached=True),
                     hint=f"Expected: rows {a}..{e - 1} of the full forward (chunks of {tuple(chunks)} tokens).")


def check_kept(cache_k, init, b, fed, when):
    """cache_k after ``fed`` tokens: num_kv_groups heads, at most num_sink_tokens + window positions (all of them
    without a window; one fewer than the window is enough too: no later query reaches the oldest)."""
    kv, hd = init.get("num_kv_groups") or init["num_heads"], init["d_out"] // init["num_heads"]
    window, sinks = init.get("window"), init.get("num_sink_tokens", 0)
    most = fed if window is None else min(fed, sinks + window)
    assert cache_k is not None and np.ndim(cache_k) == 4, (
        f"cache_k is {cache_k!r} {when}: expected a (b, num_kv_groups, kept, head_dim) tensor")
    kept = np.shape(cache_k)[2]
    assert np.shape(cache_k)[:2] == (b, kv) and np.shape(cache_k)[3] == hd and most - 1 <= kept <= most, (
        f"cache_k has shape {np.shape(cache_k)} {when}; expected (b, num_kv_groups, kept, head_dim) = "
        f"({b}, {kv}, {most}, {hd}): "
        + ("without a window the cache keeps every position" if window is None else
           f"the cache keeps the first num_sink_tokens={sinks} positions and the last window={window}, no more"
           + ("; yours is not bounded" if kept > most else "")))


def case_of(fx, prefix=""):
    return fx.init(prefix), fx[f"{prefix}x"], fx.sub(f"{prefix}weights/"), fx[f"{prefix}chunks"].tolist()


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
def test_sink_window_mask_on_the_example(stage, public_fx):
    """Positions 0..7, a window of 3 and 2 sink tokens: each query sees tokens 0 and 1 and its last 3."""
    positions = public_fx["mask/positions"]
    assert_mask("sink_window_mask(arange(8), arange(8), window=3, num_sink_tokens=2)",
                stage.sink_window_mask(positions, positions, window=3, num_sink_tokens=2), public_fx["mask/allowed"],
                mistakes=mask_mistakes(positions, positions, 3, 2))


@pytest.mark.public
def test_softmax_with_sinks_on_the_example(stage, public_fx):
    """Scores of 2 heads with masked keys, a row of large scores and a row with every key masked."""
    scores, sinks = public_fx["softmax/scores"], public_fx["softmax/sinks"]
    assert_close("softmax_with_sinks(scores, sinks)", stage.softmax_with_sinks(scores, sinks),
                 public_fx["softmax/weights"], **FLOAT32, mistakes=softmax_mistakes(scores, sinks))


@pytest.mark.public
def test_forward_on_the_example(stage, public_fx):
    """The journey batch: 2 query heads sharing 1 key/value head, a window of 3, 1 sink token, learned sinks."""
    init, x, weights, _ = case_of(public_fx)
    assert_close(f"{CLS}(3, 4, 6, 2, num_kv_groups=1, window=3, num_sink_tokens=1) output",
                 stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 mistakes=lambda: attention_mistakes(x, weights, init))


@pytest.mark.public
def test_streaming_decoding_on_the_example(stage, public_fx):
    """A prompt of 3 tokens, then one by one: each step equals the full forward, and the cache keeps the sink token
    and the last 3 positions only."""
    init, x, weights, chunks = case_of(public_fx)
    steps = []
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    check_steps(results[0::2], public_fx.output, chunks, x, weights, init)
    for k, (_, e) in enumerate(spans(chunks)):
        check_kept(results[2 * k + 1], init, x.shape[0], e, f"after step {k} (tokens 0..{e - 1} fed)")


# ---------------------------------------------------------------- hidden

def test_sink_window_mask_at_other_positions(stage, rng):
    """Queries further on than the keys begin (a cache's positions), other windows, no window."""
    cases = [(np.arange(10, 13), np.array([0, 1, 8, 9, 10, 11, 12]), 3, 2), (np.arange(6), np.arange(6), None, 0),
             (np.arange(7), np.arange(7), 1, 0), (np.arange(9), np.arange(9), 4, 3)]
    t = int(rng.integers(3, 12))
    cases.append((np.arange(t), np.arange(t), int(rng.integers(1, t)), int(rng.integers(0, 3))))
    for q, k, window, sinks in cases:
        assert_mask(f"sink_window_mask({q.tolist()}, {k.tolist()}, window={window}, num_sink_tokens={sinks})",
                    stage.sink_window_mask(q, k, window=window, num_sink_tokens=sinks), np_mask(q, k, window, sinks),
                    mistakes=mask_mistakes(q, k, window, sinks))


def test_softmax_with_sinks_matches_numpy(stage, rng):
    """Random scores and sinks; large logits; a sink of -inf (none) gives softmax itself; rows with every key
    masked give weights 0 with a finite sink and with none (no NaN)."""
    scores = normal(rng, 2, 3, 4, 5, scale=3.0)
    scores[:, :, 1, 2:] = -np.inf
    scores[0, 1, 2] = -np.inf
    sinks = normal(rng, 3, scale=3.0)
    cases = [("random", scores, sinks), ("large logits", scores * 200, sinks * 200),
             ("no sink (-inf)", scores, np.full(3, -np.inf, np.float32)),
             ("every key masked, no sink", np.full((1, 2, 2, 3), -np.inf, np.float32), np.full(2, -np.inf, np.float32))]
    for name, s, z in cases:
        assert_close(f"softmax_with_sinks ({name})", stage.softmax_with_sinks(s, z), np_softmax_with_sinks(s, z),
                     **FLOAT32, mistakes=softmax_mistakes(s, z))


@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_stored_cases_full_and_cached(stage, hidden_fx, case):
    """Sink tokens and a window with 2 kv heads (case0); gpt-oss's layers, a window and learned sinks, one token at
    a time (case1); no window, learned sinks (case2)."""
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    assert_close(f"{init}: forward(x)", stage.forward(CLS, init, x, weights), hidden_fx[f"{case}/output"], **FLOAT32,
                 mistakes=partial(attention_mistakes, x, weights, init))
    *outputs, cache_k = stage.session(CLS, init, weights, steps=[*cached_steps(x, chunks), {"get": "cache_k"}])
    check_steps(outputs, hidden_fx[f"{case}/output"], chunks, x, weights, init, f"{init}: ")
    check_kept(cache_k, init, x.shape[0], x.shape[1], "at the end")


def test_without_sinks_or_window_it_is_causal_attention(stage, rng):
    """sinks = -inf (no sink) and no window: chapter 3's causal multi-head attention (checks.multihead)."""
    num_heads, t = int(rng.integers(1, 4)), int(rng.integers(2, 8))
    init = dict(d_in=int(rng.integers(2, 6)), d_out=num_heads * int(rng.integers(1, 4)), context_length=t,
                num_heads=num_heads, qkv_bias=True)
    weights = sink_weights(rng, init)
    weights["sinks"] = np.full(num_heads, -np.inf, np.float32)
    x = normal(rng, 2, t, init["d_in"])
    assert_close(f"{init} with sinks = -inf: forward(x)", stage.forward(CLS, init, x, weights),
                 multihead(x, weights, num_heads), **FLOAT32)


def test_the_cache_stays_bounded_over_a_long_text(stage, rng):
    """20 tokens one by one through 2 sink tokens and a window of 3: every output equals the full forward, and the
    cache never holds more than 5 positions."""
    init = dict(d_in=4, d_out=6, context_length=20, num_heads=2, num_kv_groups=1, window=3, num_sink_tokens=2)
    weights, x = sink_weights(rng, init), normal(rng, 1, 20, 4)
    steps = []
    for step in cached_steps(x, [1] * 20):
        steps += [step, {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    check_steps(results[0::2], np_sink_attention(x, weights, init), [1] * 20, x, weights, init)
    for k in range(20):
        check_kept(results[2 * k + 1], init, 1, k + 1, f"after token {k}")


def test_random_cases_against_the_reference(stage, reference, rng, device):
    """Random sizes, windows and sink tokens, random chunks, reset_cache() and a second sequence."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        kv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3))
        t = int(rng.integers(3, 12))
        window = None if rng.integers(4) == 0 else int(rng.integers(1, t))
        init = dict(d_in=int(rng.integers(2, 6)), d_out=kv * group * int(rng.integers(1, 3)), context_length=t,
                    num_heads=kv * group, num_kv_groups=kv, window=window, num_sink_tokens=int(rng.integers(0, 3)),
                    qkv_bias=bool(rng.integers(2)))
        weights = sink_weights(rng, init)
        first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(0, t)), replace=False))
        chunks = np.diff([0, *cuts, t]).tolist()
        steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1])]
        outputs = stage.session(CLS, init, weights, steps=steps, device=device)
        n = len(chunks)
        for seq, got, parts, what in ((first, outputs[:n], chunks, ""), (second, outputs[n + 1:], chunks[::-1],
                                                                         "after reset_cache(), ")):
            [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [seq]}])
            check_steps(got, expected, parts, seq, weights, init, f"{init}: {what}")


def torch_sink_attention(x, weights, num_heads, num_kv_groups, window, device):
    """The full forward computed by the test in float32 on ``device``: dense scores, the band, the sink column."""
    import torch

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    x = torch.from_numpy(x).to(device)
    b, t, _ = x.shape

    def heads(name, n):
        return (x @ w[f"{name}.weight"].T).view(b, t, n, -1).transpose(1, 2)

    q = heads("W_query", num_heads)
    k, v = (heads(n, num_kv_groups).repeat_interleave(num_heads // num_kv_groups, dim=1) for n in ("W_key", "W_value"))
    i, j = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
    scores = (q @ k.transpose(2, 3) / q.shape[-1] ** 0.5).masked_fill(~((j <= i) & (i - j < window)), -torch.inf)
    logits = torch.cat([scores, w["sinks"].view(1, -1, 1, 1).expand(b, num_heads, t, 1)], dim=-1)
    weights_ = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's column mixes nothing
    out = (weights_ @ v).transpose(1, 2).reshape(b, t, -1)
    return (out @ w["out_proj.weight"].T + w["out_proj.bias"]).cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is a sliding layer of gpt-oss-20b (d_model 2880, 64
    # query heads of 64, 8 key/value heads, a window of 128, learned sinks)
    "cpu": dict(b=2, t=40, d_in=48, num_heads=8, head_dim=8, num_kv_groups=2, window=8, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_in=2880, num_heads=64, head_dim=64, num_kv_groups=8, window=128,
                 dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_in=96, num_heads=16, head_dim=8, num_kv_groups=2, window=16, dtypes=("bfloat16",)),
}


def test_gpt_oss_sized_prompt_then_tokens(stage, target):
    """A long prompt, then 3 tokens one by one, against the test's own float32 computation at the dtype's tolerance;
    the cache ends with the last window positions only."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(201)
    d_in, h, kv, t = size["d_in"], size["num_heads"], size["num_kv_groups"], size["t"]
    d_out = h * size["head_dim"]
    init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=h, num_kv_groups=kv, window=size["window"])
    shapes = sink_shapes(**init)
    weights = {n: (r.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for n, s in shapes.items()}
    weights["out_proj.bias"] = np.zeros(d_out, np.float32)
    weights["sinks"] = normal(r, h)
    x = normal(r, size["b"], t, d_in)
    expected = torch_sink_attention(x, weights, h, kv, size["window"], device)
    chunks = [t - 3, 1, 1, 1]
    for dtype in size["dtypes"]:
        *outputs, cache_k = stage.session(CLS, init, weights, steps=[*cached_steps(x, chunks), {"get": "cache_k"}],
                                          device=device, dtype=dtype)
        for k, (a, e) in enumerate(spans(chunks)):
            assert_close(f"{device}, {dtype}: step {k} (tokens {a}..{e - 1})", outputs[k], expected[:, a:e],
                         **TOLERANCE[dtype])
        check_kept(cache_k, init, size["b"], t, "at the end")
