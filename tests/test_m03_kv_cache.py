"""Stage m03: a KV cache for generation.

Spec: MultiHeadAttentionWithCache(d_in, d_out, context_length, num_heads, dropout=0.0, qkv_bias=False) has
chapter 3's weights (W_query, W_key, W_value, out_proj). forward(x) is chapter 3's causal forward;
forward(x, use_cache=True) takes the NEW tokens only, appends their keys and values to cache_k / cache_v
(b, num_heads, tokens_so_far, head_dim; None while empty) and lets each new query attend causally to every
cached position, its position counted after the cached tokens. Decoding a sequence chunk by chunk gives,
at every step, the rows of the full causal forward. reset_cache() empties the cache.
"""
from functools import cache, partial

import numpy as np
import pytest

from diagnosis import (
    BFLOAT16,
    BROADCAST,
    assert_close,
    broadcast_sizes,
    check_module_dropout,
    check_sizes_from_arguments,
    linear,
    multihead,
    multihead_mistakes,
    readings_with,
    softmax,
    split_heads,
)
from suite_runtime.cases import cached_steps, draw_weights, exposing_case, mha_shapes, normal, random_weights, spans

pytestmark = pytest.mark.kv_cache
STAGE = "m03_kv_cache"
CLS = "MultiHeadAttentionWithCache"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32: the cached steps sum in another order than the full forward
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


# ---------------------------------------------------------------- steps and their NumPy twins

def decode(x, weights, num_heads, chunks, *, visible="causal", cached=True, past=None):
    """NumPy outputs of decoding x chunk by chunk with a KV cache, one array per chunk, with switches that
    reproduce typical mistakes. visible: which cached key j the new query i of a chunk starting at position
    `start` sees: "causal" (right: j <= start + i), "next" (j <= start + i + 1: the mask one row late),
    "from_zero" (j <= i: the mask not offset by the cache length), "all" (no mask); cached=False: each chunk
    attends to its own tokens only; past: a sequence decoded before it whose cache was never reset."""
    first = 0 if past is None else past.shape[1]
    seq = x if past is None else np.concatenate([past, x], axis=1)
    q, k, v = (split_heads(linear(seq, weights, name), num_heads) for name in ("W_query", "W_key", "W_value"))
    outputs = []
    for a, e in spans(chunks):
        start, end = first + a, first + e
        keys_from = 0 if cached else start
        i = np.arange(end - start)[:, None]
        j = np.arange(keys_from, end)[None, :]
        allowed = {"causal": j <= start + i, "next": j <= start + i + 1, "from_zero": j <= i,
                   "all": np.ones_like(j <= i)}[visible]
        scores = q[:, :, start:end] @ k[:, :, keys_from:end].transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        weights_ = softmax(np.where(allowed, scores, -np.inf))
        context = (weights_ @ v[:, :, keys_from:end]).transpose(0, 2, 1, 3)
        outputs.append(linear(context.reshape(*context.shape[:2], -1), weights, "out_proj"))
    return outputs


OFF_BY_ONE = ("each new query also sees the token after it: the mask rows are one position late. The new tokens "
              "sit at positions start .. start + num_new - 1, start = the number of tokens cached before this step")
NOT_OFFSET = ("the causal mask was not offset by the cache length: the new tokens were masked as if they sat at "
              "positions 0, 1, ... (a single new token saw only the first key), which is also what "
              "F.scaled_dot_product_attention(is_causal=True) does with fewer queries than keys (it aligns the "
              "diagonal top-left); take the mask's rows start .. start + num_new - 1, start = the number of tokens "
              "cached before this step (for SDPA: attn_mask=~self.mask[start:start + num_new, :num_keys], not "
              "is_causal)")
UNMASKED = "the cached steps were not masked: a chunk's tokens saw the later tokens of the same chunk"
NO_CACHE = ("each step attended to its own new tokens only: the cached keys and values were not used (append "
            "the new ones to the cache with torch.cat on the token axis, then attend to the whole cache)")
NOT_RESET = ("the cache was not reset: the second sequence attended to the first one's keys and values "
             "(reset_cache() must set cache_k and cache_v back to None)")


# ---------------------------------------------------------------- errors

MASK_ROWS = ("take the mask's rows start .. start + num_new - 1 and its first num_keys columns, "
             "self.mask[start:start + num_new, :num_keys], start = num_keys - num_new (the tokens cached before this "
             "step; 0 without the cache)")


