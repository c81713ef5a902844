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
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, causal, linear, np_rope, softmax, split_heads
from suite_runtime.cases import cached_steps, linear_shapes, normal, random_weights, spans

pytestmark = pytest.mark.latent_attention
STAGE = "f01_latent_attention"
CLS = "MultiHeadLatentAttention"
# float32 against a float64 NumPy reference; the absorbed form and the cached steps sum in other orders.
FLOAT32 = dict(rtol=1e-4, atol=1e-5)
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
SCALE = ("the scores were scaled by 1/sqrt(head_dim): a score sums head_dim content products AND rope_dim rotary "
         "ones, so scale by 1 / sqrt(head_dim + rope_dim)")
NO_NORM = "kv_norm was not applied: the latent is kv_norm(W_kv_down(x)), and it is the normalised latent that is cached"
NO_ROPE_SCORE = ("the rotary part of the scores is missing: add q_rope . k_rope (the one rotary key, broadcast over "
                 "the heads) to the content scores")
NO_ROPE = "RoPE was not applied: rotate q_rope and the rotary keys at the tokens' positions (apply_rope)"
RESTART = ("positions restart at 0 in each cached step: the new tokens' positions continue after the cached ones, "
           "offset = the number of tokens in the cache")
HEAD_SPLIT = ("the up-projection weights were split into heads the wrong way: W_key_up.weight and W_value_up.weight "
              "are (d_out, kv_latent_dim), head h owns rows h*head_dim .. (h+1)*head_dim - 1: "
              "weight.view(num_heads, head_dim, kv_latent_dim)")
EXPANDED = ("the cache holds per-head keys or values: MLA caches the latent (b, tokens, kv_latent_dim) and the rotary "
            "key (b, tokens, rope_dim) only, and expands them at every step")


# ---------------------------------------------------------------- NumPy reference (float64)

def np_rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight


def np_mla(x, weights, num_heads, rope_dim, theta_base=10_000.0, *, positions=None, scale="head_dim+rope_dim",
           norm=True, rope=True, rope_score=True, up_split="rows"):
    """MultiHeadLatentAttention's full causal forward in NumPy, with switches that reproduce typical mistakes:
    positions (each token's rotation position; default 0..T-1), scale "head_dim+rope_dim" (right) or "head_dim",
    norm (kv_norm applied), rope (rotation applied), rope_score (rotary part in the score), up_split "rows" (right)
    or "columns" (the up-projections' outputs split into heads with the head axis last)."""
    x = np.asarray(x, dtype=np.float64)
    b, t, _ = x.shape
    d_out = weights["out_proj.weight"].shape[0]
    hd = d_out // num_heads
    q = linear(x, weights, "W_query").reshape(b, t, num_heads, hd + rope_dim).transpose(0, 2, 1, 3)
    q_content, q_rope = q[..., :hd], q[..., hd:]
    latent = linear(x, weights, "W_kv_down")
    if norm:
        latent = np_rms_norm(latent, weights["kv_norm.weight"])
    k_rope = linear(x, weights, "W_key_rope")  # (b, t, rope_dim)
    positions = np.arange(t) if positions is None else positions
    if rope:
        q_rope, k_rope = np_rope(q_rope, positions, theta_base), np_rope(k_rope, positions, theta_base)

    def heads(a):  # (b, t, d_out) -> (b, num_heads, t, head_dim)
        if up_split == "rows":
            return split_heads(a, num_heads)
        return a.reshape(b, t, hd, num_heads).transpose(0, 3, 1, 2)

    keys, values = heads(linear(latent, weights, "W_key_up")), heads(linear(latent, weights, "W_value_up"))
    scores = q_content @ keys.transpose(0, 1, 3, 2)
    if rope_score:
        scores = scores + q_rope @ k_rope[:, None].transpose(0, 1, 3, 2)
    scores = scores / np.sqrt(hd + rope_dim if scale == "head_dim+rope_dim" else hd)
    context = softmax(causal(scores)) @ values  # (b, num_heads, t, head_dim)
    return linear(context.transpose(0, 2, 1, 3).reshape(b, t, d_out), weights, "out_proj")


def mla_mistakes(init, x, weights, rows=slice(None), chunks=None):
    """{description: the output's tokens ``rows``} of the typical MLA mistakes; chunks: those of a cached decoding."""
    run = partial(np_mla, x, weights, init["num_heads"], init["rope_dim"], init.get("theta_base", 10_000.0))
    found = {SCALE: run(scale="head_dim"), NO_NORM: run(norm=False), NO_ROPE_SCORE: run(rope_score=False),
             NO_ROPE: run(rope=False)}
    if init["num_heads"] > 1 and init["d_out"] // init["num_heads"] > 1:
        found[HEAD_SPLIT] = run(up_split="columns")
    if chunks is not None and len(chunks) > 1:
        found[RESTART] = run(positions=np.concatenate([np.arange(size) for size in chunks]))
    return {why: out[:, rows] for why, out in found.items()}


