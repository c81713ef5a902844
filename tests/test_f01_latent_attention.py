"""Stage f01: multi-head latent attention (DeepSeek-V2/V3).

Spec: MultiHeadLatentAttention(d_in, d_out, context_length, num_heads, kv_latent_dim, rope_dim, theta_base=10_000.0),
head_dim = d_out // num_heads: W_query = nn.Linear(d_in, num_heads * (head_dim + rope_dim)) (per head head_dim
content features, then rope_dim rotary ones), W_kv_down = nn.Linear(d_in, kv_latent_dim), kv_norm = RMSNorm
(weight kv_norm.weight), W_key_rope = nn.Linear(d_in, rope_dim) (one rotary key for all heads), W_key_up and
W_value_up = nn.Linear(kv_latent_dim, d_out) (no biases), out_proj = nn.Linear(d_out, d_out). Score of head h =
(q_content . W_key_up(c)_h + rope(q_rope) . rope(k_rope)) / sqrt(head_dim + rope_dim), causal, softmax, mixes
W_value_up(c)_h; RoPE in the halves layout at the tokens' positions. forward(x, use_cache=False, absorbed=False):
absorbed attends over the latents (W_key_up moved into the query, W_value_up after the mix), equal output; the
cache holds cache_latent (b, T, kv_latent_dim) and cache_k_rope (b, T, rope_dim) only. mla_cache_bytes_per_token
and mha_cache_bytes_per_token count the cache's bytes per token.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, Listed, Probed, Searched, assert_close
from diagnosis import caches as C
from diagnosis import latent as L
from diagnosis.modules import module_probes
from diagnosis.subjects import Deferred
from suite_runtime.cases import cached_steps, linear_shapes, normal, pairwise_distinct, random_weights, spans

pytestmark = pytest.mark.latent_attention
STAGE = "f01_latent_attention"
CLS = "MultiHeadLatentAttention"
# float32 against a float64 NumPy reference; the absorbed form and the cached steps sum in other orders.
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
EXPANDED = ("the cache holds per-head keys or values: MLA caches the latent (b, tokens, kv_latent_dim) and the rotary "
            "key (b, tokens, rope_dim) only, and expands them at every step")


# ---------------------------------------------------------------- what a failed check is diagnosed with

def spec_of(init):
    return L.Latent(init["num_heads"], init["rope_dim"], init.get("theta_base", 10_000.0))


def reference_of(init, x, weights):
    return L.forward(spec_of(init), x, weights)


def diagnosis(stage, init, x, weights, chunks=None, absorbed=False, rows=slice(None)):
    """What a failed check of the module's output (``rows`` of a decoding of x in ``chunks``; None: the full
    forward) is diagnosed with: latent attention's switches (diagnosis.latent) searched on this case and on a second
    one of other sizes, the attention weights read through an exposing case, and the probes of every module (which
    tokens each output depends on, batch rows, dtypes). Worked out only when the check fails."""
    def make():
        spec = spec_of(init)
        head_dim = init["d_out"] // init["num_heads"]

        def compute(choices):
            return L.forward(spec, x, weights, choices, chunks)[:, rows]

        def second():
            init2 = dict(init, d_in=init["d_in"] + 1, d_out=init["num_heads"] * (head_dim + 1),
                         kv_latent_dim=init["kv_latent_dim"] + 2, rope_dim=init["rope_dim"] + 2)
            parts = [*(chunks or [x.shape[1]])]
            parts[0] += 1
            init2["context_length"] = max(init["context_length"], sum(parts)) + 1
            r = np.random.default_rng(91)
            weights2 = mla_weights(r, init2)
            x2 = normal(r, x.shape[0], sum(parts), init2["d_in"])
            got = decode(stage, init2, weights2, x2, parts, absorbed) if chunks else \
                [full(stage, init2, weights2, x2, absorbed)]
            return np.concatenate(got, axis=1), lambda choices: L.forward(spec_of(init2), x2, weights2, choices,
                                                                           parts if chunks else None)

        def run(a, dtype="float32"):
            return full(stage, init, weights, a, absorbed, dtype=dtype)

        def exposed(sizes, xe, we):
            return full(stage, sizes, we, xe, absorbed)

        cached = [lambda: cache_findings(stage, init, x, weights, chunks, absorbed)] if chunks and len(chunks) > 1 \
            else []
        return [Searched(compute, L.switches(spec, head_dim, init["kv_latent_dim"], chunks), "your output", second),
                Probed([*cached, lambda: L.weight_probe(spec, exposed) or [],
                        *module_probes(run, x, run64=lambda: run(x, "float64"))])]

    return [Deferred(make)]


def cache_findings(stage, init, x, weights, chunks, absorbed):
    """The cache's probes (diagnosis.caches): this form's cached steps against its own forward without the cache, and
    against the other form's cached steps (each form reads the cache on its own path)."""
    right, own = reference_of(init, x, weights), full(stage, init, weights, x, absorbed)
    found = C.session_findings(decode(stage, init, weights, x, chunks, absorbed), own, right, chunks,
                               what=f"your {form(absorbed)}'s cached steps")
    decided = C.other_path_findings(form(absorbed), form(not absorbed), decode(stage, init, weights, x, chunks,
                                                                               not absorbed), own, right, chunks,
                                    f"the {form(absorbed)}'s cached path: the latents and rotary keys it reads from "
                                    "the cache, or the positions it rotates the new tokens at")
    if decided:
        found = [C.Finding(f.shows, (), f.mechanism, f.source, f.weight) for f in found]
    return found + decided


