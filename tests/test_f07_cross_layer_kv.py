"""Stage f07: keys and values shared across layers (Cross-Layer Attention, Gemma 3n, YOCO).

Spec: cla_kv_sources(num_layers, share_every)[l] = l - l % share_every; shared_tail_kv_sources(num_layers,
num_shared)[l] = l for the first num_layers - num_shared layers, the last of them for the others;
cache_bytes_per_token(kv_sources, num_kv_heads, head_dim, bytes_per_element=2) = 2 * (layers with kv_sources[l] == l)
* num_kv_heads * head_dim * bytes. CrossLayerKVStack(d_model, context_length, num_heads, kv_sources,
num_kv_groups=None): layers.{l}.W_query, layers.{l}.out_proj, and W_key / W_value (num_kv_groups * head_dim outputs,
no bias) only in layers with kv_sources[l] == l; h <- h + causal grouped-query attention of h's queries over the keys
and values layer kv_sources[l] made from ITS input; forward(x, use_cache=False); cache_k / cache_v lists with one
(b, num_kv_groups, tokens_so_far, head_dim) tensor per computing layer, in layer order.
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import assert_close, causal, linear, softmax, split_heads
from suite_runtime.cases import linear_shapes, normal, random_weights, spans

pytestmark = pytest.mark.cross_layer_kv
STAGE = "f07_cross_layer_kv"
CLS = "CrossLayerKVStack"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only (a few layers deep)
# bfloat16 through a stack of 4 layers: each layer's residual add rounds the stream (values up to ~5 here) by up to
# 2**-8 of its size, about 0.02, and the 4 roundings add up (seen on the CPU: 0.056); a sharing mistake moves outputs
# by far more than 0.1.
TOLERANCE = {"float32": FLOAT32, "bfloat16": dict(rtol=0.1, atol=0.1)}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
CLA_BLOCK_INDEX = ("the group's index was taken for a layer: layer l reads layer l - l % share_every, the first "
                   "layer of its group (l // share_every numbers the groups)")
TAIL_FIRST_SHARED = ("the shared layers point at the first of them: they read the last layer BEFORE them, "
                     "num_layers - num_shared - 1, which computes its own keys and values")
WEIGHTS_NOT_KV = ("the reusing layers applied their source's W_key and W_value to their OWN input: that shares "
                  "weights, not keys and values; attend to the keys and values the source layer made from its input")
NEW_KEYS_ONLY = ("in cached steps a reusing layer attended to its source's NEW keys only: it reads everything its "
                 "source has cached")
ALL_LAYERS_COUNTED = "every layer was counted: only the layers that compute keys and values (kv_sources[l] == l) cache"


def kv_shapes(init):
    """The stack's parameters by name: every layer's queries and out_proj, keys and values where it computes them."""
    d, h = init["d_model"], init["num_heads"]
    kv = (init.get("num_kv_groups") or h) * (d // h)
    shapes = {}
    for layer, source in enumerate(init["kv_sources"]):
        shapes |= {f"layers.{layer}.W_query.weight": (d, d), **linear_shapes(f"layers.{layer}.out_proj", d, d)}
        if layer == source:
            shapes |= {f"layers.{layer}.W_key.weight": (kv, d), f"layers.{layer}.W_value.weight": (kv, d)}
    return shapes


# ---------------------------------------------------------------- NumPy reference (float64)

def np_stack(x, weights, init, chunks=None, mistake=None):
    """The stack's output in NumPy, fed in chunks (None: all at once) as a cached decoding does; ``mistake``
    reproduces one of the typical ones (by its description)."""
    x = np.asarray(x, np.float64)
    num_heads, sources = init["num_heads"], init["kv_sources"]
    kv_heads = init.get("num_kv_groups") or num_heads
    group = num_heads // kv_heads

    def kv_of(h, owner):
        return [split_heads(linear(h, weights, f"layers.{owner}.{n}"), kv_heads) for n in ("W_key", "W_value")]

    cache, outputs = {}, []  # cache: computing layer -> [keys, values] of every token so far
    for a, e in spans(chunks or [x.shape[1]]):
        h, fresh = x[:, a:e], {}
        for layer, source in enumerate(sources):
            if layer == source:
                fresh[layer] = kv_of(h, layer)
                old = cache.get(layer)
                cache[layer] = fresh[layer] if old is None else [np.concatenate(p, axis=2)
                                                                 for p in zip(old, fresh[layer])]
            if mistake == WEIGHTS_NOT_KV and source != layer:
                k, v = kv_of(h, source)
            else:
                k, v = fresh[source] if mistake == NEW_KEYS_ONLY and source != layer else cache[source]
            q = split_heads(linear(h, weights, f"layers.{layer}.W_query"), num_heads)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            n, m = q.shape[2], k.shape[2]
            future = np.triu(np.ones((n, m), bool), m - n + 1)
            w = softmax(np.where(future, -np.inf, q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])))
            h = h + linear((w @ v).transpose(0, 2, 1, 3).reshape(h.shape), weights, f"layers.{layer}.out_proj")
        outputs.append(h)
    return np.concatenate(outputs, axis=1)


def stack_mistakes(x, weights, init, chunks=None, rows=slice(None)):
    """The typical mistakes' outputs: sharing weights instead of keys and values (in the full forward, where such a
    layer sees its whole input), and, in cached steps, reading only the source's new keys."""
    if chunks is None:
        found = {WEIGHTS_NOT_KV: np_stack(x, weights, init, mistake=WEIGHTS_NOT_KV)}
    else:
        found = {NEW_KEYS_ONLY: np_stack(x, weights, init, chunks, NEW_KEYS_ONLY)} if len(chunks) > 1 else {}
    return {why: out[:, rows] for why, out in found.items()}