def reference_of(init, x, weights):
    return np_mla(x, weights, init["num_heads"], init["rope_dim"], init.get("theta_base", 10_000.0))


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


def check_steps(outputs, expected, chunks, init, x, weights, what):
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **FLOAT32, mistakes=partial(mla_mistakes, init, x, weights, slice(a, e), chunks),
                     hint=f"Expected: rows {a}..{e - 1} of the full causal forward (chunks of {tuple(chunks)} tokens).")


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
    """The journey batch through 2 heads of 2 content features, a latent of 2 and rotary parts of 2."""
    init, x, weights, _ = case_of(public_fx)
    step = {"method": "forward", "args": [x], "kwargs": {"absorbed": absorbed}}
    [out] = stage.session(CLS, init, weights, steps=[step])
    assert_close(f"forward(x, absorbed={absorbed}) ({form(absorbed)})", out, public_fx.output, **FLOAT32,
                 mistakes=lambda: mla_mistakes(init, x, weights))


@pytest.mark.public
@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_prompt_then_one_token_at_a_time(stage, public_fx, absorbed):
    """A prompt of 3 tokens, then tokens 3, 4 and 5: every step gives the full forward's rows."""
    init, x, weights, chunks = case_of(public_fx)
    check_steps(decode(stage, init, weights, x, chunks, absorbed), public_fx.output, chunks, init, x, weights,
                f"{form(absorbed)}, ")


@pytest.mark.public
def test_the_cache_holds_the_latent_and_the_rotary_key(stage, public_fx):
    """After the whole sequence: cache_latent = kv_norm(W_kv_down(x)), cache_k_rope = W_key_rope(x) rotated."""
    init, x, weights, chunks = case_of(public_fx)
    *_, cache_latent, cache_k_rope = decode(stage, init, weights, x, chunks, get_cache=True)
    check_cache(cache_latent, cache_k_rope, init, x.shape[0], x.shape[1], "after the whole sequence")
    latent = linear(x.astype(np.float64), weights, "W_kv_down")
    assert_close("cache_latent", cache_latent, np_rms_norm(latent, weights["kv_norm.weight"]), **FLOAT32,
                 mistakes={NO_NORM: latent})
    k_rope = linear(x.astype(np.float64), weights, "W_key_rope")
    assert_close("cache_k_rope", cache_k_rope, np_rope(k_rope, np.arange(x.shape[1])), **FLOAT32,
                 mistakes={"the rotary keys were cached before RoPE: cache them rotated at their positions (a "
                           "key's rotation depends on its own position only)": k_rope,
                           RESTART: np_rope(k_rope, np.concatenate([np.arange(n) for n in chunks]))})


@pytest.mark.public
def test_cache_bytes_per_token_of_deepseek_v3(stage):
    """DeepSeek-V3 (61 layers, 128 heads of 128, kv_lora_rank 512, qk_rope_head_dim 64) in bfloat16: MLA caches
    70 272 bytes per token; multi-head attention with those heads would cache 3 997 696, grouped-query attention
    with 8 key/value heads 249 856."""
    mla = stage.mla_cache_bytes_per_token(512, 64, 61)
    assert mla == 70_272, (
        f"mla_cache_bytes_per_token(512, 64, 61) = {mla}, expected (512 + 64) * 61 * 2 = 70272 bytes: one latent and "
        "one rotary key per token and layer, 2 bytes each (bfloat16)"
        + ("; the latent was counted twice: ONE latent makes both the keys and the values" if mla == 2 * 70_272 else "")
        + ("; the rotary key is missing: it is cached beside the latent" if mla == 512 * 61 * 2 else ""))
    mha = stage.mha_cache_bytes_per_token(128, 128, 61)
    assert mha == 3_997_696, (
        f"mha_cache_bytes_per_token(128, 128, 61) = {mha}, expected 2 * 128 * 128 * 61 * 2 = 3997696: a key AND a "
        "value of head_dim numbers per head, layer and token" + ("; only the keys were counted" if mha == 1_998_848
                                                                 else ""))
    gqa = stage.mha_cache_bytes_per_token(8, 128, 61)
    assert gqa == 249_856, f"mha_cache_bytes_per_token(8, 128, 61) = {gqa}, expected 2 * 8 * 128 * 61 * 2 = 249856"


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_both_forms_and_every_step_on_stored_cases(stage, hidden_fx, case):
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    expected = hidden_fx[f"{case}/output"]
    assert_close(f"{init}: forward(x)", stage.forward(CLS, init, x, weights), expected, **FLOAT32,
                 mistakes=partial(mla_mistakes, init, x, weights))
    for absorbed in (False, True):
        *outputs, cache_latent, cache_k_rope = decode(stage, init, weights, x, chunks, absorbed, get_cache=True)
        check_steps(outputs, expected, chunks, init, x, weights, f"{init}, {form(absorbed)}, ")
        check_cache(cache_latent, cache_k_rope, init, x.shape[0], x.shape[1], "at the end")


