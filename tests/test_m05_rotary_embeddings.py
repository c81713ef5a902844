"""Stage m05: rotary position embeddings (RoPE) in Llama's halves layout.

Spec: rope_angles(head_dim, context_length, theta_base=10_000.0) -> (cos, sin), each (context_length,
head_dim): angle[p, i] = p * inv_freq[i % (head_dim/2)], inv_freq = theta_base ** (-arange(0, head_dim, 2)
/ head_dim), duplicated as cat([freqs, freqs]) (Hugging Face's Llama). apply_rope(x, cos, sin, offset=0)
rotates x (b, heads, T, head_dim) at positions offset..offset+T-1: x * cos + rotate_half(x) * sin,
rotate_half(x) = cat([-x2, x1]) (feature i pairs with feature i + head_dim/2). RoPEAttention(d_in, d_out,
context_length, num_heads, num_kv_groups=None, qkv_bias=False, theta_base=10_000.0): causal grouped-query
attention (W_key/W_value: num_kv_groups * head_dim outputs, keys/values repeat_interleave'd) with RoPE on
queries and keys only, scale 1/sqrt(head_dim), out_proj; forward(x, use_cache=False) with stage m03's cache
(cache_k (b, num_kv_groups, tokens_so_far, head_dim), positions continuing across cached steps), reset_cache()
(cache_k = cache_v = None); forward(x) without the cache starts at position 0 whatever the cache holds. apply_rope
keeps x's dtype (float64 stays float64); a rotation keeps every vector's length, and a score of q rotated at m with
k rotated at n depends on m - n alone.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, Attention, Probed, assert_close
from diagnosis.attention import forward
from diagnosis.caches import CachedModule
from diagnosis.rotary import AnglesFunction, RotateFunction, angle_findings, angles, rotate, rotation_findings
from diagnosis.subjects import sizes_as_given
from suite_runtime.cases import distinct_sizes, normal, random_weights

pytestmark = pytest.mark.rotary_embeddings
STAGE = "m05_rotary_embeddings"
CLS = "RoPEAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


# ---------------------------------------------------------------- what the diagnoser runs again

def spec_of(init):
    """What RoPEAttention computes (diagnosis.attention): causal grouped-query attention with out_proj, RoPE on the
    queries and keys at theta_base."""
    return Attention(num_heads=init["num_heads"], num_kv_groups=init.get("num_kv_groups"),
                     rope_theta=float(init.get("theta_base", 10_000.0)))


def apply_of(stage):
    return lambda x, cos, sin, offset=0: stage.apply_rope(x, cos, sin, offset=offset)


def module(stage, init, **options):
    """RoPEAttention as the diagnoser runs it again (diagnosis.caches), with the readings of the stage's own
    apply_rope and rope_angles (diagnosis.rotary)."""
    head_dim = init["d_out"] // init["num_heads"]
    theta = float(init.get("theta_base", 10_000.0))
    probes = (lambda: rotation_findings(apply_of(stage)),
              lambda: angle_findings(np.stack(stage.rope_angles(head_dim, 8, theta)), head_dim, theta))
    return CachedModule(stage, CLS, init, spec_of(init), sized=sizes_as_given, options=options, more_probes=probes)


def reference_of(init, x, weights):
    """The full forward in NumPy float64 (diagnosis.attention)."""
    return forward(spec_of(init), x, weights)


def rope_case(rng, t, num_heads=None, num_kv_groups=None, qkv_bias=None, theta_base=None, b=None):
    """A random RoPEAttention case: batch, query heads, kv heads, head_dim (even), d_out, d_in and tokens pairwise
    distinct (those given fixed); returns init, x, weights."""
    ranges = dict(b=(b or 1, b or 3), num_heads=(num_heads or 2, num_heads or 6), half=(1, 4), d_in=(2, 11))
    sizes = distinct_sizes(rng, ranges, lambda s: {"t": t, "head_dim": 2 * s["half"], "d_out": 2 * s["half"] *
                                                   s["num_heads"], "groups": num_kv_groups or next(
                                                       (g for g in range(s["num_heads"] - 1, 0, -1)
                                                        if s["num_heads"] % g == 0), 1)})
    num_heads, num_kv_groups = sizes["num_heads"], sizes["groups"]
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], context_length=t + int(rng.integers(0, 4)),
                num_heads=num_heads, num_kv_groups=num_kv_groups,
                qkv_bias=bool(rng.integers(2)) if qkv_bias is None else qkv_bias,
                theta_base=float(rng.choice([100.0, 10_000.0, 500_000.0])) if theta_base is None else theta_base)
    kv, d_in = num_kv_groups * sizes["head_dim"], sizes["d_in"]
    shapes = {"W_query.weight": (init["d_out"], d_in), "W_key.weight": (kv, d_in), "W_value.weight": (kv, d_in)}
    if init["qkv_bias"]:
        shapes.update({"W_query.bias": (init["d_out"],), "W_key.bias": (kv,), "W_value.bias": (kv,)})
    shapes.update({"out_proj.weight": (init["d_out"], init["d_out"]), "out_proj.bias": (init["d_out"],)})
    # Queries and keys 3x PyTorch's initial size: scores of a few units, so positions visibly change them.
    weights = {k: w * 3 if k.startswith(("W_query", "W_key")) else w for k, w in random_weights(rng, shapes).items()}
    return init, normal(rng, sizes["b"], t, d_in), weights


def decode(stage, init, x, weights, chunks, get_cache=False, **options):
    """Run x through a cached RoPEAttention in chunks of the given sizes: the outputs of each step (and
    cache_k after each step)."""
    steps, start = [], 0
    for size in chunks:
        steps.append({"method": "forward", "args": [x[:, start:start + size]], "kwargs": {"use_cache": True}})
        if get_cache:
            steps.append({"get": "cache_k"})
        start += size
    assert start == x.shape[1]
    results = stage.session(CLS, init, weights, steps=steps, **options)
    return (results[0::2], results[1::2]) if get_cache else (results, None)


def check_decoding(stage, init, x, weights, chunks, expected, what):
    """Every cached step equals the matching tokens of the full forward (``expected``)."""
    outputs, caches = decode(stage, init, x, weights, chunks, get_cache=True)
    start = 0
    kv = init.get("num_kv_groups") or init["num_heads"]
    head_dim = init["d_out"] // init["num_heads"]
    subject = module(stage, init)
    for step, (size, out, cache) in enumerate(zip(chunks, outputs, caches)):
        rows = slice(start, start + size)
        assert_close(f"{what}: output of cached step {step} (tokens {start}..{start + size - 1})", out,
                     expected[:, rows], **FLOAT32, diagnosis=subject.step_evidence(x, weights, chunks, step))
        start += size
        shape = (x.shape[0], kv, start, head_dim)
        assert cache is not None and np.shape(cache) == shape, (
            f"{what}: after cached step {step}, cache_k has shape {np.shape(cache)}; expected (b, num_kv_groups, "
            f"tokens_so_far, head_dim) = {shape}")


def call(init):
    return f"{CLS}({', '.join(f'{k}={v}' for k, v in init.items())})"


def check_angles(stage, head_dim, context_length, theta_base, what=None, rows=slice(None), tolerance=FLOAT32):
    cos, sin = stage.rope_angles(head_dim, context_length, theta_base)
    positions = np.arange(context_length)[rows]
    a = angles(head_dim, positions, theta_base)
    assert_close(what or f"[cos, sin] of rope_angles({head_dim}, {context_length}, {theta_base:g})",
                 np.stack([np.asarray(cos)[rows], np.asarray(sin)[rows]]), np.stack([np.cos(a), np.sin(a)]),
                 **tolerance, diagnosis=AnglesFunction().evidence(head_dim, positions, theta_base))


def check_rotation(stage, x, cos, sin, offset, expected, what):
    assert_close(what, stage.apply_rope(x, cos, sin, offset=offset), expected, **FLOAT32,
                 diagnosis=RotateFunction(apply_of(stage)).evidence(x, cos, sin, offset))


# ---------------------------------------------------------------- public: the small examples

@pytest.mark.public
def test_rope_angles_on_the_example(stage, public_fx):
    head_dim, context_length, theta_base = public_fx["angles/init"]
    check_angles(stage, int(head_dim), int(context_length), float(theta_base))


@pytest.mark.public
def test_apply_rope_on_the_example(stage, public_fx):
    x, offset = public_fx["rope/x"], int(public_fx["rope/offset"])
    cos, sin = public_fx["angles/cos"], public_fx["angles/sin"]
    check_rotation(stage, x, cos, sin, 0, public_fx["rope/at_0"], "apply_rope(x, cos, sin)")
    check_rotation(stage, x, cos, sin, offset, public_fx["rope/at_offset"], f"apply_rope(x, cos, sin, offset={offset})")


@pytest.mark.public
def test_rope_attention_on_the_example(stage, public_fx):
    init, x, weights = public_fx.init(), public_fx.x, public_fx.sub("weights/")
    assert_close(f"{call(init)} output", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 diagnosis=module(stage, init).evidence(x, weights))


@pytest.mark.public
def test_cached_decoding_on_the_example(stage, public_fx):
    """A prompt of 3 tokens, then one token at a time: each step equals the full forward's tokens."""
    init, x = public_fx.init(), public_fx.x
    check_decoding(stage, init, x, public_fx.sub("weights/"), [3, *([1] * (x.shape[1] - 3))], public_fx.output,
                   call(init))