def full(stage, init, weights, x, absorbed=False, **options):
    """The learner's full forward (no cache) in the chosen form."""
    step = {"method": "forward", "args": [x], "kwargs": {"absorbed": absorbed}}
    return stage.session(CLS, init, weights, steps=[step], **options)[0]


def mla_shapes(d_in, d_out, num_heads, kv_latent_dim, rope_dim, **_):
    """MultiHeadLatentAttention's parameters, by their state_dict names."""
    return {"W_query.weight": (num_heads * (d_out // num_heads + rope_dim), d_in),
            "W_kv_down.weight": (kv_latent_dim, d_in), "kv_norm.weight": (kv_latent_dim,),
            "W_key_rope.weight": (rope_dim, d_in),
            "W_key_up.weight": (d_out, kv_latent_dim), "W_value_up.weight": (d_out, kv_latent_dim),
            **linear_shapes("out_proj", d_out, d_out)}


def mla_weights(rng, init):
    """Random weights for every parameter, kv_norm's weight near 1 (a norm's scale)."""
    weights = random_weights(rng, mla_shapes(**init))
    weights["kv_norm.weight"] = rng.uniform(0.5, 1.5, init["kv_latent_dim"]).astype(np.float32)
    return weights


def decode(stage, init, weights, x, chunks, absorbed=False, get_cache=False, **options):
    """x fed chunk by chunk to forward(use_cache=True, absorbed=...): each step's output (and, with get_cache,
    cache_latent and cache_k_rope after the last step)."""
    steps = cached_steps(x, chunks)
    for step in steps:
        step["kwargs"]["absorbed"] = absorbed
    if get_cache:
        steps += [{"get": "cache_latent"}, {"get": "cache_k_rope"}]
    return stage.session(CLS, init, weights, steps=steps, **options)


def form(absorbed):
    return "absorbed form" if absorbed else "expanded form"


def check_steps(stage, outputs, expected, chunks, init, x, weights, absorbed, what):
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True) (rows {a}..{e - 1} of the full causal "
                     f"forward, chunks of {tuple(chunks)} tokens)", outputs[k], expected[:, a:e], **FLOAT32,
                     diagnosis=diagnosis(stage, init, x, weights, chunks, absorbed, slice(a, e)))


def check_cache(cache_latent, cache_k_rope, init, b, tokens, when):
    shapes = {"cache_latent": (b, tokens, init["kv_latent_dim"]), "cache_k_rope": (b, tokens, init["rope_dim"])}
    for name, cache in (("cache_latent", cache_latent), ("cache_k_rope", cache_k_rope)):
        expected = shapes[name]
        assert cache is not None, f"{name} is None {when}; expected {expected}: forward(use_cache=True) fills it"
        assert np.shape(cache) == expected, (
            f"{name} has shape {np.shape(cache)} {when}; expected {expected}"
            + (f": {EXPANDED}" if np.size(cache) > np.prod(expected) else ""))


def case_of(fx, prefix=""):
    return fx.init(prefix), fx[f"{prefix}x"], fx.sub(f"{prefix}weights/"), fx[f"{prefix}chunks"].tolist()


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_full_forward_on_the_example(stage, public_fx, absorbed):
    """The journey batch through 4 heads of 5 content features, a latent of 7 and rotary parts of 8 (every size
    different: a swapped dimension cannot pass)."""
    init, x, weights, _ = case_of(public_fx)
    out = full(stage, init, weights, x, absorbed)
    assert_close(f"forward(x, absorbed={absorbed}) ({form(absorbed)})", out, public_fx.output, **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights, absorbed=absorbed))


