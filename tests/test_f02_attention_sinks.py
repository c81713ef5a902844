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
import numpy as np
import pytest

from diagnosis import BFLOAT16, Attention, AttentionModule, Probed, Said, Searched, assert_close, assert_mask
from diagnosis import caches as C
from diagnosis import sinks as S
from diagnosis.modules import module_probes
from diagnosis.probes import ExposedWeights, weight_findings
from diagnosis.subjects import Deferred
from suite_runtime.cases import cached_steps, linear_shapes, normal, pairwise_distinct, random_weights, spans

pytestmark = pytest.mark.attention_sinks
STAGE = "f02_attention_sinks"
CLS = "SinkAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


# ---------------------------------------------------------------- what a failed check is diagnosed with

def spec_of(init):
    return S.Sinks(init["num_heads"], init.get("num_kv_groups"), init.get("window"), init.get("num_sink_tokens", 0))


def np_mask(query_positions, key_positions, window=None, num_sink_tokens=0):
    return S.allowed(S.Sinks(window=window, num_sink_tokens=num_sink_tokens), query_positions, key_positions)


def check_mask(stage, q, k, window, sinks):
    """sink_window_mask(q, k, window, sinks) of the learner against the rule, its switches searched and the mask's
    window and sink tokens measured."""
    spec = S.Sinks(window=window, num_sink_tokens=sinks)
    got = stage.sink_window_mask(q, k, window=window, num_sink_tokens=sinks)
    assert_mask(f"sink_window_mask({q.tolist()}, {k.tolist()}, window={window}, num_sink_tokens={sinks})", got,
                np_mask(q, k, window, sinks), diagnosis=[
                    Searched(lambda choices: S.allowed(spec, q, k, choices).astype(np.float32), S.mask_switches(spec),
                             "your mask"),
                    Said(lambda actual: S.mask_findings(actual, q, k, spec))])


def check_softmax(stage, name, scores, sinks):
    """softmax_with_sinks of the learner against the reference, its switches searched and the share each row leaves
    to the sink read from the learner's weights."""
    got = stage.softmax_with_sinks(scores, sinks)
    assert_close(f"softmax_with_sinks ({name})", got, S.softmax(scores, sinks), **FLOAT32, diagnosis=[
        Searched(lambda choices: S.softmax(scores, sinks, choices), S.softmax_switches(), "your weights"),
        Said(lambda actual: S.sink_findings(actual, np.where(np.isfinite(scores), scores, 0), np.isfinite(scores), 1.0,
                                            sinks, what="your weights") if np.all(np.isfinite(sinks)) else [])])


def diagnosis(stage, init, x, weights, chunks=None, rows=slice(None)):
    """What a failed check of the module's output (``rows`` of a decoding of x in ``chunks``; None: the full
    forward) is diagnosed with: the sinks' and masks' switches (diagnosis.sinks) and attention's, searched on this case
    and on a second one of other sizes; the attention weights read through an exposing case (the keys each query
    sees, the temperature, the share left to the sink); and the probes of every module."""
    def make():
        spec = spec_of(init)

        def compute(choices):
            return S.forward(spec, x, weights, choices, chunks)[:, rows]

        def second():
            h = init["num_heads"]
            init2 = dict(init, d_in=init["d_in"] + 1, d_out=init["d_out"] + h)
            parts = [*(chunks or [x.shape[1]])]
            parts[0] += 1
            init2["context_length"] = sum(parts)
            r = np.random.default_rng(92)
            weights2 = sink_weights(r, init2)
            x2 = normal(r, x.shape[0], sum(parts), init2["d_in"])
            steps = cached_steps(x2, parts) if chunks else [{"method": "forward", "args": [x2]}]
            got = np.concatenate(stage.session(CLS, init2, weights2, steps=steps), axis=1)
            return got, lambda choices: S.forward(spec_of(init2), x2, weights2, choices, parts if chunks else None)

        def run(a, dtype="float32"):
            return stage.session(CLS, init, weights, steps=[{"method": "forward", "args": [a]}], dtype=dtype)[0]

        switches = S.switches(spec, init["d_in"], init["d_out"], chunks, bias=bool(init.get("qkv_bias")))
        if chunks and len(chunks) > 1 and np.allclose(run(x), S.forward(spec, x, weights), **FLOAT32):
            # Your forward without the cache is right: a mistake in what both paths share (the mask, the softmax)
            # cannot give these steps; only the cache's own switches are searched.
            switches = [s for s in switches if s.name in CACHED]
        cached = [lambda: cache_findings(stage, spec, init, x, weights, chunks, run)] if chunks else []
        return [Searched(compute, switches, "your output", second),
                Probed([*cached, lambda: exposed_findings(stage, spec),
                        *module_probes(run, x, may_see=S.allowed(spec, np.arange(x.shape[1]), np.arange(x.shape[1])),
                                       run64=lambda: run(x, "float64"))])]

    return [Deferred(make)]