# ---------------------------------------------------------------- rope_angles, apply_rope

def test_rope_angles_match_numpy(stage, hidden_fx, rng):
    head_dim, context_length, theta_base = hidden_fx["angles/init"]
    cases = [(int(head_dim), int(context_length), float(theta_base))]
    cases += [(2 * int(rng.integers(2, 9)), int(rng.integers(2, 40)), float(rng.choice([100.0, 10_000.0, 1e6])))
              for _ in range(3)]
    # Angles up to 40 rad: float32 rounding of position * inv_freq stays below 1e-5.
    for case in cases:
        check_angles(stage, *case)
    cos, sin = stage.rope_angles(*cases[0])
    assert_close(f"[cos, sin] of rope_angles{cases[0]}", np.stack([cos, sin]),
                 np.stack([hidden_fx["angles/cos"], hidden_fx["angles/sin"]]), **FLOAT32,
                 diagnosis=AnglesFunction().evidence(cases[0][0], np.arange(cases[0][1]), cases[0][2]))


def test_rope_angles_at_far_positions(stage):
    """Rows 10_000.. and 50_000.. of rope_angles(8, 50_008). The angle position * inv_freq is a float32:
    near 50_000 its spacing is 2**-8 = 0.004 rad (and inv_freq's own rounding, 6e-8 relative, adds up to
    0.003 rad), so any float32 implementation, Hugging Face's included, is off by up to ~0.005 there:
    atol 1e-2 (a wrong layout or frequency is off by O(1))."""
    for start in (10_000, 50_000):
        check_angles(stage, 8, 50_008, 10_000.0, f"[cos, sin] of rope_angles(8, 50_008) at positions "
                     f"{start}..{start + 7}", rows=slice(start, start + 8), tolerance=dict(rtol=0, atol=1e-2))


