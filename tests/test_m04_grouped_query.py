"""Stage m04: grouped-query attention.

Spec: GroupedQueryAttention(d_in, d_out, context_length, num_heads, num_kv_groups, dropout=0.0, qkv_bias=False):
head_dim = d_out // num_heads; W_query = nn.Linear(d_in, d_out), W_key and W_value = nn.Linear(d_in,
num_kv_groups * head_dim) (bias=qkv_bias), out_proj = nn.Linear(d_out, d_out). Causal attention where query
head h uses key/value head h // group_size (group_size = num_heads // num_kv_groups: repeat_interleave, as
Llama and Hugging Face do). The KV cache API of stage m03, its cache_k / cache_v of shape (b, num_kv_groups,
tokens_so_far, head_dim). num_kv_groups == num_heads is multi-head attention, num_kv_groups == 1 multi-query
attention.
"""
import numpy as np
import pytest

from diagnosis import (
    BFLOAT16,
    BROADCAST,
    Attention,
    Said,
    assert_close,
    linear,
    parameter_count,
    readings_with,
    split_heads,
)
from diagnosis.attention import forward
from diagnosis.caches import CachedModule, cache_mask_sizes
from diagnosis.groups import kv_heads_used_findings
from diagnosis.subjects import sizes_as_given
from suite_runtime.cases import cached_steps, distinct_sizes, draw_weights, linear_shapes, normal, random_weights, spans

pytestmark = pytest.mark.grouped_query
STAGE = "m04_grouped_query"
CLS = "GroupedQueryAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32: the cached steps sum in another order than the full forward
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
ERROR_READINGS = readings_with(BROADCAST, cache_mask_sizes)  # (conftest reads a stage's readings here)


def gqa_shapes(d_in, d_out, num_heads, num_kv_groups, bias):
    """GroupedQueryAttention's parameters: keys and values num_kv_groups heads wide."""
    kv_width = num_kv_groups * (d_out // num_heads)
    return {**linear_shapes("W_query", d_in, d_out, bias), **linear_shapes("W_key", d_in, kv_width, bias),
            **linear_shapes("W_value", d_in, kv_width, bias), **linear_shapes("out_proj", d_out, d_out)}


def module(stage, init, **options):
    """The module as the diagnoser runs it again (diagnosis.caches): causal grouped-query attention (query head h
    uses kv head h // group_size) with out_proj, and stage m03's KV cache."""
    spec = Attention(num_heads=init["num_heads"], num_kv_groups=init["num_kv_groups"])
    return CachedModule(stage, CLS, init, spec, sized=sizes_as_given, options=options)


def reference_forward(init, x, weights):
    """The full causal forward, in NumPy float64 (diagnosis.attention)."""
    return forward(module(None, init).spec, x, weights)


def check_steps(outputs, expected, chunks, subject, x, weights, what="", tolerance=FLOAT32, past=None):
    """Step k's output is the expected full forward's rows of chunk k; ``subject`` (a CachedModule, or None where
    no evidence is worked out) diagnoses a failure on x fed in ``chunks`` (after ``past`` and reset_cache())."""
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **tolerance, diagnosis=() if subject is None else subject.step_evidence(x, weights, chunks, k,
                                                                                              past=past),
                     hint=f"Expected: rows {a}..{e - 1} of the full causal forward (chunks of {tuple(chunks)} tokens).")


EXPANDED_CACHE = ("the cache holds the expanded heads: cache the num_kv_groups key/value heads and expand them "
                  "after the cache, or the cache is as large as multi-head attention's")


def check_cache_shape(cache_k, b, num_heads, num_kv_groups, so_far, head_dim, when):
    expected = (b, num_kv_groups, so_far, head_dim)
    assert cache_k is not None, (
        f"cache_k is None {when}; expected (b, num_kv_groups, tokens_so_far, head_dim) = {expected}: "
        "forward(x, use_cache=True) must store the new keys in self.cache_k"
    )
    expanded = cache_k.shape == (b, num_heads, so_far, head_dim) and num_heads != num_kv_groups
    assert cache_k.shape == expected, (
        f"cache_k has shape {cache_k.shape} {when}, expected (b, num_kv_groups, tokens_so_far, head_dim) = "
        f"{expected}: " + (EXPANDED_CACHE if expanded else "each cached step appends exactly its new tokens' keys")
    )