def cache_mask_sizes(match, call):
    """A mask that does not fit a step's scores (b, num_heads, num_new, num_keys): kept whole (context_length on
    a side), or cut for the new tokens alone (num_new x num_new: the columns of the cached keys missing). Each
    is read only when the sizes and the axis in the error are those it predicts for a step the check ran."""
    sizes, dim = broadcast_sizes(match)
    length = call.init.get("context_length")
    for _, num_new, num_keys in call.forwards():
        uncut = {length, num_keys} if num_keys != length else {length, num_new}
        if length and sizes == uncut and dim == (3 if num_keys != length else 2):
            return (f"the causal mask is context_length x context_length ({length} x {length}) and met the scores "
                    f"of {num_new} new tokens over {num_keys} keys: {MASK_ROWS}")
        if num_new < num_keys and sizes == {num_new, num_keys} and dim == 3:
            return (f"a cached step's scores are num_new x num_keys = {num_new} x {num_keys} (the new queries attend "
                    f"to every cached key), but the mask was cut for the new tokens alone ({num_new} x {num_new}): "
                    + MASK_ROWS)
    return None


ERROR_READINGS = readings_with(BROADCAST, cache_mask_sizes)  # (conftest reads a stage's readings here)


def decoding_mistakes(x, weights, num_heads, chunks):
    """{description: step outputs} of the typical KV-cache mistakes."""
    return {OFF_BY_ONE: decode(x, weights, num_heads, chunks, visible="next"),
            NOT_OFFSET: decode(x, weights, num_heads, chunks, visible="from_zero"),
            UNMASKED: decode(x, weights, num_heads, chunks, visible="all"),
            NO_CACHE: decode(x, weights, num_heads, chunks, cached=False)}


def forward_mistakes(x, weights, num_heads):
    """{description: output} of chapter 3's mistakes and of the KV-cache mistakes that show in one forward."""
    whole = {why: steps[0] for why, steps in decoding_mistakes(x, weights, num_heads, [x.shape[1]]).items()}
    return {**multihead_mistakes(x, weights, num_heads), **whole}