def test_apply_rope_matches_numpy(stage, hidden_fx, rng):
    x, offset = hidden_fx["rope/x"], int(hidden_fx["rope/offset"])
    cos, sin = hidden_fx["angles/cos"], hidden_fx["angles/sin"]
    check_rotation(stage, x, cos, sin, 0, hidden_fx["rope/at_0"], "apply_rope(x, cos, sin) (stored case)")
    check_rotation(stage, x, cos, sin, offset, hidden_fx["rope/at_offset"],
                   f"apply_rope(x, cos, sin, offset={offset}) (stored case)")
    for _ in range(3):
        sizes = distinct_sizes(rng, dict(half=(1, 8), t=(1, 6), b=(1, 2), heads=(1, 3)),
                               lambda s: {"head_dim": 2 * s["half"]})
        offset, theta_base = int(rng.integers(1, 30)), float(rng.choice([100.0, 10_000.0]))
        x = normal(rng, sizes["b"], sizes["heads"], sizes["t"], sizes["head_dim"])
        a = angles(sizes["head_dim"], np.arange(offset + sizes["t"] + int(rng.integers(0, 3))), theta_base)
        cos, sin = np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
        check_rotation(stage, x, cos, sin, offset, rotate(x, cos, sin, offset),
                       f"apply_rope(x {x.shape}, cos, sin, offset={offset})")