def sizes(init):
    """A short name of a case's sizes, for failure messages."""
    return (f"{init['num_heads']} query heads of {init['d_out'] // init['num_heads']}, "
            f"{init['num_kv_groups']} kv heads: ")


def run_decoding(stage, init, weights, x, chunks, **options):
    return stage.session(CLS, init, weights, steps=cached_steps(x, chunks), **options)


def case_of(fx, prefix=""):
    init = fx.init(prefix)
    return init, fx[f"{prefix}x"], fx.sub(f"{prefix}weights/"), fx[f"{prefix}chunks"].tolist()


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
def test_full_forward_on_the_example(stage, public_fx):
    """8 query heads in 4 groups: heads 0 and 1 share key/value head 0, heads 2 and 3 key/value head 1, ..."""
    init, x, weights, _ = case_of(public_fx)
    assert_close("forward(x) (use_cache=False)", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 diagnosis=module(stage, init).evidence(x, weights))


@pytest.mark.public
def test_prompt_then_one_token_at_a_time(stage, public_fx):
    """The cache of stage m03: a prompt of 3 tokens, then tokens 3, 4 and 5 one by one."""
    init, x, weights, chunks = case_of(public_fx)
    check_steps(run_decoding(stage, init, weights, x, chunks), public_fx.output, chunks, module(stage, init), x,
                weights)


