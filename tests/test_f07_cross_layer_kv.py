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
import numpy as np
import pytest

from diagnosis import Listed, Probed, Said, Searched, assert_close, diagnosed
from diagnosis import caches as C
from diagnosis import sharing as H
from diagnosis.modules import module_probes
from diagnosis.subjects import Deferred
from suite_runtime.cases import linear_shapes, normal, pairwise_distinct, random_weights, spans

pytestmark = pytest.mark.cross_layer_kv
STAGE = "f07_cross_layer_kv"
CLS = "CrossLayerKVStack"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only (a few layers deep)
# bfloat16 through a stack of 4 layers: each layer's residual add rounds the stream (values up to ~5 here) by up to
# 2**-8 of its size, about 0.02, and the 4 roundings add up (seen on the CPU: 0.056); a sharing mistake moves outputs
# by far more than 0.1.
TOLERANCE = {"float32": FLOAT32, "bfloat16": dict(rtol=0.1, atol=0.1)}
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


# ---------------------------------------------------------------- what a failed check is diagnosed with

def spec_of(init):
    return H.Sharing(init["num_heads"], tuple(init["kv_sources"]), init.get("num_kv_groups"))


def np_stack(x, weights, init, chunks=None):
    return H.stack(x, weights, spec_of(init), chunks=chunks)


def diagnosis(stage, init, x, weights, chunks=None, rows=slice(None)):
    """What a failed check of the stack's output (``rows`` of a decoding in ``chunks``; None: one forward) is
    diagnosed with: the sharing's and attention's switches (diagnosis.sharing) searched, and the probes of every
    module."""
    def make():
        spec = spec_of(init)

        def run(a, dtype="float32"):
            return stage.session(CLS, init, weights, steps=[{"method": "forward", "args": [a]}], dtype=dtype)[0]

        def steps():
            cached = [{"method": "forward", "args": [x[:, a:e]], "kwargs": {"use_cache": True}}
                      for a, e in spans(chunks)]
            return C.session_findings(stage.session(CLS, init, weights, steps=cached), run(x),
                                      H.stack(x, weights, spec), chunks)

        return [Searched(lambda choices: H.stack(x, weights, spec, choices, chunks)[:, rows],
                         H.switches(spec, chunks), "your output"),
                Probed([*([steps] if chunks and len(chunks) > 1 else []),
                        *module_probes(run, x, run64=lambda: run(x, "float64"))])]

    return [Deferred(make)]


def check_sources(stage, kind, num_layers, n):
    """cla_kv_sources(num_layers, share_every=n) or shared_tail_kv_sources(num_layers, num_shared=n)."""
    name = f"{'cla_kv_sources' if kind == 'cla' else 'shared_tail_kv_sources'}({num_layers}, {n})"
    function = stage.cla_kv_sources if kind == "cla" else stage.shared_tail_kv_sources
    got = np.asarray(list(function(num_layers, n)), np.float64)
    assert_close(name, got, np.asarray(H.sources(kind, num_layers, n), np.float64), rtol=0, atol=0, diagnosis=[
        Searched(lambda choices: np.asarray(H.sources(kind, num_layers, n, choices), np.float64), [H.PATTERNS[kind]],
                 "your sources"),
        Said(lambda actual: H.source_findings(actual, what=name) if actual.ndim == 1 else [])])


def check_bytes(stage, sources, heads, head_dim, size=2):
    computing = sum(s == layer for layer, s in enumerate(sources))
    got = stage.cache_bytes_per_token(sources, heads, head_dim, **({} if size == 2 else {"bytes_per_element": size}))
    expected = 2 * computing * heads * head_dim * size
    mistakes = {ALL_LAYERS_COUNTED: [2 * len(sources) * heads * head_dim * size],
                "only the keys (or only the values) were counted: a key AND a value per key/value head of each "
                "computing layer": [computing * heads * head_dim * size],
                "bytes_per_element was not used: multiply by the argument": [2 * computing * heads * head_dim * 4,
                                                                            2 * computing * heads * head_dim]}
    found = {why: np.float64(values[0]) for why, values in mistakes.items() if got in values and got != expected}
    assert_close(f"cache_bytes_per_token({sources}, {heads}, {head_dim}, bytes_per_element={size}) (expected 2 * "
                 f"{computing} computing layers * {heads} * {head_dim} * {size} = {expected})", np.float64(got),
                 np.float64(expected), rtol=0, atol=0, diagnosis=[Listed(found, "your count")])


