"""Stage m04: grouped-query attention.

Spec: GroupedQueryAttention(d_in, d_out, context_length, num_heads, num_kv_groups, dropout=0.0, qkv_bias=False):
head_dim = d_out // num_heads; W_query = nn.Linear(d_in, d_out), W_key and W_value = nn.Linear(d_in,
num_kv_groups * head_dim) (bias=qkv_bias), out_proj = nn.Linear(d_out, d_out). Causal attention where query
head h uses key/value head h // group_size (group_size = num_heads // num_kv_groups: repeat_interleave, as
Llama and Hugging Face do). The KV cache API of stage m03, its cache_k / cache_v of shape (b, num_kv_groups,
tokens_so_far, head_dim). num_kv_groups == num_heads is multi-head attention, num_kv_groups == 1 multi-query
attention.
"""
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, assert_close, causal, linear, multihead, parameter_count, softmax, split_heads
from suite_runtime.cases import cached_steps, draw_weights, linear_shapes, mha_shapes, normal, random_weights, spans

pytestmark = pytest.mark.grouped_query
STAGE = "m04_grouped_query"
CLS = "GroupedQueryAttention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32: the cached steps sum in another order than the full forward
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


def gqa_shapes(d_in, d_out, num_heads, num_kv_groups, bias):
    """GroupedQueryAttention's parameters: keys and values num_kv_groups heads wide."""
    kv_width = num_kv_groups * (d_out // num_heads)
    return {**linear_shapes("W_query", d_in, d_out, bias), **linear_shapes("W_key", d_in, kv_width, bias),
            **linear_shapes("W_value", d_in, kv_width, bias), **linear_shapes("out_proj", d_out, d_out)}


def grouped(x, weights, num_heads, num_kv_groups, *, keys="interleave", values="interleave", mask=True):
    """NumPy grouped-query causal attention. keys, values: how the kv heads are expanded to the query
    heads, "interleave" (right: query head h gets kv head h // group_size, torch's repeat_interleave) or
    "tile" (torch's repeat: h % num_kv_groups); mask=False leaves out the causal mask."""
    group_size = num_heads // num_kv_groups
    expand = {"interleave": lambda a: np.repeat(a, group_size, axis=1),
              "tile": lambda a: np.tile(a, (1, group_size, 1, 1))}
    q = split_heads(linear(x, weights, "W_query"), num_heads)  # (b, num_heads, T, head_dim)
    k = expand[keys](split_heads(linear(x, weights, "W_key"), num_kv_groups))
    v = expand[values](split_heads(linear(x, weights, "W_value"), num_kv_groups))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    context = softmax(causal(scores) if mask else scores) @ v  # (b, num_heads, T, head_dim)
    b, t = x.shape[:2]
    return linear(context.transpose(0, 2, 1, 3).reshape(b, t, -1), weights, "out_proj")


REPEAT = ("the key/value heads were expanded with `repeat`, which tiles them (query head h got kv head "
          "h % num_kv_groups); use repeat_interleave(group_size, dim=1): query head h uses kv head h // group_size, "
          "consecutive query heads share one")


def gqa_mistakes(x, weights, num_heads, num_kv_groups):
    """{description: full causal output} of the typical grouped-query mistakes."""
    run = partial(grouped, x, weights, num_heads, num_kv_groups)
    return {REPEAT: run(keys="tile", values="tile"),
            f"the keys were expanded with `repeat` (the values right): {REPEAT}": run(keys="tile"),
            f"the values were expanded with `repeat` (the keys right): {REPEAT}": run(values="tile"),
            "the causal mask is missing: tokens see the future": run(mask=False)}


def check_steps(outputs, expected, chunks, mistakes=None, what="", tolerance=FLOAT32):
    """Step k's output is the expected full forward's rows of chunk k. mistakes: a function giving
    {description: full forward} of mistakes, whose rows a mistaken cached step gives too."""
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **tolerance, mistakes=mistakes and (lambda a=a, e=e: {why: out[:, a:e]
                                                                           for why, out in mistakes().items()}),
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
    """4 query heads in 2 groups: heads 0 and 1 share key/value head 0, heads 2 and 3 key/value head 1."""
    init, x, weights, _ = case_of(public_fx)
    assert_close("forward(x) (use_cache=False)", stage.forward(CLS, init, x, weights), public_fx.output, **FLOAT32,
                 mistakes=lambda: gqa_mistakes(x, weights, 4, 2))


@pytest.mark.public
def test_prompt_then_one_token_at_a_time(stage, public_fx):
    """The cache of stage m03: a prompt of 3 tokens, then tokens 3, 4 and 5 one by one."""
    init, x, weights, chunks = case_of(public_fx)
    check_steps(run_decoding(stage, init, weights, x, chunks), public_fx.output, chunks,
                lambda: gqa_mistakes(x, weights, 4, 2))


@pytest.mark.public
def test_the_cache_holds_the_key_value_heads(stage, public_fx):
    """cache_k and cache_v hold num_kv_groups = 2 heads, not the 4 query heads, and grow by the new tokens."""
    init, x, weights, chunks = case_of(public_fx)
    steps = []
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_k"}, {"get": "cache_v"}]
    results = stage.session(CLS, init, weights, steps=steps)
    keys, values = (split_heads(linear(x, weights, name), 2) for name in ("W_key", "W_value"))
    for k, (_, end) in enumerate(spans(chunks)):
        cache_k, cache_v = results[1 + 3 * k], results[2 + 3 * k]
        check_cache_shape(cache_k, x.shape[0], 4, 2, end, 2, f"after step {k} (tokens 0..{end - 1} fed)")
        assert_close(f"cache_k after step {k}", cache_k, keys[:, :, :end], **FLOAT32,
                     hint="cache_k holds the keys W_key(x) of every token fed so far, in num_kv_groups heads.")
        assert_close(f"cache_v after step {k}", cache_v, values[:, :, :end], **FLOAT32,
                     hint="cache_v holds the values W_value(x) of every token fed so far, in num_kv_groups heads.")


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1", "case2"])
def test_every_step_equals_the_full_forward(stage, hidden_fx, case, device):
    """Groups of 4 and of 2 query heads, and multi-query attention (case2); case1 fills the whole context."""
    init, x, weights, chunks = case_of(hidden_fx, f"{case}/")
    mistakes = partial(gqa_mistakes, x, weights, init["num_heads"], init["num_kv_groups"])
    assert_close(f"{sizes(init)}forward(x)", stage.forward(CLS, init, x, weights, device=device),
                 hidden_fx[f"{case}/output"], **FLOAT32, mistakes=mistakes)
    steps = [*cached_steps(x, chunks), {"get": "cache_k"}]
    *outputs, cache_k = stage.session(CLS, init, weights, steps=steps, device=device)
    check_steps(outputs, hidden_fx[f"{case}/output"], chunks, mistakes, what=sizes(init))
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
                 mistakes={REPEAT: np.broadcast_to(np.arange(num_heads) % num_kv_groups, used.shape)})