def test_parameters(stage):
    init = dict(d_in=6, d_out=12, context_length=5, num_heads=3, kv_latent_dim=4, rope_dim=2)
    expected = {"W_query.weight": [18, 6], "W_kv_down.weight": [4, 6], "kv_norm.weight": [4],
                "W_key_rope.weight": [2, 6], "W_key_up.weight": [12, 4], "W_value_up.weight": [12, 4],
                "out_proj.weight": [12, 12], "out_proj.bias": [12]}
    params = stage.inspect(CLS, init)["parameters"]
    assert params == expected, (
        f"{CLS}({init}) parameters {params}; expected {expected}: one rotary key of rope_dim features shared by every "
        "head (W_key_rope), the latent's down-projection and the two up-projections from it, no biases but out_proj's")


def test_random_cases_against_the_reference(stage, reference, rng, device):
    """Random sizes; both forms, random chunks, reset_cache() and a second sequence."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        num_heads, head_dim = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        t = int(rng.integers(2, 9))
        init = dict(d_in=int(rng.integers(2, 7)), d_out=num_heads * head_dim,
                    context_length=t + int(rng.integers(0, 3)), num_heads=num_heads,
                    kv_latent_dim=int(rng.integers(1, 5)), rope_dim=2 * int(rng.integers(1, 3)),
                    theta_base=float(rng.choice([100.0, 10_000.0])))
        weights = mla_weights(rng, init)
        first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(0, t)), replace=False))
        chunks = np.diff([0, *cuts, t]).tolist()
        absorbed = bool(rng.integers(2))
        steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1])]
        for step in steps:
            step.get("kwargs", {})["absorbed"] = absorbed
        outputs = stage.session(CLS, init, weights, steps=steps, device=device)
        n = len(chunks)
        for seq, got, parts in ((first, outputs[:n], chunks), (second, outputs[n + 1:], chunks[::-1])):
            [expected] = ref.session(CLS, init, weights, steps=[{"method": "forward", "args": [seq]}])
            check_steps(got, expected, parts, init, seq, weights,
                        f"{init}, {form(absorbed)}{', after reset_cache()' if seq is second else ''}, ")


def test_absorbed_decoding_never_expands_the_cache(stage, rng):
    """Decoding one token with 48 tokens cached, the absorbed form makes no tensor as large as the cached tokens'
    per-head keys (b * tokens * d_out numbers): it attends over the latents. (Seen by the largest tensor any torch
    function returned during that step.)"""
    init = dict(d_in=8, d_out=32, context_length=49, num_heads=4, kv_latent_dim=4, rope_dim=2)
    weights = mla_weights(rng, init)
    x = normal(rng, 1, 49, 8)
    steps = [{"method": "forward", "args": [x[:, :48]], "kwargs": {"use_cache": True, "absorbed": True}},
             {"method": "forward", "args": [x[:, 48:]], "kwargs": {"use_cache": True, "absorbed": True},
              "measure": True}]
    _, measured = stage.session(CLS, init, weights, steps=steps)
    assert_close("the absorbed step's output", measured["result"], reference_of(init, x, weights)[:, 48:], **FLOAT32,
                 mistakes=partial(mla_mistakes, init, x, weights, slice(48, 49), [48, 1]))
    expanded = 48 * init["d_out"]
    assert measured["largest"] < expanded, (
        f"decoding one token in the absorbed form made a tensor of {measured['largest']} numbers; the cached tokens' "
        f"per-head keys alone hold 48 * d_out = {expanded}: the absorbed form must not apply W_key_up or W_value_up to "
        "the cached latents. Move W_key_up into the query (its head's rows, transposed) and apply W_value_up after the "
        "weights have mixed the latents.")


def test_cache_bytes_per_token(stage, rng):
    for _ in range(3):
        latent, rope, layers = int(rng.integers(1, 1024)), 2 * int(rng.integers(0, 64)), int(rng.integers(1, 100))
        heads, head_dim, size = int(rng.integers(1, 129)), int(rng.integers(1, 257)), int(rng.choice([1, 2, 4]))
        got = stage.mla_cache_bytes_per_token(latent, rope, layers, bytes_per_element=size)
        assert got == (latent + rope) * layers * size, (
            f"mla_cache_bytes_per_token({latent}, {rope}, {layers}, bytes_per_element={size}) = {got}, expected "
            f"({latent} + {rope}) * {layers} * {size} = {(latent + rope) * layers * size}")
        got = stage.mha_cache_bytes_per_token(heads, head_dim, layers, bytes_per_element=size)
        assert got == 2 * heads * head_dim * layers * size, (
            f"mha_cache_bytes_per_token({heads}, {head_dim}, {layers}, bytes_per_element={size}) = {got}, expected "
            f"2 * {heads} * {head_dim} * {layers} * {size} = {2 * heads * head_dim * layers * size}")


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
    "cpu": dict(b=2, t=40, d_model=64, num_heads=4, kv_latent_dim=16, rope_dim=8, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, t=4096, d_model=2048, num_heads=16, kv_latent_dim=512, rope_dim=64, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_model=256, num_heads=16, kv_latent_dim=64, rope_dim=16, dtypes=("bfloat16",)),
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
