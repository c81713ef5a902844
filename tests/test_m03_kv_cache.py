"""Stage m03: a KV cache for generation.

Spec: MultiHeadAttentionWithCache(d_in, d_out, context_length, num_heads, dropout=0.0, qkv_bias=False) has
chapter 3's weights (W_query, W_key, W_value, out_proj). forward(x) is chapter 3's causal forward;
forward(x, use_cache=True) takes the NEW tokens only, appends their keys and values to cache_k / cache_v
(b, num_heads, tokens_so_far, head_dim; None while empty) and lets each new query attend causally to every
cached position, its position counted after the cached tokens. Decoding a sequence chunk by chunk gives,
at every step, the rows of the full causal forward. reset_cache() empties the cache (cache_k = cache_v = None), and
a forward without use_cache leaves it as it is. Dropout acts on the attention weights in training mode only.
"""
import numpy as np
import pytest

from diagnosis import (
    BFLOAT16,
    BROADCAST,
    Attention,
    Probed,
    assert_close,
    check_module_dropout,
    check_sizes_from_arguments,
    linear,
    multihead,
    readings_with,
    split_heads,
)
from diagnosis.caches import CachedModule, cache_mask_sizes
from diagnosis.subjects import sizes_as_given
from suite_runtime.cases import (
    cached_steps,
    distinct_sizes,
    draw_weights,
    exposing_case,
    mha_shapes,
    normal,
    random_weights,
    spans,
)

pytestmark = pytest.mark.kv_cache
STAGE = "m03_kv_cache"
CLS = "MultiHeadAttentionWithCache"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32: the cached steps sum in another order than the full forward
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}
ERROR_READINGS = readings_with(BROADCAST, cache_mask_sizes)  # (conftest reads a stage's readings here)


def module(stage, init, **options):
    """The module as the diagnoser runs it again (diagnosis.caches): chapter 3's causal multi-head attention with
    out_proj, and a KV cache."""
    return CachedModule(stage, CLS, init, Attention(num_heads=init["num_heads"]), sized=sizes_as_given,
                        options=options)


def check_steps(outputs, expected, chunks, subject, x, weights, what="", tolerance=FLOAT32, past=None):
    """Step k's output is the expected full forward's rows of chunk k; ``subject`` (a CachedModule, or None where
    no evidence is worked out) diagnoses a failure on x fed in ``chunks`` (after ``past`` and reset_cache())."""
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **tolerance, diagnosis=() if subject is None else subject.step_evidence(x, weights, chunks, k,
                                                                                              past=past),
                     hint=f"Expected: rows {a}..{e - 1} of the full causal forward (chunks of {tuple(chunks)} tokens).")


def check_cache_shape(cache_k, b, num_heads, so_far, head_dim, when):
    expected = (b, num_heads, so_far, head_dim)
    assert cache_k is not None, (
        f"cache_k is None {when}; expected a tensor of shape (b, num_heads, tokens_so_far, head_dim) = {expected}: "
        "forward(x, use_cache=True) must store the new keys in self.cache_k"
    )
    assert cache_k.shape == expected, (
        f"cache_k has shape {cache_k.shape} {when}, expected (b, num_heads, tokens_so_far, head_dim) = {expected}: "
        "each cached step appends exactly its new tokens' keys (torch.cat on dim 2), keeping the earlier ones"
    )


def sizes(init):
    """A short name of a case's sizes, for failure messages."""
    return f"{init['num_heads']} heads of {init['d_out'] // init['num_heads']}: "


def run_decoding(stage, init, weights, x, chunks, **options):
    return stage.session(CLS, init, weights, steps=cached_steps(x, chunks), **options)


# ---------------------------------------------------------------- the journey example (public)

@pytest.mark.public
def test_full_forward_on_the_example(stage, public_fx):
    """Without the cache the module is chapter 3's causal MultiHeadAttention."""
    x, weights, init = public_fx.x, public_fx.sub("weights/"), public_fx.init()
    assert_close("forward(x) (use_cache=False)", stage.forward(CLS, init, x, weights), public_fx.output,
                 **FLOAT32, diagnosis=module(stage, init).evidence(x, weights))