@pytest.mark.public
@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_prompt_then_one_token_at_a_time(stage, public_fx, absorbed):
    """A prompt of 3 tokens, then tokens 3, 4 and 5: every step gives the full forward's rows."""
    init, x, weights, chunks = case_of(public_fx)
    check_steps(stage, decode(stage, init, weights, x, chunks, absorbed), public_fx.output, chunks, init, x, weights,
                absorbed, f"{form(absorbed)}, ")


@pytest.mark.public
def test_the_cache_holds_the_latent_and_the_rotary_key(stage, public_fx):
    """After the whole sequence: cache_latent = kv_norm(W_kv_down(x)), cache_k_rope = W_key_rope(x) rotated."""
    init, x, weights, chunks = case_of(public_fx)
    *_, cache_latent, cache_k_rope = decode(stage, init, weights, x, chunks, get_cache=True)
    check_cache(cache_latent, cache_k_rope, init, x.shape[0], x.shape[1], "after the whole sequence")
    spec = spec_of(init)
    latent, k_rope = L.cache(spec, x, weights, chunks)
    for part, (name, value, expected) in enumerate((("cache_latent", cache_latent, latent),
                                                    ("cache_k_rope", cache_k_rope, k_rope))):
        switches = [L.NORM] if part == 0 else [L.CACHED_ROPE, L.rope_switch().without("none"),
                                               L.C.POSITIONS.only("restart")]
        assert_close(name, value, expected, **FLOAT32, diagnosis=[Searched(
            lambda choices, part=part: L.cache(spec, x, weights, chunks, choices)[part], switches, f"your {name}")])


@pytest.mark.public
def test_cache_bytes_per_token_of_deepseek_v3(stage):
    """DeepSeek-V3 (61 layers, 128 heads of 128, kv_lora_rank 512, qk_rope_head_dim 64) in bfloat16: MLA caches
    70 272 bytes per token; multi-head attention with those heads would cache 3 997 696, grouped-query attention
    with 8 key/value heads 249 856."""
    check_bytes(stage, 512, 64, 61, 2)
    check_mha_bytes(stage, 128, 128, 61, 2)
    check_mha_bytes(stage, 8, 128, 61, 2)