@pytest.mark.public
def test_the_cache_holds_the_key_value_heads(stage, public_fx):
    """cache_k and cache_v hold num_kv_groups = 4 heads, not the 8 query heads, and grow by the new tokens."""
    init, x, weights, chunks = case_of(public_fx)
    steps = []
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_k"}, {"get": "cache_v"}]
    results = stage.session(CLS, init, weights, steps=steps)
    num_heads, groups, head_dim = init["num_heads"], init["num_kv_groups"], init["d_out"] // init["num_heads"]
    keys, values = (split_heads(linear(x, weights, name), groups) for name in ("W_key", "W_value"))
    subject = module(stage, init)
    for k, (_, end) in enumerate(spans(chunks)):
        cache_k, cache_v = results[1 + 3 * k], results[2 + 3 * k]
        check_cache_shape(cache_k, x.shape[0], num_heads, groups, end, head_dim,
                          f"after step {k} (tokens 0..{end - 1} fed)")
        fed = chunks[:k + 1]
        assert_close(f"cache_k after step {k}", cache_k, keys[:, :, :end], **FLOAT32,
                     diagnosis=subject.cache_evidence(x[:, :end], weights, fed, "keys"),
                     hint="cache_k holds the keys W_key(x) of every token fed so far, in num_kv_groups heads.")
        assert_close(f"cache_v after step {k}", cache_v, values[:, :, :end], **FLOAT32,
                     diagnosis=subject.cache_evidence(x[:, :end], weights, fed, "values"),
                     hint="cache_v holds the values W_value(x) of every token fed so far, in num_kv_groups heads.")


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_every_step_equals_the_full_forward(stage, hidden_fx, case, device):
    """Groups of 4 and of 2 query heads, and multi-query attention (case2); case1 fills the whole context."""
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    subject = module(stage, init, device=device)
    assert_close(f"{sizes(init)}forward(x)", stage.forward(CLS, init, x, weights, device=device),
                 hidden_fx[f"{case}/output"], **FLOAT32, diagnosis=subject.evidence(x, weights))
    steps = [*cached_steps(x, chunks), {"get": "cache_k"}]
    *outputs, cache_k = stage.session(CLS, init, weights, steps=steps, device=device)
    check_steps(outputs, hidden_fx[f"{case}/output"], chunks, subject, x, weights, what=sizes(init))
    check_cache_shape(cache_k, x.shape[0], init["num_heads"], init["num_kv_groups"], x.shape[1],
                      init["d_out"] // init["num_heads"], "at the end")


def test_query_head_h_uses_kv_head_h_div_group_size(stage):
    """Key/value head g has values all equal to g + 1 (zero value weights, bias g + 1) and out_proj is the
    identity: each query head's output is then the number of the key/value head it used, plus 1."""
    num_heads, num_kv_groups, head_dim, d_in = 6, 3, 2, 4
    r = np.random.default_rng(40)
    d_out, kv_width = num_heads * head_dim, num_kv_groups * head_dim
    weights = {
        "W_query.weight": normal(r, d_out, d_in), "W_query.bias": np.zeros(d_out, np.float32),
        "W_key.weight": normal(r, kv_width, d_in), "W_key.bias": np.zeros(kv_width, np.float32),
        "W_value.weight": np.zeros((kv_width, d_in), np.float32),
        "W_value.bias": np.repeat(np.arange(1, num_kv_groups + 1), head_dim).astype(np.float32),
        "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32),
    }
    init = dict(d_in=d_in, d_out=d_out, context_length=5, num_heads=num_heads, num_kv_groups=num_kv_groups,
                qkv_bias=True)
    out = stage.forward(CLS, init, normal(r, 2, 5, d_in), weights)
    assert out.shape == (2, 5, d_out), f"output shape {out.shape}, expected (b, num_tokens, d_out) = (2, 5, {d_out})"
    used = out.reshape(2, 5, num_heads, head_dim)[..., 0] - 1  # (b, num_tokens, num_heads)
    expected = np.broadcast_to(np.arange(num_heads) // (num_heads // num_kv_groups), used.shape).astype(np.float32)
    assert_close(f"the key/value head each of the {num_heads} query heads used ({num_kv_groups} kv heads)", used,
                 expected, **FLOAT32,
                 diagnosis=[Said(lambda used: kv_heads_used_findings(used, num_heads, num_kv_groups))])


def test_equal_to_multi_head_attention_when_each_query_head_has_its_own(stage, rng):
    """num_kv_groups == num_heads: chapter 3's multi-head attention, in full and cached."""
    sizes_ = distinct_sizes(rng, dict(num_heads=(2, 4), head_dim=(2, 4), d_in=(2, 8), t=(3, 9)),
                            lambda s: {"d_out": s["num_heads"] * s["head_dim"], "b": 1})
    num_heads, t = sizes_["num_heads"], sizes_["t"]
    init = dict(d_in=sizes_["d_in"], d_out=sizes_["d_out"], context_length=t, num_heads=num_heads,
                num_kv_groups=num_heads, qkv_bias=bool(rng.integers(2)))
    weights = random_weights(rng, gqa_shapes(init["d_in"], init["d_out"], num_heads, num_heads, init["qkv_bias"]))
    x = normal(rng, 1, t, init["d_in"])
    expected = reference_forward(init, x, weights)
    subject = module(stage, init)
    assert_close(f"{sizes(init)}forward(x) (expected: multi-head attention)", stage.forward(CLS, init, x, weights),
                 expected, **FLOAT32, diagnosis=subject.evidence(x, weights))
    chunks = [t - 2, 1, 1]
    check_steps(run_decoding(stage, init, weights, x, chunks), expected, chunks, subject, x, weights,
                what=sizes(init))


def test_one_kv_group_is_multi_query_attention(stage, rng):
    """num_kv_groups == 1: every query head shares one key head and one value head, one head in the cache."""
    sizes_ = distinct_sizes(rng, dict(b=(2, 3), num_heads=(2, 5), head_dim=(2, 4), d_in=(3, 8)),
                            lambda s: {"d_out": s["num_heads"] * s["head_dim"], "t": 6, "groups": 1})
    num_heads, head_dim, t = sizes_["num_heads"], sizes_["head_dim"], sizes_["t"]
    init = dict(d_in=sizes_["d_in"], d_out=sizes_["d_out"], context_length=t, num_heads=num_heads, num_kv_groups=1,
                qkv_bias=True)
    weights = random_weights(rng, gqa_shapes(init["d_in"], init["d_out"], num_heads, 1, True))
    x = normal(rng, sizes_["b"], t, init["d_in"])
    expected = reference_forward(init, x, weights)
    steps = [*cached_steps(x, [3, 2, 1]), {"get": "cache_k"}, {"get": "cache_v"}]
    *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps)
    check_steps(outputs, expected, [3, 2, 1], module(stage, init), x, weights, what=sizes(init))
    check_cache_shape(cache_k, x.shape[0], num_heads, 1, t, head_dim, "at the end")
    check_cache_shape(cache_v, x.shape[0], num_heads, 1, t, head_dim, "(cache_v) at the end")


@pytest.mark.parametrize("num_kv_groups", [8, 4, 2, 1])
def test_parameters_shrink_with_the_groups(stage, num_kv_groups):
    """W_key and W_value are num_heads / num_kv_groups times smaller than multi-head attention's."""
    d_in, d_out, num_heads = 5, 24, 8  # (head_dim 3)
    init = dict(d_in=d_in, d_out=d_out, context_length=7, num_heads=num_heads, num_kv_groups=num_kv_groups)
    params = stage.inspect(CLS, init)["parameters"]
    kv_width = num_kv_groups * (d_out // num_heads)
    for name in ("W_key.weight", "W_value.weight"):
        assert params.get(name) == [kv_width, d_in], (
            f"{CLS}({init}): {name} has shape {params.get(name)}, expected (num_kv_groups * head_dim, d_in) = "
            f"({kv_width}, {d_in}): keys and values get num_kv_groups heads, not num_heads, so W_key and W_value "
            f"are num_heads / num_kv_groups = {num_heads // num_kv_groups} times smaller than multi-head attention's"
            + (f"; yours has (num_heads / num_kv_groups) * head_dim = {params.get(name)[0]} rows: num_kv_groups was "
               "read as the group size, where it is the number of key/value heads"
               if num_kv_groups not in (1, num_heads) and params.get(name)
               and params[name][0] == (num_heads // num_kv_groups) * (d_out // num_heads) else "")
            # (with 1 group or num_heads groups, that size is also d_out's or one head's: no reading)
        )
    expected = d_out * d_in + 2 * kv_width * d_in + d_out * d_out + d_out
    count = parameter_count({"parameters": params})
    assert count == expected, (
        f"{CLS}({init}) has {count} trainable values, expected {expected}: W_query ({d_out}x{d_in}), W_key and "
        f"W_value ({kv_width}x{d_in} each, no bias by default), out_proj ({d_out}x{d_out} with bias); "
        f"yours: {params}"
    )


def test_the_cache_shrinks_by_num_heads_over_num_kv_groups(stage, rng):
    """After the same tokens, the cache of num_kv_groups heads holds num_heads / num_kv_groups times fewer
    numbers than with num_kv_groups == num_heads (multi-head attention)."""
    d_in, d_out, num_heads, t = 5, 24, 8, 7  # (head_dim 3, batch 2)
    x = normal(rng, 2, t, d_in)
    for num_kv_groups in (8, 4, 1):  # (b, num_kv_groups, t, head_dim): 8 / num_kv_groups times fewer numbers
        init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=num_heads, num_kv_groups=num_kv_groups)
        weights = random_weights(rng, gqa_shapes(d_in, d_out, num_heads, num_kv_groups, False))
        steps = [*cached_steps(x, [4, 1, 2]), {"get": "cache_k"}, {"get": "cache_v"}]
        *_, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps)
        check_cache_shape(cache_k, 2, num_heads, num_kv_groups, t, 3, f"with num_kv_groups={num_kv_groups}")
        check_cache_shape(cache_v, 2, num_heads, num_kv_groups, t, 3, f"(cache_v) with num_kv_groups={num_kv_groups}")


def test_random_cases_against_the_reference(stage, reference, rng, device):
    """Random sizes and groups (pairwise distinct), random chunks, reset_cache() and a second sequence: every step
    matches the reference."""
    ref = reference.stage(STAGE)
    for case in range(2):
        # The first case has groups of several heads and several groups: there `repeat` and `repeat_interleave`
        # differ (with one group, or groups of one head, they give the same heads).
        low = 2 if case == 0 else 1
        sizes_ = distinct_sizes(rng, dict(num_kv_groups=(low, 3), group_size=(low, 3), head_dim=(2, 5),
                                          d_in=(2, 9), t=(3, 9)),
                                lambda s: {"num_heads": s["num_kv_groups"] * s["group_size"],
                                           "d_out": s["num_kv_groups"] * s["group_size"] * s["head_dim"]})
        num_heads, num_kv_groups, head_dim, t = (sizes_[k] for k in ("num_heads", "num_kv_groups", "head_dim", "t"))
        init = dict(d_in=sizes_["d_in"], d_out=sizes_["d_out"], context_length=t + int(rng.integers(0, 3)),
                    num_heads=num_heads, num_kv_groups=num_kv_groups, dropout=0.0, qkv_bias=bool(rng.integers(2)))
        weights = draw_weights(rng, ref, CLS, init)
        first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(1, t)), replace=False))
        chunks = np.diff([0, *cuts, t]).tolist()
        steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1]),
                 {"get": "cache_k"}]
        *outputs, cache_k = stage.session(CLS, init, weights, steps=steps, device=device)
        *expected, ref_k = ref.session(CLS, init, weights, steps=steps)
        n = len(chunks)
        subject = module(stage, init, device=device)
        check_steps(outputs[:n], np.concatenate(expected[:n], axis=1), chunks, subject, first, weights,
                    what=sizes(init))
        check_steps(outputs[n + 1:], np.concatenate(expected[n + 1:], axis=1), chunks[::-1], subject, second,
                    weights, what=sizes(init) + "after reset_cache(), ", past=first)
        check_cache_shape(cache_k, 2, num_heads, num_kv_groups, t, head_dim, "at the end")
        assert_close("cache_k at the end", cache_k, ref_k, **FLOAT32,
                     diagnosis=subject.cache_evidence(second, weights, chunks[::-1], "keys"))