def test_scores_depend_only_on_the_distance(stage, rng):
    """q rotated at position m, k at n: q . k depends on m - n alone, also 10_000 and 50_000 positions on.

    First in float64 (cos, sin and x given in float64: apply_rope itself, to 1e-9), then with the
    learner's float32 rope_angles, whose angles near position 50_000 are off by up to ~0.005 rad (see
    test_rope_angles_at_far_positions): a score moves by at most that times |q| |k| per rotated vector,
    so there the tolerance is 1e-2 * |q| |k|."""
    head_dim, distance = 8, 3  # (small: cos and sin of 50_004 positions travel to the implementation)
    q, k = rng.normal(size=(2, 1, 1, 1, head_dim))  # (b, heads, tokens, head_dim) each, float64
    at_distance = angles(head_dim, [distance], 10_000.0)  # k at position 0 is not turned
    expected = float(rotate(q, np.cos(at_distance), np.sin(at_distance))[0, 0, 0] @ k[0, 0, 0])
    a = angles(head_dim, np.arange(50_000 + distance + 1), 10_000.0)
    cos64, sin64 = np.cos(a), np.sin(a)
    cos32, sin32 = (np.asarray(c) for c in stage.rope_angles(head_dim, 50_000 + distance + 1))
    scale = float(np.linalg.norm(q) * np.linalg.norm(k))
    for n in (0, 10_000, 50_000):
        m = n + distance
        for cos, sin, dtype, atol in ((cos64, sin64, np.float64, 1e-9), (cos32, sin32, np.float32, 1e-2)):
            rq = stage.apply_rope(q.astype(dtype), cos, sin, offset=m)
            rk = stage.apply_rope(k.astype(dtype), cos, sin, offset=n)
            assert np.asarray(rk).dtype == dtype, (
                f"apply_rope on {np.dtype(dtype).name} x returned {np.asarray(rk).dtype}: keep x's dtype (compute "
                "in it; .float() or a float32 constant would lose a float64 input's precision)")
            score = float(np.asarray(rq, np.float64).ravel() @ np.asarray(rk, np.float64).ravel())
            assert_close(f"q rotated at position {m} . k rotated at position {n} (expected: the score of positions "
                         f"{distance} and 0) with {np.dtype(dtype).name} "
                         f"{'inputs' if dtype == np.float64 else 'rope_angles'}, tolerance {atol:g} * |q| |k|",
                         np.float64(score), np.float64(expected), rtol=0, atol=atol * scale,
                         diagnosis=[Probed([lambda: rotation_findings(apply_of(stage))])])


def test_rope_keeps_vector_lengths(stage, rng):
    """A rotation keeps lengths: every rotated (head_dim,) vector has the norm it had."""
    for head_dim in (2, 8, 64):
        x = normal(rng, 2, 3, 5, head_dim)
        cos, sin = stage.rope_angles(head_dim, 1_010)
        rotated = stage.apply_rope(x, cos, sin, offset=1_000)
        assert_close(f"norms of apply_rope(x, *rope_angles({head_dim}, 1010), offset=1000) over head_dim",
                     np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-4, atol=1e-5,
                     diagnosis=[Probed([lambda: rotation_findings(apply_of(stage))]),
                                *AnglesFunction().evidence(head_dim, np.arange(1_010), 10_000.0)[1:]])