def check_bytes(stage, latent, rope, layers, size):
    """mla_cache_bytes_per_token against (latent + rope) * layers * size, with what typical counts give."""
    args = f"{latent}, {rope}, {layers}" + (f", bytes_per_element={size}" if size != 2 else "")
    got = stage.mla_cache_bytes_per_token(latent, rope, layers, **({} if size == 2 else {"bytes_per_element": size}))
    mistakes = {
        "the latent was counted twice: ONE latent makes both the keys and the values, and one rotary key is cached "
        "beside it": [2 * (latent + rope) * layers * size, (2 * latent + rope) * layers * size],
        "the rotary key is missing: it is cached beside the latent": [latent * layers * size],
        "bytes_per_element was not used: multiply by the argument (2 for bfloat16)": [(latent + rope) * layers * 4,
                                                                                       (latent + rope) * layers],
        "the layers were not counted: each layer caches its own latent and rotary key": [(latent + rope) * size]}
    check_count(f"mla_cache_bytes_per_token({args})", got, (latent + rope) * layers * size,
                f"({latent} + {rope}) * {layers} * {size}", mistakes)


def check_mha_bytes(stage, heads, head_dim, layers, size):
    args = f"{heads}, {head_dim}, {layers}" + (f", bytes_per_element={size}" if size != 2 else "")
    got = stage.mha_cache_bytes_per_token(heads, head_dim, layers,
                                          **({} if size == 2 else {"bytes_per_element": size}))
    mistakes = {
        "only the keys (or only the values) were counted: a key AND a value of head_dim numbers per head, layer and "
        "token": [heads * head_dim * layers * size],
        "bytes_per_element was not used: multiply by the argument (2 for bfloat16)": [
            2 * heads * head_dim * layers * 4, 2 * heads * head_dim * layers],
        "the layers were not counted: each layer caches its own keys and values": [2 * heads * head_dim * size]}
    check_count(f"mha_cache_bytes_per_token({args})", got, 2 * heads * head_dim * layers * size,
                f"2 * {heads} * {head_dim} * {layers} * {size}", mistakes)


def check_count(name, got, expected, formula, mistakes):
    """A count of bytes: exact, with the counts that typical mistakes give (several may give the same number: each
    is then only a possibility)."""
    found = {why: values[0] for why, values in mistakes.items() if got in values and got != expected}
    assert_close(f"{name} (expected {formula} = {expected} bytes)", np.float64(got), np.float64(expected), rtol=0,
                 atol=0, diagnosis=[Listed({why: np.float64(value) for why, value in found.items()},
                                           "your count")])


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_every_step_of_each_form_on_stored_cases(stage, hidden_fx, case, absorbed):
    """Each form on its own (a mistake in one costs the other nothing): the full forward, then a cached decoding
    whose every step gives the full forward's rows, and the cache's shapes at the end."""
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    expected = hidden_fx[f"{case}/output"]
    assert_close(f"{init}: forward(x, absorbed={absorbed})", full(stage, init, weights, x, absorbed), expected,
                 **FLOAT32, diagnosis=diagnosis(stage, init, x, weights, absorbed=absorbed))
    *outputs, cache_latent, cache_k_rope = decode(stage, init, weights, x, chunks, absorbed, get_cache=True)
    check_steps(stage, outputs, expected, chunks, init, x, weights, absorbed, f"{init}, {form(absorbed)}, ")
    check_cache(cache_latent, cache_k_rope, init, x.shape[0], x.shape[1], "at the end")


def test_parameters(stage):
    init = dict(d_in=6, d_out=12, context_length=7, num_heads=3, kv_latent_dim=5, rope_dim=2)
    expected = {"W_query.weight": [18, 6], "W_kv_down.weight": [5, 6], "kv_norm.weight": [5],
                "W_key_rope.weight": [2, 6], "W_key_up.weight": [12, 5], "W_value_up.weight": [12, 5],
                "out_proj.weight": [12, 12], "out_proj.bias": [12]}
    params = stage.inspect(CLS, init)["parameters"]
    assert params == expected, (
        f"{CLS}({init}) parameters {params}; expected {expected}: one rotary key of rope_dim features shared by every "
        "head (W_key_rope), the latent's down-projection and the two up-projections from it, no biases but out_proj's")