@pytest.mark.public
def test_prompt_then_one_token_at_a_time(stage, public_fx):
    """A prompt of 3 tokens, then tokens 3, 4 and 5 one by one: each step gives its rows of the full forward."""
    x, weights, chunks, init = public_fx.x, public_fx.sub("weights/"), public_fx.chunks.tolist(), public_fx.init()
    outputs = run_decoding(stage, init, weights, x, chunks)
    check_steps(outputs, public_fx.output, chunks, module(stage, init), x, weights)


@pytest.mark.public
def test_the_cache_grows_by_the_new_tokens(stage, public_fx):
    """cache_k and cache_v start as None; each cached step appends its new tokens' keys and values."""
    x, weights, chunks, init = public_fx.x, public_fx.sub("weights/"), public_fx.chunks.tolist(), public_fx.init()
    steps = [{"get": "cache_k"}]
    for step in cached_steps(x, chunks):
        steps += [step, {"get": "cache_k"}, {"get": "cache_v"}]
    results = stage.session(CLS, init, weights, steps=steps)
    assert results[0] is None, f"cache_k of a new module should be None (an empty cache); it is {results[0]!r}"
    b, num_heads, head_dim = x.shape[0], init["num_heads"], init["d_out"] // init["num_heads"]
    keys, values = (split_heads(linear(x, weights, name), num_heads) for name in ("W_key", "W_value"))
    subject = module(stage, init)
    for k, (_, end) in enumerate(spans(chunks)):
        cache_k, cache_v = results[2 + 3 * k], results[3 + 3 * k]
        check_cache_shape(cache_k, b, num_heads, end, head_dim, f"after step {k} (tokens 0..{end - 1} fed)")
        fed = chunks[:k + 1]
        assert_close(f"cache_k after step {k}", cache_k, keys[:, :, :end], **FLOAT32,
                     diagnosis=subject.cache_evidence(x[:, :end], weights, fed, "keys"),
                     hint="cache_k holds the keys W_key(x) of every token fed so far, split into heads.")
        assert_close(f"cache_v after step {k}", cache_v, values[:, :, :end], **FLOAT32,
                     diagnosis=subject.cache_evidence(x[:, :end], weights, fed, "values"),
                     hint="cache_v holds the values W_value(x) of every token fed so far, split into heads.")


@pytest.mark.public
def test_reset_cache_starts_a_new_sequence(stage, public_fx):
    """After reset_cache() the cache is empty and the next tokens are a sequence of their own."""
    x, weights, chunks, init = public_fx.x, public_fx.sub("weights/"), public_fx.chunks.tolist(), public_fx.init()
    steps = [*cached_steps(x, chunks), {"method": "reset_cache"}, {"get": "cache_k"},
             {"method": "forward", "args": [x[:, :2]], "kwargs": {"use_cache": True}}]
    *_, emptied, again = stage.session(CLS, init, weights, steps=steps)
    assert_close("forward(x[:, 0:2], use_cache=True) after reset_cache()", again, public_fx.output[:, :2], **FLOAT32,
                 diagnosis=module(stage, init).step_evidence(x[:, :2], weights, [2], 0, past=x))
    assert emptied is None, (
        f"cache_k after reset_cache() holds {np.shape(emptied)}; expected None: reset_cache() must set cache_k and "
        "cache_v back to None")


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_every_step_equals_the_full_forward(stage, hidden_fx, case, device):
    """Chunks of several tokens and single tokens, up to the whole context (case1)."""
    x, weights, init = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/"), hidden_fx.init(f"{case}/")
    chunks = hidden_fx[f"{case}/chunks"].tolist()
    outputs = run_decoding(stage, init, weights, x, chunks, device=device)
    check_steps(outputs, hidden_fx[f"{case}/output"], chunks, module(stage, init, device=device), x, weights,
                what=sizes(init))