CACHED = {"cache", "positions", "evict", "causal"}  # the switches of a sink module's cached path


def cache_findings(stage, spec, init, x, weights, chunks, run):
    """The cache's probes (diagnosis.caches): the learner's cached steps against its own forward without the cache
    (which step goes wrong first, and whether it is the first after the cache dropped positions), and the positions
    cache_positions records against those of the tokens the cache holds."""
    steps = []
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_positions"}]
    results = stage.session(CLS, init, weights, steps=steps)
    outputs, recorded = results[0::2], results[1::2]
    fed = np.cumsum(chunks)
    holds = [S.kept_positions(spec, int(n)) for n in fed]
    newest = None
    if recorded[-1] is not None and np.size(recorded[-1]):
        newest = (int(np.asarray(recorded[-1]).ravel()[-1]), int(holds[-1][-1]))
    found = C.session_findings(outputs, run(x), S.forward(spec, x, weights), chunks, kept=[len(h) for h in holds],
                               newest=newest)
    read = C.positions_findings(recorded, holds, chunks) if all(r is not None for r in recorded) else []
    if any(f.causes for f in read):  # (what the positions show decides what the steps' reading leaves open)
        found = [C.Finding(f.shows, (), f.mechanism, f.source, f.weight) for f in found]
    return found + read


def exposed_findings(stage, spec):
    """The learner's weights read through an exposing case (diagnosis.sinks.exposure): which keys each query sees,
    the temperature of the scores, and the share each row leaves to the sink."""
    t = max(6, (spec.window or 0) + spec.num_sink_tokens + 3)
    sinks = np.linspace(0.6, -0.8, spec.num_heads).astype(np.float32)
    sizes, x, weights, read = S.exposure(spec, t, sinks)
    observed = read(stage.session(CLS, sizes, weights, steps=[{"method": "forward", "args": [x]}])[0])
    h, g = spec.num_heads, spec.groups
    q = np.asarray(x, np.float64) @ weights["W_query.weight"].T.astype(np.float64)
    k = np.asarray(x, np.float64) @ weights["W_key.weight"].T.astype(np.float64)
    q = q.reshape(2, t, h, t).transpose(0, 2, 1, 3)
    k = np.repeat(k.reshape(2, t, g, t).transpose(0, 2, 1, 3), h // g, axis=1)
    scores = q @ np.swapaxes(k, -1, -2)
    positions = np.arange(t)
    mask = S.allowed(spec, positions, positions)
    scale = 1 / np.sqrt(t)
    name = "head_dim"
    switch = S.A.scaling_switch(Attention(), t, t + 2, h * t)
    divisors = {"sqrt(head_dim)": np.sqrt(t), "1": 1.0, "1/sqrt(head_dim)": 1 / np.sqrt(t), name: float(t),
                "sqrt(d_out)": np.sqrt(h * t), "sqrt(d_in)": np.sqrt(t + 2)}
    value_of = {"none": "1", "times": "1/sqrt(head_dim)", "no_sqrt": name, "d_out": "sqrt(d_out)",
                "d_in": "sqrt(d_in)"}
    words = {value_of[v]: w for v, w in switch.wrong.items()}
    found = weight_findings(ExposedWeights(observed, scores, mask, scale, divisors, words, positions, positions,
                                           spec.window, empty_rows="sinks", sink_tokens=spec.num_sink_tokens))
    return found + S.sink_findings(observed, scores, mask, scale, sinks)


def sink_shapes(d_in, d_out, num_heads, num_kv_groups=None, qkv_bias=False, **_):
    kv_width = (num_kv_groups or num_heads) * (d_out // num_heads)
    return {**linear_shapes("W_query", d_in, d_out, qkv_bias), **linear_shapes("W_key", d_in, kv_width, qkv_bias),
            **linear_shapes("W_value", d_in, kv_width, qkv_bias), **linear_shapes("out_proj", d_out, d_out),
            "sinks": (num_heads,)}


def sink_weights(rng, init):
    weights = random_weights(rng, sink_shapes(**init))
    weights["sinks"] = normal(rng, init["num_heads"])  # logits of the size of the scores
    return weights


def check_steps(stage, outputs, expected, chunks, x, weights, init, what=""):
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True) (rows {a}..{e - 1} of the full forward, "
                     f"chunks of {tuple(chunks)} tokens)", outputs[k], expected[:, a:e], **FLOAT32,
                     diagnosis=diagnosis(stage, init, x, weights, chunks, slice(a, e)))


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
    check_mask(stage, positions, positions, 3, 2)


@pytest.mark.public
def test_softmax_with_sinks_on_the_example(stage, public_fx):
    """Scores of 2 heads with masked keys, a row of large scores and a row with every key masked."""
    check_softmax(stage, "the example's scores and sinks", public_fx["softmax/scores"], public_fx["softmax/sinks"])


@pytest.mark.public
def test_forward_on_the_example(stage, public_fx):
    """The journey batch: 4 query heads of 5 features sharing 1 key/value head, a window of 3, 1 sink token, learned
    sinks (every size different: a swapped dimension cannot pass)."""
    init, x, weights, _ = case_of(public_fx)
    assert_close(f"{CLS}({init}) output", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights))