def random_init(rng):
    """Random sizes, pairwise distinct (tokens, d_in, heads, head_dim, d_out, latent, rope, context)."""
    def draw(r):
        heads, head_dim = int(r.integers(2, 4)), int(r.integers(2, 6))
        t = int(r.integers(3, 10))
        return dict(t=t, d_in=int(r.integers(2, 9)), num_heads=heads, head_dim=head_dim, d_out=heads * head_dim,
                    kv_latent_dim=int(r.integers(1, 9)), rope_dim=2 * int(r.integers(1, 4)),
                    context_length=t + int(r.integers(1, 3)))
    sizes = pairwise_distinct(rng, draw)
    t = sizes.pop("t")
    sizes.pop("head_dim")
    return t, dict(sizes, theta_base=float(rng.choice([100.0, 10_000.0])))


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_random_cases_against_the_reference(stage, reference, rng, device, absorbed):
    """Random sizes; each form on its own, random chunks, reset_cache() and a second sequence."""
    ref = reference.stage(STAGE)
    t, init = random_init(rng)
    weights = mla_weights(rng, init)
    first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
    cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(1, t)), replace=False))
    chunks = np.diff([0, *cuts, t]).tolist()
    steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1])]
    for step in steps:
        step.get("kwargs", {})["absorbed"] = absorbed
    outputs = stage.session(CLS, init, weights, steps=steps, device=device)
    n = len(chunks)
    for seq, got, parts in ((first, outputs[:n], chunks), (second, outputs[n + 1:], chunks[::-1])):
        [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [seq]}])
        check_steps(stage, got, expected, parts, init, seq, weights, absorbed,
                    f"{init}, {form(absorbed)}{', after reset_cache()' if seq is second else ''}, ")


def test_absorbed_decoding_never_expands_the_cache(stage, rng):
    """Decoding one token with 48 tokens cached, the absorbed form makes no tensor as large as the cached tokens'
    per-head keys (b * tokens * d_out numbers): it attends over the latents. (Seen by the largest tensor any torch
    function returned during that step.)"""
    init = dict(d_in=10, d_out=24, context_length=49, num_heads=4, kv_latent_dim=5, rope_dim=2)
    weights = mla_weights(rng, init)
    x = normal(rng, 1, 49, 10)
    steps = [{"method": "forward", "args": [x[:, :48]], "kwargs": {"use_cache": True, "absorbed": True}},
             {"method": "forward", "args": [x[:, 48:]], "kwargs": {"use_cache": True, "absorbed": True},
              "measure": True}]
    _, measured = stage.session(CLS, init, weights, steps=steps)
    assert_close("the absorbed step's output", measured["result"], reference_of(init, x, weights)[:, 48:], **FLOAT32,
                 diagnosis=diagnosis(stage, init, x, weights, [48, 1], True, slice(48, 49)))
    expanded = 48 * init["d_out"]
    assert measured["largest"] < expanded, (
        f"decoding one token in the absorbed form made a tensor of {measured['largest']} numbers, at least as many as "
        f"the cached tokens' per-head keys hold (48 * d_out = {expanded}).\n"
        "Likely mistake: the absorbed form applied W_key_up or W_value_up to the cached latents; it attends over the "
        "latents themselves: W_key_up's rows of each head move into the query, W_value_up applies after the weights "
        "have mixed the latents.")


def test_cache_bytes_per_token(stage, rng):
    for _ in range(3):
        latent, rope, layers = int(rng.integers(1, 1024)), 2 * int(rng.integers(1, 64)), int(rng.integers(2, 100))
        heads, head_dim, size = int(rng.integers(2, 129)), int(rng.integers(1, 257)), int(rng.choice([1, 3, 4]))
        check_bytes(stage, latent, rope, layers, size)
        check_mha_bytes(stage, heads, head_dim, layers, size)