def test_equal_to_multi_head_attention_when_each_query_head_has_its_own(stage, rng):
    """num_kv_groups == num_heads: chapter 3's multi-head attention (checks.multihead, NumPy), in full and cached."""
    num_heads, d_in, t = int(rng.integers(2, 5)), int(rng.integers(2, 7)), int(rng.integers(3, 9))
    d_out = num_heads * int(rng.integers(1, 4))
    init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=num_heads, num_kv_groups=num_heads,
                qkv_bias=bool(rng.integers(2)))
    weights = random_weights(rng, mha_shapes(d_in, d_out, init["qkv_bias"]))
    x = normal(rng, 2, t, d_in)
    expected = multihead(x, weights, num_heads)
    assert_close(f"{sizes(init)}forward(x) (expected: multi-head attention)", stage.forward(CLS, init, x, weights),
                 expected, **FLOAT32)
    chunks = [t - 2, 1, 1]
    check_steps(run_decoding(stage, init, weights, x, chunks), expected, chunks, what=sizes(init))


def test_one_kv_group_is_multi_query_attention(stage, rng):
    """num_kv_groups == 1: every query head shares one key head and one value head, one head in the cache."""
    num_heads, head_dim, d_in, t = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(2, 7)), 6
    d_out = num_heads * head_dim
    init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=num_heads, num_kv_groups=1, qkv_bias=True)
    weights = random_weights(rng, gqa_shapes(d_in, d_out, num_heads, 1, True))
    x = normal(rng, 2, t, d_in)
    expected = grouped(x, weights, num_heads, 1)
    steps = [*cached_steps(x, [3, 2, 1]), {"get": "cache_k"}, {"get": "cache_v"}]
    *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps)
    check_steps(outputs, expected, [3, 2, 1], partial(gqa_mistakes, x, weights, num_heads, 1), what=sizes(init))
    check_cache_shape(cache_k, 2, num_heads, 1, t, head_dim, "at the end")
    check_cache_shape(cache_v, 2, num_heads, 1, t, head_dim, "(cache_v) at the end")