def test_reset_between_two_sequences(stage, hidden_fx):
    """Decode one sequence, reset_cache(), decode another: the second gives its own full forward."""
    init, weights = hidden_fx.init("first/"), hidden_fx.sub("first/weights/")
    first, second = hidden_fx["first/x"], hidden_fx["second/x"]
    chunks = hidden_fx["second/chunks"].tolist()
    steps = [*cached_steps(first, hidden_fx["first/chunks"].tolist()), {"method": "reset_cache"},
             {"get": "cache_k"}, {"get": "cache_v"}, *cached_steps(second, chunks), {"get": "cache_k"}]
    results = stage.session(CLS, init, weights, steps=steps)
    emptied_k, emptied_v = results[-len(chunks) - 3:-len(chunks) - 1]
    outputs = results[-len(chunks) - 1:-1]
    check_steps(outputs, hidden_fx["second/output"], chunks, module(stage, init), second, weights,
                what="second sequence, ", past=first)
    assert emptied_k is None and emptied_v is None, (
        f"after reset_cache(), cache_k is {np.shape(emptied_k)} and cache_v {np.shape(emptied_v)}; expected None: "
        "reset_cache() must set cache_k and cache_v back to None")
    b, n = second.shape[:2]
    check_cache_shape(results[-1], b, init["num_heads"], n, init["d_out"] // init["num_heads"],
                      "after the second sequence")


def test_a_forward_without_the_cache_leaves_it_alone(stage, hidden_fx):
    """forward(y) between cached steps is chapter 3's forward of y, and the cache goes on as if it had not run."""
    x, weights, init = hidden_fx["case0/x"], hidden_fx.sub("case0/weights/"), hidden_fx.init("case0/")
    num_heads, head_dim = init["num_heads"], init["d_out"] // init["num_heads"]
    other = normal(np.random.default_rng(30), x.shape[0], 5, init["d_in"])
    steps = [*cached_steps(x, [4]), {"method": "forward", "args": [other]}, {"get": "cache_k"},
             *cached_steps(x[:, 4:], [1])]
    _, plain, cache_k, step = stage.session(CLS, init, weights, steps=steps)
    subject = module(stage, init)
    assert_close("forward(y) (use_cache=False) after a cached step", plain, multihead(other, weights, num_heads),
                 **FLOAT32, diagnosis=subject.evidence(other, weights),
                 hint="Without use_cache, forward(y) attends over y alone, whatever the cache holds.")
    check_cache_shape(cache_k, x.shape[0], num_heads, 4, head_dim, "after 4 cached tokens and a forward without "
                      "the cache: forward(x) without use_cache must leave the cache as it is")
    assert_close("forward(x[:, 4:5], use_cache=True) after it", step, hidden_fx["case0/output"][:, 4:5], **FLOAT32,
                 diagnosis=[Probed([lambda: subject.probe_plain_forward_between(x[:, :5], weights, [4, 1], other)]),
                            *subject.step_evidence(x[:, :5], weights, [4, 1], 1)])


def random_case(rng, reference_stage):
    """Random sizes, pairwise distinct (batch, heads, head_dim, d_out, d_in, tokens), and random chunks."""
    sizes_ = distinct_sizes(rng, dict(b=(1, 3), num_heads=(1, 4), head_dim=(2, 4), d_in=(2, 9), t=(3, 11)),
                            lambda s: {"d_out": s["num_heads"] * s["head_dim"]})
    t = sizes_["t"]
    init = dict(d_in=sizes_["d_in"], d_out=sizes_["d_out"], num_heads=sizes_["num_heads"],
                context_length=t + int(rng.integers(0, 3)), dropout=0.0, qkv_bias=bool(rng.integers(2)))
    x, weights = normal(rng, sizes_["b"], t, init["d_in"]), draw_weights(rng, reference_stage, CLS, init)
    cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(1, t)), replace=False))
    return init, x, weights, np.diff([0, *cuts, t]).tolist()