@pytest.mark.public
def test_streaming_decoding_on_the_example(stage, public_fx):
    """A prompt of 3 tokens, then one by one: each step equals the full forward, and the cache keeps the sink token
    and the last 3 positions only."""
    init, x, weights, chunks = case_of(public_fx)
    steps = []
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    check_steps(stage, results[0::2], public_fx.output, chunks, x, weights, init)
    for k, (_, e) in enumerate(spans(chunks)):
        check_kept(results[2 * k + 1], init, x.shape[0], e, f"after step {k} (tokens 0..{e - 1} fed)")


# ---------------------------------------------------------------- hidden

def test_sink_window_mask_at_other_positions(stage, rng):
    """Queries further on than the keys begin (a cache's positions), other windows, no window."""
    cases = [(np.arange(10, 13), np.array([0, 1, 8, 9, 10, 11, 12]), 3, 2), (np.arange(6), np.arange(6), None, 0),
             (np.arange(7), np.arange(7), 1, 0), (np.arange(11), np.arange(11), 4, 3)]
    t = int(rng.integers(3, 12))
    cases.append((np.arange(t), np.arange(t), int(rng.integers(1, t)), int(rng.integers(0, 3))))
    for q, k, window, sinks in cases:
        check_mask(stage, q, k, window, sinks)


def test_softmax_with_sinks_matches_numpy(stage, rng):
    """Random scores and sinks; large logits; a sink of -inf (none) gives softmax itself; rows with every key
    masked give weights 0 with a finite sink and with none (no NaN)."""
    scores = normal(rng, 2, 3, 4, 5, scale=3.0)
    scores[:, :, 1, 2:] = -np.inf
    scores[0, 1, 2] = -np.inf
    sinks = normal(rng, 3, scale=3.0)
    cases = [("random", scores, sinks), ("large logits", scores * 200, sinks * 200),
             ("no sink (-inf)", scores, np.full(3, -np.inf, np.float32)),
             ("every key masked, no sink", np.full((1, 2, 3, 4), -np.inf, np.float32), np.full(2, -np.inf, np.float32))]
    for name, s, z in cases:
        check_softmax(stage, name, s, z)


@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_stored_cases_full_and_cached(stage, hidden_fx, case):
    """Sink tokens and a window with 2 kv heads (case0); gpt-oss's layers, a window and learned sinks, one token at
    a time (case1); no window, learned sinks (case2)."""
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    assert_close(f"{init}: forward(x)", stage.forward(CLS, init, x, weights), hidden_fx[f"{case}/output"], **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights))
    *outputs, cache_k = stage.session(CLS, init, weights, steps=[*cached_steps(x, chunks), {"get": "cache_k"}])
    check_steps(stage, outputs, hidden_fx[f"{case}/output"], chunks, x, weights, init, f"{init}: ")
    check_kept(cache_k, init, x.shape[0], x.shape[1], "at the end")


def without_sinks(weights, num_heads):
    """Chapter 3's weights as SinkAttention's: sink logits of -inf (no sink)."""
    return {**weights, "sinks": np.full(num_heads, -np.inf, np.float32)}