def check_decoding(stage, init, x, weights, chunks, what="", **options):
    """The full forward, then cached steps: each equals the full forward's rows; cache_k and cache_v hold one
    (b, num_kv_groups, tokens, head_dim) tensor per computing layer."""
    expected = np_stack(x, weights, init)
    steps = [{"method": "forward", "args": [x]}]
    steps += [{"method": "forward", "args": [x[:, a:e]], "kwargs": {"use_cache": True}} for a, e in spans(chunks)]
    full, *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=[*steps, {"get": "cache_k"},
                                                                                {"get": "cache_v"}], **options)
    assert_close(f"{what}forward(x)", full, expected, **FLOAT32, diagnosis=diagnosis(stage, init, x, weights))
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}cached step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **FLOAT32, diagnosis=diagnosis(stage, init, x, weights, chunks, slice(a, e)))
    computing = [layer for layer, source in enumerate(init["kv_sources"]) if source == layer]
    h = init["num_heads"]
    shape = (x.shape[0], init.get("num_kv_groups") or h, x.shape[1], init["d_model"] // h)
    for part, (name, cache) in enumerate((("cache_k", cache_k), ("cache_v", cache_v))):
        shapes = [np.shape(c) for c in (cache or ())]
        if not (len(shapes) == len(computing) and all(s == shape for s in shapes)):
            message = (f"{what}{name} holds {len(shapes)} tensors of shapes {shapes}; expected one per layer that "
                       f"computes keys and values ({len(computing)}: layers {computing}), each (b, num_kv_groups, "
                       f"tokens, head_dim) = {shape}")
            made = {}
            H.stack(x, weights, spec_of(init), cached=made)
            found = C.entries_findings(list(cache or ()), {layer: kv[part] for layer, kv in made.items()},
                                       list(init["kv_sources"]), name=name)
            raise diagnosed("\n".join([message, *(line for f in found for line in f.lines())]), found)


def fx_case(fx, prefix=""):
    init = fx.init(prefix)
    init["kv_sources"] = fx[f"{prefix}kv_sources"].tolist()
    return init, fx[f"{prefix}x"], fx.sub(f"{prefix}weights/"), fx[f"{prefix}chunks"].tolist()


# ---------------------------------------------------------------- public

@pytest.mark.public
def test_sharing_patterns(stage):
    """Cross-Layer Attention's groups and Gemma 3n's shared tail."""
    check_sources(stage, "cla", 6, 2)
    check_sources(stage, "tail", 6, 2)


@pytest.mark.public
def test_only_computing_layers_have_key_and_value_weights(stage):
    init = dict(d_model=15, context_length=6, num_heads=3, kv_sources=[0, 0, 2, 2], num_kv_groups=1)
    params = stage.inspect(CLS, init)["parameters"]
    expected = {name: list(shape) for name, shape in kv_shapes(init).items()}
    assert params == expected, (
        f"{CLS}(15, 6, 3, kv_sources=[0, 0, 2, 2], num_kv_groups=1) parameters {params}; expected {expected}: a layer "
        "that reuses another's keys and values has no W_key or W_value")


@pytest.mark.public
def test_stack_on_the_example(stage, public_fx):
    """4 layers in CLA groups of 2 (layers 1 and 3 reuse 0's and 2's keys and values), 3 query heads of 5 features
    sharing 1 key/value head: the full forward, then 3 + 1 + 1 + 1 cached tokens."""
    init, x, weights, chunks = fx_case(public_fx)
    assert_close("forward(x) (stored)", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights))
    check_decoding(stage, init, x, weights, chunks)


@pytest.mark.public
def test_cache_bytes_per_token(stage):
    """transformers' Gemma3nTextConfig defaults: 35 layers, the last 15 sharing, 2 key/value heads of 256, bfloat16:
    20 layers cache 40 960 bytes per token, where all 35 would cache 71 680."""
    check_bytes(stage, [layer if layer < 20 else 19 for layer in range(35)], 2, 256)


# ---------------------------------------------------------------- hidden