def check_steps(outputs, expected, chunks, mistakes=None, what="", tolerance=FLOAT32):
    """Step k's output is the expected full forward's rows of chunk k. mistakes: a function giving
    {description: step outputs} (called once, on the first failure)."""
    mistakes = cache(mistakes) if mistakes else None
    for k, (a, e) in enumerate(spans(chunks)):
        assert_close(f"{what}step {k}: forward(x[:, {a}:{e}], use_cache=True)", outputs[k], expected[:, a:e],
                     **tolerance, mistakes=mistakes and (lambda k=k: {why: s[k] for why, s in mistakes().items()}),
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
    x, weights = public_fx.x, public_fx.sub("weights/")
    assert_close("forward(x) (use_cache=False)", stage.forward(CLS, public_fx.init(), x, weights), public_fx.output,
                 **FLOAT32, mistakes=partial(forward_mistakes, x, weights, 2))


@pytest.mark.public
def test_prompt_then_one_token_at_a_time(stage, public_fx):
    """A prompt of 3 tokens, then tokens 3, 4 and 5 one by one: each step gives its rows of the full forward."""
    x, weights, chunks = public_fx.x, public_fx.sub("weights/"), public_fx.chunks.tolist()
    outputs = run_decoding(stage, public_fx.init(), weights, x, chunks)
    check_steps(outputs, public_fx.output, chunks, lambda: decoding_mistakes(x, weights, 2, chunks))


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
    for k, (_, end) in enumerate(spans(chunks)):
        cache_k, cache_v = results[2 + 3 * k], results[3 + 3 * k]
        check_cache_shape(cache_k, b, num_heads, end, head_dim, f"after step {k} (tokens 0..{end - 1} fed)")
        assert_close(f"cache_k after step {k}", cache_k, keys[:, :, :end], **FLOAT32,
                     hint="cache_k holds the keys W_key(x) of every token fed so far, split into heads.")
        assert_close(f"cache_v after step {k}", cache_v, values[:, :, :end], **FLOAT32,
                     hint="cache_v holds the values W_value(x) of every token fed so far, split into heads.")


@pytest.mark.public
def test_reset_cache_starts_a_new_sequence(stage, public_fx):
    """After reset_cache() the cache is empty and the next tokens are a sequence of their own."""
    x, weights, chunks = public_fx.x, public_fx.sub("weights/"), public_fx.chunks.tolist()
    steps = [*cached_steps(x, chunks), {"method": "reset_cache"}, {"get": "cache_k"},
             {"method": "forward", "args": [x[:, :2]], "kwargs": {"use_cache": True}}]
    *_, emptied, again = stage.session(CLS, public_fx.init(), weights, steps=steps)
    assert_close("forward(x[:, 0:2], use_cache=True) after reset_cache()", again, public_fx.output[:, :2], **FLOAT32,
                 mistakes=lambda: {NOT_RESET: decode(x[:, :2], weights, 2, [2], past=x)[0],
                                   **forward_mistakes(x[:, :2], weights, 2)})
    assert emptied is None, (
        f"cache_k after reset_cache() holds {np.shape(emptied)}; expected None: {NOT_RESET}")


# ---------------------------------------------------------------- hidden

@pytest.mark.parametrize("case", ["case0", "case1"])
def test_every_step_equals_the_full_forward(stage, hidden_fx, case, device):
    """Chunks of several tokens and single tokens, up to the whole context (case1)."""
    x, weights, init = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/"), hidden_fx.init(f"{case}/")
    chunks = hidden_fx[f"{case}/chunks"].tolist()
    outputs = run_decoding(stage, init, weights, x, chunks, device=device)
    check_steps(outputs, hidden_fx[f"{case}/output"], chunks,
                lambda: decoding_mistakes(x, weights, init["num_heads"], chunks), what=sizes(init))


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
    check_steps(outputs, hidden_fx["second/output"], chunks, what="second sequence, ",
                mistakes=lambda: {NOT_RESET: decode(second, weights, init["num_heads"], chunks, past=first),
                                  **decoding_mistakes(second, weights, init["num_heads"], chunks)})
    assert emptied_k is None and emptied_v is None, (
        f"after reset_cache(), cache_k is {np.shape(emptied_k)} and cache_v {np.shape(emptied_v)}; expected None: "
        + NOT_RESET)
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
    assert_close("forward(y) (use_cache=False) after a cached step", plain, multihead(other, weights, num_heads),
                 **FLOAT32, mistakes=partial(forward_mistakes, other, weights, num_heads),
                 hint="Without use_cache, forward(y) attends over y alone, whatever the cache holds.")
    check_cache_shape(cache_k, x.shape[0], num_heads, 4, head_dim, "after 4 cached tokens and a forward without "
                      "the cache: forward(x) without use_cache must leave the cache as it is")
    assert_close("forward(x[:, 4:5], use_cache=True) after it", step, hidden_fx["case0/output"][:, 4:5], **FLOAT32)


def test_random_chunks_against_the_reference(stage, reference, rng, device):
    """Random sizes, random chunk lengths: every step, and the cache at the end, match the reference."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        num_heads, head_dim = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        num_tokens = int(rng.integers(2, 11))
        init = dict(d_in=int(rng.integers(2, 8)), d_out=num_heads * head_dim, num_heads=num_heads,
                    context_length=num_tokens + int(rng.integers(0, 3)), dropout=0.0, qkv_bias=bool(rng.integers(2)))
        x, weights = normal(rng, int(rng.integers(1, 4)), num_tokens, init["d_in"]), draw_weights(rng, ref, CLS, init)
        cuts = np.sort(rng.choice(np.arange(1, num_tokens), size=int(rng.integers(0, num_tokens)), replace=False))
        chunks = np.diff([0, *cuts, num_tokens]).tolist()
        steps = [*cached_steps(x, chunks), {"get": "cache_k"}, {"get": "cache_v"}]
        *outputs, cache_k, cache_v = stage.session(CLS, init, weights, steps=steps, device=device)
        *expected, ref_k, ref_v = ref.session(CLS, init, weights, steps=steps)
        check_steps(outputs, np.concatenate(expected, axis=1), chunks, what=sizes(init),
                    mistakes=partial(decoding_mistakes, x, weights, num_heads, chunks))
        check_cache_shape(cache_k, x.shape[0], num_heads, num_tokens, head_dim, f"after chunks {chunks}")
        assert_close("cache_k at the end", cache_k, ref_k, **FLOAT32)
        assert_close("cache_v at the end", cache_v, ref_v, **FLOAT32)


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
    for dtype in size["dtypes"]:
        outputs = run_decoding(stage, init, weights, x, chunks, device=device, dtype=dtype)
        check_steps(outputs, expected, chunks, what=f"{device}, {dtype}: ", tolerance=TOLERANCE[dtype])


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
    check_module_dropout(stage, CLS, init, x, weights, 0.5, multihead(x, weights, 2), device)