# ---------------------------------------------------------------- RoPEAttention

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_rope_attention_matches_numpy(stage, hidden_fx, case):
    init, x, weights = hidden_fx.init(f"{case}/"), hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/")
    out = stage.forward(CLS, init, x, weights)
    evidence = module(stage, init).evidence(x, weights)
    assert_close(f"{call(init)} output", out, hidden_fx[f"{case}/output"], **FLOAT32, diagnosis=evidence)
    assert_close(f"{call(init)} output against the NumPy reference", out, reference_of(init, x, weights), **FLOAT32,
                 diagnosis=evidence)


def test_values_are_not_rotated(stage, rng):
    """With W_query = 0 every query scores every key 0, whatever RoPE does to them: each token's output is
    out_proj of the mean of the values up to it, which is where rotated values would show."""
    init, x, weights = rope_case(rng, t=7, num_heads=2, num_kv_groups=1, qkv_bias=False, theta_base=10.0, b=3)
    weights["W_query.weight"] = np.zeros_like(weights["W_query.weight"])
    assert_close("RoPEAttention output with W_query = 0 (uniform attention)", stage.forward(CLS, init, x, weights),
                 reference_of(init, x, weights), **FLOAT32, diagnosis=module(stage, init).evidence(x, weights))


def test_cached_decoding_equals_the_full_forward(stage, rng):
    """Prompt, single tokens and a chunk, with grouped keys/values; then reset_cache() and another sequence,
    whose positions start at 0 again."""
    init, x, weights = rope_case(rng, t=10, num_heads=4, num_kv_groups=2)
    check_decoding(stage, init, x, weights, [4, 1, 1, 3, 1], reference_of(init, x, weights), call(init))
    other = normal(rng, x.shape[0], 6, init["d_in"])
    steps = [{"method": "forward", "args": [x[:, :5]], "kwargs": {"use_cache": True}}, {"method": "reset_cache"},
             {"method": "forward", "args": [other[:, :4]], "kwargs": {"use_cache": True}},
             {"method": "forward", "args": [other[:, 4:]], "kwargs": {"use_cache": True}}]
    outputs = stage.session(CLS, init, weights, steps=steps)
    expected, subject = reference_of(init, other, weights), module(stage, init)
    assert_close("after reset_cache(), a new sequence's prompt (positions 0..3)", outputs[2], expected[:, :4],
                 **FLOAT32, diagnosis=subject.step_evidence(other, weights, [4, 2], 0, past=x[:, :5]))
    assert_close("after reset_cache(), the new sequence's next tokens (positions 4, 5)", outputs[3], expected[:, 4:],
                 **FLOAT32, diagnosis=subject.step_evidence(other, weights, [4, 2], 1, past=x[:, :5]))


def test_full_forward_ignores_the_cache(stage, rng):
    """forward(x) without use_cache is the full forward from position 0, whatever the cache holds."""
    init, x, weights = rope_case(rng, t=6)
    steps = [{"method": "forward", "args": [x[:, :3]], "kwargs": {"use_cache": True}},
             {"method": "forward", "args": [x]}]
    subject = module(stage, init)
    assert_close("forward(x) after a cached step", stage.session(CLS, init, weights, steps=steps)[1],
                 reference_of(init, x, weights), **FLOAT32,
                 diagnosis=[Probed([lambda: subject.probe_forward_after_steps(x, weights, [3])]),
                            *subject.evidence(x, weights)])


def test_parameters(stage):
    info = stage.inspect(CLS, dict(d_in=6, d_out=16, context_length=5, num_heads=4, num_kv_groups=2))
    expected = {"W_query.weight": [16, 6], "W_key.weight": [8, 6], "W_value.weight": [8, 6],
                "out_proj.weight": [16, 16], "out_proj.bias": [16]}
    assert info["parameters"] == expected, (
        f"RoPEAttention(6, 16, 5, num_heads=4, num_kv_groups=2) parameters {info['parameters']}; expected {expected}: "
        "W_key and W_value give num_kv_groups * head_dim = 2 * 4 features")
    info = stage.inspect(CLS, dict(d_in=6, d_out=16, context_length=5, num_heads=4, qkv_bias=True))
    assert info["parameters"].get("W_key.weight") == [16, 6] and info["parameters"].get("W_key.bias") == [16], (
        f"num_kv_groups=None means one key/value head per query head, and qkv_bias=True gives the projections "
        f"biases: W_key should be (16, 6) with a bias (16,); yours: {info['parameters']}")