def test_sharing_patterns_at_other_sizes(stage, rng):
    num_layers = int(rng.integers(3, 30))
    check_sources(stage, "cla", num_layers, int(rng.integers(2, num_layers + 1)))
    check_sources(stage, "tail", num_layers, int(rng.integers(1, num_layers)))


def test_cache_bytes_at_other_sizes(stage, rng):
    for sources in ([0, 0, 2, 2, 4, 4], list(range(5)), [0, 1, 1, 1], [0] * 7):
        check_bytes(stage, sources, int(rng.integers(1, 9)), int(rng.integers(9, 257)), int(rng.choice([1, 2, 4])))


@pytest.mark.parametrize("case", ["case0", "case1"])
def test_stored_stacks(stage, hidden_fx, case):
    """Gemma 3n's shared tail over 5 layers with 3 query heads per key/value head; YOCO's half-and-half over 4 layers
    with multi-query attention."""
    init, x, weights, chunks = fx_case(hidden_fx, f"{case}/")
    assert_close("forward(x) (stored)", stage.forward(CLS, init, x, weights), hidden_fx[f"{case}/output"], **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights))
    check_decoding(stage, init, x, weights, chunks, f"kv_sources {init['kv_sources']}: ")


def test_no_sharing_is_a_plain_stack(stage, rng):
    """kv_sources = [0, 1, 2]: every layer attends to its own input's keys and values (chapter 3's causal attention
    with a residual connection, layer after layer)."""
    init = dict(d_model=10, context_length=7, num_heads=2, kv_sources=[0, 1, 2])
    weights, x = random_weights(rng, kv_shapes(init)), normal(rng, 1, 7, 10)
    assert_close("forward(x) without sharing", stage.forward(CLS, init, x, weights), np_stack(x, weights, init),
                 **FLOAT32, diagnosis=diagnosis(stage, init, x, weights))


def test_random_stacks_against_the_reference(stage, reference, rng, device):
    """Random depth, sharing pattern, heads and chunks; reset_cache() before a second sequence."""
    ref = reference.stage(STAGE)
    sizes = pairwise_distinct(rng, lambda r: dict(num_layers=int(r.integers(3, 6)), kv=int(r.integers(1, 3)),
                                                  group=int(r.integers(2, 4)), head_dim=int(r.integers(2, 5)),
                                                  b=int(r.integers(1, 4)), t=int(r.integers(5, 10))))
    num_layers, kv = sizes["num_layers"], sizes["kv"]
    num_heads = kv * sizes["group"]
    share_every = int(rng.integers(2, num_layers + 1))
    sources = ([layer - layer % share_every for layer in range(num_layers)] if rng.integers(2)
               else [min(layer, num_layers - 2) for layer in range(num_layers)])  # CLA groups, or a shared tail
    init = dict(d_model=num_heads * sizes["head_dim"], context_length=12, num_heads=num_heads,
                kv_sources=sources, num_kv_groups=kv)
    weights = random_weights(rng, kv_shapes(init))
    t = sizes["t"]
    first, second = normal(rng, sizes["b"], t, init["d_model"]), normal(rng, sizes["b"], t, init["d_model"])
    chunks = [t - 2, 1, 1]
    check_decoding(stage, init, first, weights, chunks, f"kv_sources {sources}: ", device=device)
    steps = [{"method": "forward", "args": [first[:, :3]], "kwargs": {"use_cache": True}}, {"method": "reset_cache"},
             {"method": "forward", "args": [second[:, :t - 1]], "kwargs": {"use_cache": True}},
             {"method": "forward", "args": [second[:, t - 1:]], "kwargs": {"use_cache": True}}]
    *_, prompt, last = stage.session(CLS, init, weights, steps=steps, device=device)
    [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [second]}])
    assert_close(f"kv_sources {sources}: after reset_cache() (which empties cache_k and cache_v: the next sequence "
                 "starts afresh), the second sequence", np.concatenate([prompt, last], 1), expected, **FLOAT32,
                 diagnosis=diagnosis(stage, init, second, weights, [t - 1, 1]))


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
    "cpu": dict(b=3, t=40, d_model=96, num_heads=8, num_kv_groups=2, dtypes=("float32", "bfloat16")),
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