def torch_mla(x, weights, num_heads, rope_dim, theta_base, device):
    """The full causal forward computed by the test in float32 on ``device``: the rotary key broadcast to every
    head and concatenated to the content keys, F.scaled_dot_product_attention (which scales by 1/sqrt of the
    keys' width, head_dim + rope_dim)."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    x = torch.from_numpy(x).to(device)
    b, t, _ = x.shape
    d_out = w["out_proj.weight"].shape[0]
    hd = d_out // num_heads
    a = np.arange(t)[:, None] * theta_base ** (-np.arange(0, rope_dim, 2) / rope_dim)
    a = np.concatenate([a, a], axis=-1)
    cos, sin = (torch.from_numpy(f(a)).float().to(device) for f in (np.cos, np.sin))

    def rotate(u):
        return u * cos + torch.cat([-u[..., rope_dim // 2:], u[..., :rope_dim // 2]], dim=-1) * sin

    q = (x @ w["W_query.weight"].T).view(b, t, num_heads, hd + rope_dim).transpose(1, 2)
    q = torch.cat([q[..., :hd], rotate(q[..., hd:])], dim=-1)
    c = x @ w["W_kv_down.weight"].T
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * w["kv_norm.weight"]
    k_rope = rotate(x @ w["W_key_rope.weight"].T)[:, None].expand(b, num_heads, t, rope_dim)
    k = torch.cat([(c @ w["W_key_up.weight"].T).view(b, t, num_heads, hd).transpose(1, 2), k_rope], dim=-1)
    v = (c @ w["W_value_up.weight"].T).view(b, t, num_heads, hd).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d_out)
    return (out @ w["out_proj.weight"].T + w["out_proj.bias"]).cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is DeepSeek-V2-Lite's attention (d_model 2048,
    # 16 heads of 128 content features, kv_lora_rank 512, qk_rope_head_dim 64)
    "cpu": dict(b=2, t=40, d_model=64, num_heads=4, kv_latent_dim=12, rope_dim=8, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_model=2048, num_heads=16, kv_latent_dim=512, rope_dim=64, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_model=240, num_heads=16, kv_latent_dim=48, rope_dim=10, dtypes=("bfloat16",)),
}


def test_deepseek_sized_prompt_then_tokens(stage, target):
    """A long prompt, then 3 tokens one by one in the absorbed form, in bfloat16 (and float32 in the CPU twin), against
    the test's own float32 computation at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(101)
    d, h, latent, rope = size["d_model"], size["num_heads"], size["kv_latent_dim"], size["rope_dim"]
    init = dict(d_in=d, d_out=d, context_length=size["t"], num_heads=h, kv_latent_dim=latent, rope_dim=rope)
    # Normal weights of std 1/sqrt(fan_in): queries, latents and keys of unit size, scores of std about 1.
    shapes = {"W_query": (h * (d // h + rope), d), "W_kv_down": (latent, d), "W_key_rope": (rope, d),
              "W_key_up": (d, latent), "W_value_up": (d, latent), "out_proj": (d, d)}
    weights = {f"{n}.weight": (r.normal(size=s) / np.sqrt(s[1])).astype(np.float32) for n, s in shapes.items()}
    weights["kv_norm.weight"] = np.ones(latent, np.float32)
    weights["out_proj.bias"] = np.zeros(d, np.float32)
    x = normal(r, size["b"], size["t"], d)
    expected = torch_mla(x, weights, h, rope, 10_000.0, device)
    chunks = [size["t"] - 3, 1, 1, 1]
    for dtype in size["dtypes"]:
        outputs = decode(stage, init, weights, x, chunks, absorbed=True, device=device, dtype=dtype)
        for k, (a, e) in enumerate(spans(chunks)):
            assert_close(f"{device}, {dtype}: absorbed step {k} (tokens {a}..{e - 1})", outputs[k], expected[:, a:e],
                         **TOLERANCE[dtype])