def sdpa_forward(x, weights, num_heads, num_kv_groups, device):
    """The full causal forward by torch.nn.functional.scaled_dot_product_attention(enable_gqa=True), float32, on
    ``device``: the suite's own computation (never the learner's), for the large cases."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    t = torch.from_numpy(x).to(device)
    b, n, _ = t.shape

    def project(name, heads):
        return F.linear(t, w[f"{name}.weight"], w.get(f"{name}.bias")).view(b, n, heads, -1).transpose(1, 2)

    q, k, v = project("W_query", num_heads), project("W_key", num_kv_groups), project("W_value", num_kv_groups)
    # enable_gqa repeats each key/value head for the consecutive query heads of its group (repeat_interleave).
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.linear(context.transpose(1, 2).reshape(b, n, -1), w["out_proj.weight"], w["out_proj.bias"]).cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is a Llama-sized layer (Llama 3 8B's attention)
    "cpu": dict(b=2, num_tokens=40, d_model=64, num_heads=8, num_kv_groups=2, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, num_tokens=4096, d_model=4096, num_heads=32, num_kv_groups=8, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, num_tokens=64, d_model=256, num_heads=32, num_kv_groups=8, dtypes=("bfloat16",)),
}


def test_long_prompt_then_tokens(stage, target):
    """A long prompt in one chunk, then 3 tokens one by one, in bfloat16 (and float32 in the CPU twin), against
    F.scaled_dot_product_attention(enable_gqa=True) in float32 at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    b, n, d = size["b"], size["num_tokens"], size["d_model"]
    num_heads, num_kv_groups = size["num_heads"], size["num_kv_groups"]
    r = np.random.default_rng(41)
    init = dict(d_in=d, d_out=d, context_length=n, num_heads=num_heads, num_kv_groups=num_kv_groups, qkv_bias=False)
    weights = random_weights(r, gqa_shapes(d, d, num_heads, num_kv_groups, False))
    x = normal(r, b, n, d)
    expected = sdpa_forward(x, weights, num_heads, num_kv_groups, device)
    chunks = [n - 3, 1, 1, 1]
    # (the evidence is computed in NumPy: at the CPU twin's size only)
    subject = None if target.cuda else module(stage, init, device=device)
    for dtype in size["dtypes"]:
        outputs = run_decoding(stage, init, weights, x, chunks, device=device, dtype=dtype)
        check_steps(outputs, expected, chunks, subject, x, weights, what=f"{device}, {dtype}: ",
                    tolerance=TOLERANCE[dtype])