def sized(init, d_in, d_out, context_length):
    return {**init, "d_in": d_in, "d_out": d_out, "context_length": context_length}


def test_without_sinks_or_window_it_is_causal_attention(stage, rng):
    """sinks = -inf (no sink) and no window: chapter 3's causal multi-head attention, diagnosed as chapter 3's
    (diagnosis.AttentionModule)."""
    def draw(r):
        heads, head_dim = int(r.integers(2, 4)), int(r.integers(2, 5))
        return dict(num_heads=heads, head_dim=head_dim, d_out=heads * head_dim, d_in=int(r.integers(2, 9)),
                    t=int(r.integers(3, 9)), b=int(r.integers(1, 4)))
    sizes = pairwise_distinct(rng, draw)
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], context_length=sizes["t"], num_heads=sizes["num_heads"],
                qkv_bias=True)
    weights = random_weights(rng, {k: v for k, v in sink_shapes(**init).items() if k != "sinks"})
    x = normal(rng, sizes["b"], sizes["t"], init["d_in"])
    module = AttentionModule(stage, CLS, init, Attention(num_heads=init["num_heads"]), without_sinks, sized)
    assert_close(f"{init} with sinks = -inf: forward(x)", module.run(x, weights),
                 S.A.forward(Attention(num_heads=init["num_heads"]), x, weights), **FLOAT32,
                 diagnosis=module.evidence(x, weights))


def test_the_cache_stays_bounded_over_a_long_text(stage, rng):
    """20 tokens one by one through 2 sink tokens and a window of 3: every output equals the full forward, and the
    cache never holds more than 5 positions."""
    init = dict(d_in=5, d_out=12, context_length=20, num_heads=4, num_kv_groups=1, window=3, num_sink_tokens=2)
    weights, x = sink_weights(rng, init), normal(rng, 2, 20, 5)
    steps = []
    for step in cached_steps(x, [1] * 20):
        steps += [step, {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    check_steps(stage, results[0::2], S.forward(spec_of(init), x, weights), [1] * 20, x, weights, init)
    for k in range(20):
        check_kept(results[2 * k + 1], init, 2, k + 1, f"after token {k}")


def random_init(rng):
    """Random sizes, pairwise distinct (batch, tokens, d_in, heads, key/value groups, head_dim, d_out)."""
    def draw(r):
        kv, group, head_dim = int(r.integers(1, 4)), int(r.integers(2, 4)), int(r.integers(2, 6))
        return dict(b=int(r.integers(1, 4)), t=int(r.integers(4, 12)), d_in=int(r.integers(2, 9)), num_kv_groups=kv,
                    num_heads=kv * group, head_dim=head_dim, d_out=kv * group * head_dim)
    sizes = pairwise_distinct(rng, draw)
    t = sizes["t"]
    window = None if rng.integers(4) == 0 else int(rng.integers(1, t))
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], context_length=t, num_heads=sizes["num_heads"],
                num_kv_groups=sizes["num_kv_groups"], window=window, num_sink_tokens=int(rng.integers(0, 3)),
                qkv_bias=bool(rng.integers(2)))
    return sizes["b"], t, init


def test_random_cases_against_the_reference(stage, reference, rng, device):
    """Random sizes, windows and sink tokens, random chunks, reset_cache() and a second sequence."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        b, t, init = random_init(rng)
        weights = sink_weights(rng, init)
        first, second = normal(rng, b, t, init["d_in"]), normal(rng, b, t, init["d_in"])
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(1, t)), replace=False))
        chunks = np.diff([0, *cuts, t]).tolist()
        steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1])]
        outputs = stage.session(CLS, init, weights, steps=steps, device=device)
        n = len(chunks)
        for seq, got, parts, what in ((first, outputs[:n], chunks, ""), (second, outputs[n + 1:], chunks[::-1],
                                                                         "after reset_cache(), ")):
            [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [seq]}])
            check_steps(stage, got, expected, parts, seq, weights, init, f"{init}: {what}")


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
    "cpu": dict(b=2, t=40, d_in=48, num_heads=8, head_dim=6, num_kv_groups=4, window=8, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_in=2880, num_heads=64, head_dim=64, num_kv_groups=8, window=128,
                 dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_in=96, num_heads=16, head_dim=12, num_kv_groups=2, window=16, dtypes=("bfloat16",)),
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