def test_random_cases(stage, rng, device):
    for _ in range(3):
        init, x, weights = rope_case(rng, t=int(rng.integers(3, 9)))
        assert_close(f"{call(init)} on x {x.shape}", stage.forward(CLS, init, x, weights, device=device),
                     reference_of(init, x, weights), **FLOAT32,
                     diagnosis=module(stage, init, device=device).evidence(x, weights))


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs Llama 3 8B's attention size
    "cpu": dict(b=2, t=40, d_model=64, num_heads=4, num_kv_groups=2),
    "cuda": dict(b=1, t=4096, d_model=4096, num_heads=32, num_kv_groups=8),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d_model=256, num_heads=32, num_kv_groups=8),
}


def torch_rope_attention(x, weights, num_heads, num_kv_groups, theta_base, device):
    """The same attention computed by the test in float32 on ``device``, with F.scaled_dot_product_attention."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    x = torch.from_numpy(x).to(device)
    b, t, _ = x.shape
    head_dim = w["W_query.weight"].shape[0] // num_heads
    a = angles(head_dim, np.arange(t), theta_base)
    cos, sin = (torch.from_numpy(f(a)).float().to(device) for f in (np.cos, np.sin))

    def project(name, heads):
        out = F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias")).view(b, t, heads, head_dim).transpose(1, 2)
        return out * cos + torch.cat([-out[..., head_dim // 2:], out[..., :head_dim // 2]], dim=-1) * sin

    q, k = project("W_query", num_heads), project("W_key", num_kv_groups)
    v = F.linear(x, w["W_value.weight"], w.get("W_value.bias")).view(b, t, num_kv_groups, head_dim).transpose(1, 2)
    group = num_heads // num_kv_groups
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(b, t, -1), w["out_proj.weight"], w["out_proj.bias"]).cpu().numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_sized(stage, target, dtype):
    """Grouped-query RoPE attention at Llama sizes on CUDA (its CPU twin is small), against
    F.scaled_dot_product_attention in float32; bfloat16 at bf16 tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(5)
    d, kv = size["d_model"], size["d_model"] // size["num_heads"] * size["num_kv_groups"]
    init = dict(d_in=d, d_out=d, context_length=size["t"], num_heads=size["num_heads"],
                num_kv_groups=size["num_kv_groups"], theta_base=500_000.0)
    # Normal weights of std 1/sqrt(d): queries, keys, values of unit size, scores of std 1 (bf16 rounds a score
    # by ~0.4% of its size, so larger scores would stretch bf16's error past its tolerance), outputs of up to
    # unit size on the first tokens, where a wrong rotation shows by far more than the tolerance.
    shapes = {"W_query": (d, d), "W_key": (kv, d), "W_value": (kv, d), "out_proj": (d, d)}
    weights = {f"{n}.weight": (r.normal(size=s) / np.sqrt(d)).astype(np.float32) for n, s in shapes.items()}
    weights["out_proj.bias"] = np.zeros(d, np.float32)
    x = normal(r, size["b"], size["t"], d)
    expected = torch_rope_attention(x, weights, size["num_heads"], size["num_kv_groups"], 500_000.0, device)
    out = stage.forward(CLS, init, x, weights, device=device, dtype=dtype)
    assert_close(f"RoPEAttention output ({device}, {dtype})", out, expected, **TOLERANCE[dtype],
                 # (the evidence is computed in NumPy: at the CPU twin's size only)
                 diagnosis=[] if target.cuda else module(stage, init, device=device).evidence(x, weights))