def check_decoding(stage, init, x, weights, chunks, what="", **options):
    """The full forward, then cached steps: each equals the full forward's rows; cache_k and cache_v hold one
    (b, num_kv_groups, tokens, head_dim) tensor per computing layer."""
    expected = np_stack(x, weights, init)
    steps = [{"method": "forward", "args": [x]}]
    steps += [{"method": "forward", "args": [x[:, a:e]], "kwargs": {"use_cache": True}} for a, e in spans(chunks)]
    full, *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=[*steps, {"get": "cache_k"},
                                                                                {"get": "cache_v"}], **options)
    assert_close(f"{what}forward(x)", full, expected, **FLOAT32, mistakes=partial(stack_mistakes, x, weights, init))
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}cached step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **FLOAT32, mistakes=partial(stack_mistakes, x, weights, init, chunks, slice(a, e)))
    computing = [layer for layer, source in enumerate(init["kv_sources"]) if source == layer]
    h = init["num_heads"]
    shape = (x.shape[0], init.get("num_kv_groups") or h, x.shape[1], init["d_model"] // h)
    for name, cache in (("cache_k", cache_k), ("cache_v", cache_v)):
        shapes = [np.shape(c) for c in (cache or ())]
        assert len(shapes) == len(computing) and all(s == shape for s in shapes), (
            f"{what}{name} holds {len(shapes)} tensors of shapes {shapes}; expected one per layer that computes keys "
            f"and values ({len(computing)}: layers {computing}), each (b, num_kv_groups, tokens, head_dim) = {shape}"
            + (": the layers that reuse keys and values cache nothing" if len(shapes) > len(computing) else ""))


def fx_case(fx, prefix=""):
    init = fx.init(prefix)
    init["kv_sources"] = fx[f"{prefix}kv_sources"].tolist()
    return init, fx[f"{prefix}x"], fx.sub(f"{prefix}weights/"), fx[f"{prefix}chunks"].tolist()


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_sharing_patterns(stage):
    """Cross-Layer Attention's groups and Gemma 3n's shared tail."""
    cla = list(stage.cla_kv_sources(6, 2))
    assert cla == [0, 0, 2, 2, 4, 4], (
        f"cla_kv_sources(6, 2) = {cla}, expected [0, 0, 2, 2, 4, 4]"
        + (f": {CLA_BLOCK_INDEX}" if cla == [0, 0, 1, 1, 2, 2] else ""))
    tail = list(stage.shared_tail_kv_sources(6, 2))
    assert tail == [0, 1, 2, 3, 3, 3], (
        f"shared_tail_kv_sources(6, 2) = {tail}, expected [0, 1, 2, 3, 3, 3]"
        + (f": {TAIL_FIRST_SHARED}" if tail == [0, 1, 2, 3, 4, 4] else ""))


@pytest.mark.public
def test_only_computing_layers_have_key_and_value_weights(stage):
    init = dict(d_model=8, context_length=6, num_heads=4, kv_sources=[0, 0, 2, 2], num_kv_groups=2)
    params = stage.inspect(CLS, init)["parameters"]
    expected = {name: list(shape) for name, shape in kv_shapes(init).items()}
    assert params == expected, (
        f"{CLS}(8, 6, 4, kv_sources=[0, 0, 2, 2], num_kv_groups=2) parameters {params}; expected {expected}: a layer "
        "that reuses another's keys and values has no W_key or W_value")


@pytest.mark.public
def test_stack_on_the_example(stage, public_fx):
    """4 layers in CLA groups of 2 (layers 1 and 3 reuse 0's and 2's keys and values), 2 query heads sharing 1
    key/value head: the full forward, then 3 + 1 + 1 + 1 cached tokens."""
    init, x, weights, chunks = fx_case(public_fx)
    assert_close("forward(x) (stored)", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 mistakes=partial(stack_mistakes, x, weights, init))
    check_decoding(stage, init, x, weights, chunks)


@pytest.mark.public
def test_cache_bytes_per_token(stage):
    """transformers' Gemma3nTextConfig defaults: 35 layers, the last 15 sharing, 2 key/value heads of 256, bfloat16:
    20 layers cache 40 960 bytes per token, where all 35 would cache 71 680."""
    sources = [layer if layer < 20 else 19 for layer in range(35)]
    got = stage.cache_bytes_per_token(sources, 2, 256)
    assert got == 40_960, (
        f"cache_bytes_per_token(Gemma 3n's sources, 2, 256) = {got}, expected 2 * 20 * 2 * 256 * 2 = 40960: a key "
        "and a value per key/value head, for each of the 20 layers that compute them"
        + (f"; {ALL_LAYERS_COUNTED}" if got == 71_680 else ""))


# ---------------------------------------------------------------- hidden

def test_sharing_patterns_at_other_sizes(stage, rng):
    num_layers = int(rng.integers(2, 30))
    share_every, num_shared = int(rng.integers(1, num_layers + 1)), int(rng.integers(0, num_layers))
    for name, got, expected, wrong in (
            (f"cla_kv_sources({num_layers}, {share_every})", stage.cla_kv_sources(num_layers, share_every),
             [layer - layer % share_every for layer in range(num_layers)],
             {CLA_BLOCK_INDEX: [layer // share_every for layer in range(num_layers)]}),
            (f"shared_tail_kv_sources({num_layers}, {num_shared})",
             stage.shared_tail_kv_sources(num_layers, num_shared),
             [min(layer, num_layers - num_shared - 1) if layer >= num_layers - num_shared else layer
              for layer in range(num_layers)],
             {TAIL_FIRST_SHARED: [min(layer, num_layers - num_shared) for layer in range(num_layers)]})):
        got = list(got)
        diagnosis = [why for why, value in wrong.items() if value == got and value != expected]
        assert got == expected, f"{name} = {got}, expected {expected}" + "".join(f": {d}" for d in diagnosis)


def test_cache_bytes_at_other_sizes(stage, rng):
    for sources in ([0, 0, 2, 2, 4, 4], list(range(5)), [0, 1, 1, 1], [0] * 7):
        heads, head_dim, size = int(rng.integers(1, 9)), int(rng.integers(1, 257)), int(rng.choice([1, 2, 4]))
        computing = sum(s == layer for layer, s in enumerate(sources))
        got = stage.cache_bytes_per_token(sources, heads, head_dim, bytes_per_element=size)
        expected = 2 * computing * heads * head_dim * size
        assert got == expected, (
            f"cache_bytes_per_token({sources}, {heads}, {head_dim}, bytes_per_element={size}) = {got}, expected "
            f"{expected} ({computing} layers compute keys and values)"
            + (f"; {ALL_LAYERS_COUNTED}" if got == 2 * len(sources) * heads * head_dim * size else ""))


@pytest.mark.parametrize("case", ["case0", "case1"])
def test_stored_stacks(stage, hidden_fx, case):
    """Gemma 3n's shared tail over 5 layers with 3 query heads per key/value head; YOCO's half-and-half over 4 layers
    with multi-query attention."""
    init, x, weights, chunks = fx_case(hidden_fx, f"{case}/")
    check_decoding(stage, init, x, weights, chunks, f"kv_sources {init['kv_sources']}: ")
    assert_close("forward(x) (stored)", stage.forward(CLS, init, x, weights), hidden_fx[f"{case}/output"], **FLOAT32)


def test_no_sharing_is_a_plain_stack(stage, rng):
    """kv_sources = [0, 1, 2]: every layer attends to its own input's keys and values (chapter 3's causal attention
    with a residual connection, layer after layer)."""
    init = dict(d_model=6, context_length=7, num_heads=2, kv_sources=[0, 1, 2])
    weights, x = random_weights(rng, kv_shapes(init)), normal(rng, 2, 7, 6)
    h = x.astype(np.float64)
    for layer in range(3):
        q, k, v = (split_heads(linear(h, weights, f"layers.{layer}.{n}"), 2) for n in ("W_query", "W_key", "W_value"))
        w = softmax(causal(q @ k.transpose(0, 1, 3, 2) / np.sqrt(3)))
        h = h + linear((w @ v).transpose(0, 2, 1, 3).reshape(h.shape), weights, f"layers.{layer}.out_proj")
    assert_close("forward(x) without sharing", stage.forward(CLS, init, x, weights), h, **FLOAT32)


def test_random_stacks_against_the_reference(stage, reference, rng, device):
    """Random depth, sharing pattern, heads and chunks; reset_cache() before a second sequence."""
    ref = reference.stage(STAGE)
    num_layers, kv = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    num_heads = kv * int(rng.integers(1, 3))
    share_every = int(rng.integers(2, num_layers + 1))
    sources = ([layer - layer % share_every for layer in range(num_layers)] if rng.integers(2)
               else [min(layer, num_layers - 2) for layer in range(num_layers)])  # CLA groups, or a shared tail
    init = dict(d_model=num_heads * int(rng.integers(1, 4)), context_length=12, num_heads=num_heads,
                kv_sources=sources, num_kv_groups=kv)
    weights = random_weights(rng, kv_shapes(init))
    t = int(rng.integers(3, 10))
    first, second = normal(rng, 2, t, init["d_model"]), normal(rng, 2, t, init["d_model"])
    chunks = [t - 2, 1, 1]
    check_decoding(stage, init, first, weights, chunks, f"kv_sources {sources}: ", device=device)
    steps = [{"method": "forward", "args": [first[:, :3]], "kwargs": {"use_cache": True}}, {"method": "reset_cache"},
             {"method": "forward", "args": [second[:, :t - 1]], "kwargs": {"use_cache": True}},
             {"method": "forward", "args": [second[:, t - 1:]], "kwargs": {"use_cache": True}}]
    *_, prompt, last = stage.session(CLS, init, weights, steps=steps, device=device)
    [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [second]}])
    assert_close(f"kv_sources {sources}: after reset_cache(), the second sequence",
                 np.concatenate([prompt, last], 1), expected, **FLOAT32,
                 hint="reset_cache() empties cache_k and cache_v: the next sequence starts afresh.")


def torch_stack(x, weights, init, device):
    """The test's own float32 full forward on ``device`` (SDPA with enable_gqa), for the large case."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    h = torch.from_numpy(x).to(device)
    b, t, d = h.shape
    heads, kv = init["num_heads"], init["num_kv_groups"]
    shared = {}
    for layer, source in enumerate(init["kv_sources"]):
        if layer == source:
            shared[layer] = tuple((h @ w[f"layers.{layer}.{n}.weight"].T).view(b, t, kv, -1).transpose(1, 2)
                                  for n in ("W_key", "W_value"))
        q = (h @ w[f"layers.{layer}.W_query.weight"].T).view(b, t, heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, *shared[source], is_causal=True, enable_gqa=True)
        h = h + out.transpose(1, 2).reshape(b, t, d) @ w[f"layers.{layer}.out_proj.weight"].T + w[
            f"layers.{layer}.out_proj.bias"]
    return h.cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case has Gemma 3n's attention sizes (d_model 2048, 8 query
    # heads of 256, 2 key/value heads), 4 layers of which the last 2 reuse the keys and values of layer 1, 4096 tokens
    "cpu": dict(b=2, t=40, d_model=64, num_heads=4, num_kv_groups=2, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_model=2048, num_heads=8, num_kv_groups=2, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_model=128, num_heads=8, num_kv_groups=2, dtypes=("bfloat16",)),
}


def test_gemma_sized_stack(stage, target):
    """A long prompt, then 3 tokens one by one, against the test's own float32 forward at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(701)
    init = dict(d_model=size["d_model"], context_length=size["t"], num_heads=size["num_heads"], kv_sources=[0, 1, 1, 1],
                num_kv_groups=size["num_kv_groups"])
    weights = {n: (r.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for n, s in kv_shapes(init).items()}
    for layer in range(4):
        weights[f"layers.{layer}.out_proj.bias"] = np.zeros(size["d_model"], np.float32)
    x = normal(r, size["b"], size["t"], size["d_model"])
    expected = torch_stack(x, weights, init, device)
    chunks = [size["t"] - 3, 1, 1, 1]
    steps = [{"method": "forward", "args": [x[:, a:e]], "kwargs": {"use_cache": True}} for a, e in spans(chunks)]
    for dtype in size["dtypes"]:
        outputs = stage.session(CLS, init, weights, steps=steps, device=device, dtype=dtype)
        for k, (a, e) in enumerate(spans(chunks)):
            assert_close(f"{device}, {dtype}: step {k} (tokens {a}..{e - 1})", outputs[k], expected[:, a:e],
                         **TOLERANCE[dtype])