def test_random_chunks_against_the_reference(stage, reference, rng, device):
    """Random sizes, random chunk lengths: every step, and the cache at the end, match the reference."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        init, x, weights, chunks = random_case(rng, ref)
        num_heads, head_dim = init["num_heads"], init["d_out"] // init["num_heads"]
        steps = [*cached_steps(x, chunks), {"get": "cache_k"}, {"get": "cache_v"}]
        *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps, device=device)
        *expected, ref_k, ref_v = ref.session(CLS, init, weights, steps=steps)
        subject = module(stage, init, device=device)
        check_steps(outputs, np.concatenate(expected, axis=1), chunks, subject, x, weights, what=sizes(init))
        check_cache_shape(cache_k, x.shape[0], num_heads, x.shape[1], head_dim, f"after chunks {chunks}")
        assert_close("cache_k at the end", cache_k, ref_k, **FLOAT32,
                     diagnosis=subject.cache_evidence(x, weights, chunks, "keys"))
        assert_close("cache_v at the end", cache_v, ref_v, **FLOAT32,
                     diagnosis=subject.cache_evidence(x, weights, chunks, "values"))


def sdpa_forward(x, weights, num_heads, device):
    """The full causal forward by torch.nn.functional.scaled_dot_product_attention, float32, on ``device``:
    the suite's own computation (never the learner's), for the large cases."""
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(v).to(device) for k, v in weights.items()}
    t = torch.from_numpy(x).to(device)
    b, n, _ = t.shape
    q, k, v = (F.linear(t, w[f"{p}.weight"], w.get(f"{p}.bias")).view(b, n, num_heads, -1).transpose(1, 2)
               for p in ("W_query", "W_key", "W_value"))
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
    return F.linear(context, w["out_proj.weight"], w["out_proj.bias"]).cpu().numpy()


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is a Llama-sized layer (d_model 4096, 32 heads)
    "cpu": dict(b=2, num_tokens=40, d_model=64, num_heads=4, dtypes=("float32", "bfloat16")),
    "cuda": dict(b=1, num_tokens=4096, d_model=4096, num_heads=32, dtypes=("bfloat16",)),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, num_tokens=64, d_model=256, num_heads=32, dtypes=("bfloat16",)),
}


def test_long_prompt_then_tokens(stage, target):
    """A long prompt in one chunk, then 3 tokens one by one, in bfloat16 (and float32 in the CPU twin), against
    F.scaled_dot_product_attention's full causal forward in float32 at the dtype's tolerance."""
    size, device = SIZES[target.size], target.device
    b, n, d, num_heads = size["b"], size["num_tokens"], size["d_model"], size["num_heads"]
    r = np.random.default_rng(31)
    init = dict(d_in=d, d_out=d, context_length=n, num_heads=num_heads, dropout=0.0, qkv_bias=True)
    weights = random_weights(r, mha_shapes(d, d, bias=True))
    x = normal(r, b, n, d)
    expected = sdpa_forward(x, weights, num_heads, device)
    chunks = [n - 3, 1, 1, 1]
    # (the evidence is computed in NumPy: at the CPU twin's size only)
    subject = None if target.cuda else module(stage, init, device=device)
    for dtype in size["dtypes"]:
        outputs = run_decoding(stage, init, weights, x, chunks, device=device, dtype=dtype)
        check_steps(outputs, expected, chunks, subject, x, weights, what=f"{device}, {dtype}: ",
                    tolerance=TOLERANCE[dtype])


def test_parameters_and_mask(stage):
    """Chapter 3's parameters, sized from the constructor's arguments, and its causal mask."""
    init = dict(d_in=7, d_out=9, context_length=11, num_heads=3)
    info = stage.inspect(CLS, init)
    check_sizes_from_arguments(info, init, 3 * 7 * 9 + 9 * 9 + 9, CLS)
    assert "mask" in info["buffers"], "register the causal mask as a buffer named 'mask'"


def test_dropout_acts_on_the_weights_in_training_mode_only(stage, device):
    """One-hot values and an identity out_proj make the output the attention weights (cases.exposing_case):
    dropout=0.5 drops about half of them and doubles the rest, in training mode only."""
    init, x, weights = exposing_case(np.random.default_rng(32), num_heads=2, num_tokens=8, batch=32)
    check_module_dropout(stage, CLS, init, x, weights, 0.5, multihead(x, weights, 2), device, explained=True)