@pytest.mark.parametrize("num_kv_groups", [8, 4, 2, 1])
def test_parameters_shrink_with_the_groups(stage, num_kv_groups):
    """W_key and W_value are num_heads / num_kv_groups times smaller than multi-head attention's."""
    d_in, d_out, num_heads = 6, 16, 8
    init = dict(d_in=d_in, d_out=d_out, context_length=5, num_heads=num_heads, num_kv_groups=num_kv_groups)
    params = stage.inspect(CLS, init)["parameters"]
    kv_width = num_kv_groups * (d_out // num_heads)
    for name in ("W_key.weight", "W_value.weight"):
        assert params.get(name) == [kv_width, d_in], (
            f"{CLS}({init}): {name} has shape {params.get(name)}, expected (num_kv_groups * head_dim, d_in) = "
            f"({kv_width}, {d_in}): keys and values get num_kv_groups heads, not num_heads, so W_key and W_value "
            f"are num_heads / num_kv_groups = {num_heads // num_kv_groups} times smaller than multi-head attention's"
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
    d_in, d_out, num_heads, t = 5, 16, 8, 6
    x = normal(rng, 2, t, d_in)
    for num_kv_groups in (8, 2, 1):  # (b, num_kv_groups, t, head_dim): 8 / num_kv_groups times fewer numbers
        init = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=num_heads, num_kv_groups=num_kv_groups)
        weights = random_weights(rng, gqa_shapes(d_in, d_out, num_heads, num_kv_groups, False))
        steps = [*cached_steps(x, [4, 1, 1]), {"get": "cache_k"}, {"get": "cache_v"}]
        *_, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps)
        check_cache_shape(cache_k, 2, num_heads, num_kv_groups, t, 2, f"with num_kv_groups={num_kv_groups}")
        check_cache_shape(cache_v, 2, num_heads, num_kv_groups, t, 2, f"(cache_v) with num_kv_groups={num_kv_groups}")


def test_random_cases_against_the_reference(stage, reference, rng, device):
    """Random sizes and groups, random chunks, reset_cache() and a second sequence: every step matches the
    reference."""
    ref = reference.stage(STAGE)
    for case in range(2):
        # The first case has groups of several heads and several groups: there `repeat` and `repeat_interleave`
        # differ (with one group, or groups of one head, they give the same heads).
        low = 2 if case == 0 else 1
        num_kv_groups, group_size = int(rng.integers(low, 4)), int(rng.integers(low, 4))
        head_dim = int(rng.integers(1, 4))
        num_heads, t = num_kv_groups * group_size, int(rng.integers(2, 9))
        init = dict(d_in=int(rng.integers(2, 7)), d_out=num_heads * head_dim,
                    context_length=t + int(rng.integers(0, 3)), num_heads=num_heads, num_kv_groups=num_kv_groups,
                    dropout=0.0, qkv_bias=bool(rng.integers(2)))
        weights = draw_weights(rng, ref, CLS, init)
        first, second = normal(rng, 2, t, init["d_in"]), normal(rng, 2, t, init["d_in"])
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(0, t)), replace=False))
        chunks = np.diff([0, *cuts, t]).tolist()
        steps = [*cached_steps(first, chunks), {"method": "reset_cache"}, *cached_steps(second, chunks[::-1]),
                 {"get": "cache_k"}]
        *outputs, cache_k = stage.session(CLS, init, weights, steps=steps, device=device)
        *expected, ref_k = ref.session(CLS, init, weights, steps=steps)
        n = len(chunks)
        first_mistakes = partial(gqa_mistakes, first, weights, num_heads, num_kv_groups)
        check_steps(outputs[:n], np.concatenate(expected[:n], axis=1), chunks, first_mistakes, what=sizes(init))
        second_mistakes = partial(gqa_mistakes, second, weights, num_heads, num_kv_groups)
        check_steps(outputs[n + 1:], np.concatenate(expected[n + 1:], axis=1), chunks[::-1], second_mistakes,
                    what=sizes(init) + "after reset_cache(), ")
        check_cache_shape(cache_k, 2, num_heads, num_kv_groups, t, head_dim, "at the end")
        assert_close("cache_k at the end", cache_k, ref_k, **FLOAT32)


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
    for dtype in size["dtypes"]:
        outputs = run_decoding(stage, init, weights, x, chunks, device=device, dtype=dtype)
        check_steps(outputs, expected, chunks, what=f"{device}, {dtype}: ", tolerance=TOLERANCE[dtype])
