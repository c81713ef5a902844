"""The modern-attention references against code the kit did not write: Hugging Face transformers' Llama.

The graded suite's hidden tests take their expected values from solutions/ (the ``reference`` fixture),
so a mistake in a reference would be graded as right and the right answer as wrong. Here the
references of m03 (KV cache), m04 (grouped-query attention) and m05 (rotary embeddings) meet
``transformers.models.llama.modeling_llama``: LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb
and DynamicCache, the code that runs Llama checkpoints. It is built from a small LlamaConfig with random
weights: nothing is downloaded, everything runs on the CPU.

How the two sides meet:
- Weights by name: q_proj, k_proj, v_proj, o_proj -> W_query, W_key, W_value, out_proj. Llama's attention
  has no biases (attention_bias=False), while the kit's out_proj always has one (as chapter 3's
  MultiHeadAttention): it is set to zero, which adds nothing. With attention_bias=True every projection
  has a bias on both sides (qkv_bias=True) and they are copied too.
- Positions: LlamaAttention rotates queries and keys by the (cos, sin) its caller passes (LlamaModel
  gets them from LlamaRotaryEmbedding at the cache's position). The stages without RoPE (m03, m04) meet
  it with cos = 1 and sin = 0, the rotation by angle 0, which leaves every vector as it is.
- The causal mask: LlamaAttention's eager path adds the mask its caller passes (LlamaModel makes it from
  the cache position); it is made here the same way: a query at position p sees the keys at 0..p.
- Both sides compute in float64, so that little more than the order of the operations differs between
  them. What stays float32 in transformers whatever the input's dtype sets the tolerances below: the
  rotation tables (LlamaRotaryEmbedding.forward) and the eager path's softmax (eager_attention_forward).

    pip install -e '.[crosscheck]'          # transformers, CPU only; it does not reinstall torch
    pytest kit_tests/test_independent_reference.py
"""
import math

import pytest
import torch

from grader.kit import SOLUTIONS
from suite_runtime.adapters import load_stage_module

transformers = pytest.importorskip(
    "transformers", minversion="4.48",
    reason="comparing the references with Hugging Face's Llama attention needs transformers>=4.48: "
    "pip install -e '.[crosscheck]' (or pip install 'transformers>=4.48'; CPU only, no model is downloaded)",
)
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

# transformers' two attention paths for a CPU, both compared. "sdpa" (Llama's default) hands the float64
# tensors to torch's scaled_dot_product_attention (decoding one token with fewer key/value heads, it packs
# the query heads of a group into one sequence instead of repeating the keys). "eager" is transformers' own
# matrix products, but it takes the softmax in float32 whatever the input's dtype (eager_attention_forward).
IMPLEMENTATIONS = ["eager", "sdpa"]
# sdpa: same maths in float64, another order of operations (scaling before masking, masking by adding
# finfo.min rather than filling -inf, heads repeated by expand + reshape or packed). Sums of a few dozen
# terms of order 1 then agree to about 1e-14 (eps 2.2e-16); 1e-9 leaves a wide margin, while any real
# mistake (a position off by one, a query head reading the wrong key head, a cache not reset) moves values
# by more than 1e-3.
FLOAT64 = dict(rtol=1e-9, atol=1e-9)
# eager: attention weights rounded to float32 (2**-24 relative), summed over at most 16 values of order 1:
# the outputs may differ by a few 1e-7.
FLOAT32_SOFTMAX = dict(rtol=1e-6, atol=1e-6)

# The rotation tables. Both sides build them in float32 (transformers always does), from inverse
# frequencies computed by different formulas: theta ** (-2i/d) in the kit, 1 / theta ** (2i/d) in
# transformers. Each rounds the inverse frequency and the product position * frequency, so an angle may
# differ by a few float32 steps of its own size (2**-24 relative each; seen: 2 steps, 6e-5 at angle 270),
# and cos/sin by as much in absolute terms, plus their own rounding (torch's float32 cos and sin are within
# about a step each; seen: one step, 6e-8, at angles near 0). The bound below allows 8 steps of the angle
# and 2 of the value, twice what was seen: at position 10_000 the fastest pair (angle 10_000 rad) may
# differ by 5e-3, the slowest by about 2e-7. Any real mistake moves entries by far more at these
# positions: a position off by one moves the fastest pair by a whole radian, the interleaved layout or
# another theta base scrambles them.
STEP32 = 2.0**-24


def table_bound(angles):
    return 8 * STEP32 * angles.abs() + 2 * STEP32


# With theta_base = 2**16 and head_dim 16, every inverse frequency is a power of two (2**0, 2**-2, ...,
# 2**-14), exact in float32 whichever formula computes it, and so is every angle position * frequency
# below 2**24: both sides' tables then hold cos and sin of the same exact angles, equal to one float32
# step (6e-8) at most (should one side compute them in float64). That step, carried through a rotation,
# a 16-term dot product and the softmax of values of order 1, stays under 1e-6, as eager's float32
# softmax does.
EXACT_THETA = 2.0**16
EXACT_TABLES = dict(rtol=1e-6, atol=1e-6)
# The default base 10_000 over TOKENS positions: the table bound above at angle TOKENS is 8 * 2**-24 * 16
# = 8e-6 per entry; through the dot products and softmax that stays well below 1e-4, float32's usual
# tolerance in the suite.
DEFAULT_TABLES = dict(rtol=1e-4, atol=1e-4)

D_MODEL, NUM_HEADS, HEAD_DIM = 64, 4, 16  # Llama's layout: d_in = d_out = hidden_size
TOKENS, BATCH = 16, 2
FAR = 10_000  # positions far beyond TOKENS, for the rotation alone
LONG, PROMPT_CHUNK = 4096, 512  # a long prompt for whole modules, fed in chunks to keep the score matrices small
# A prompt chunk, tokens one at a time, another chunk, more single tokens: TOKENS in all.
STEPS = (5, 1, 1, 1, 3, 1, 1, 1, 1, 1)
# The tests below build each of these stages' modules from a LlamaConfig; m05 is also compared function by function.
STAGES = ("m03_kv_cache", "m04_grouped_query", "m05_rotary_embeddings")


@pytest.fixture(scope="module")
def refs():
    """The kit's reference stage modules, by stage name."""
    return {name: load_stage_module(SOLUTIONS, name) for name in STAGES}


def assert_same(name, actual, expected, *, rtol, atol):
    """``actual`` equals ``expected`` within tolerance; the message names the array and shows both.
    atol may be a tensor: a bound for each entry."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, (
        f"{name} has shape {tuple(actual.shape)}, transformers' {tuple(expected.shape)}")
    actual = actual.to(torch.float64)
    expected = expected.to(torch.float64)
    off = (actual - expected).abs() > atol + rtol * expected.abs()
    if off.any():
        first = tuple(int(i) for i in off.nonzero()[0])
        within = f"rtol={rtol:g}, atol={atol:g}" if isinstance(atol, float) else "a bound for each entry"
        row = first[:-1]
        raise AssertionError(
            f"{name} differs from transformers' in {int(off.sum())} of {off.numel()} entries "
            f"(largest difference {(actual - expected).abs().max():.3g}; {within}); "
            f"first at {first}, its row:\n"
            f"  transformers: {expected[row].tolist()}\n  kit:          {actual[row].tolist()}"
        )


def llama_config(num_kv_heads, bias, theta, context_length, implementation="eager"):
    return transformers.LlamaConfig(
        hidden_size=D_MODEL, num_attention_heads=NUM_HEADS, num_key_value_heads=num_kv_heads, head_dim=HEAD_DIM,
        attention_bias=bias, rope_theta=theta, max_position_embeddings=context_length,
        attn_implementation=implementation,
    )


def llama_attention(config, seed):
    """Hugging Face's LlamaAttention with random float64 weights of a size that keeps softmax neither
    saturated nor uniform: x ~ N(0, 1) and weights ~ N(0, 1/d_model) give queries and keys of order 1."""
    attention = llama.LlamaAttention(config, layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(D_MODEL))
    return attention.to(torch.float64).eval()


NAMES = {"W_query": "q_proj", "W_key": "k_proj", "W_value": "v_proj", "out_proj": "o_proj"}


def take_weights(kit, hf):
    """Copy transformers' weights into the kit's module by name; an out_proj bias Llama lacks becomes 0."""
    with torch.no_grad():
        for ours, theirs in NAMES.items():
            mine, source = getattr(kit, ours), getattr(hf, theirs)
            assert mine.weight.shape == source.weight.shape, (
                f"{ours}.weight has shape {tuple(mine.weight.shape)}, "
                f"transformers' {theirs}.weight {tuple(source.weight.shape)}")
            mine.weight.copy_(source.weight)
            if source.bias is not None:
                mine.bias.copy_(source.bias)
            elif mine.bias is not None:
                assert ours == "out_proj", f"{ours} has a bias although qkv_bias=False"
                mine.bias.zero_()
    return kit.to(torch.float64).eval()


def build_pair(refs, stage, kv_groups, theta, bias, implementation, context_length=TOKENS, seed=0):
    """The kit's module of ``stage`` and transformers' twin with the same weights, and the twin's rotary
    embedding (None where the stage has no RoPE)."""
    num_kv_heads = kv_groups or NUM_HEADS
    config = llama_config(num_kv_heads, bias, theta or 10_000.0, context_length, implementation)
    hf = llama_attention(config, seed)
    module = refs[stage]
    if stage == "m03_kv_cache":
        kit = module.MultiHeadAttentionWithCache(D_MODEL, D_MODEL, context_length, NUM_HEADS, qkv_bias=bias)
    elif stage == "m04_grouped_query":
        kit = module.GroupedQueryAttention(D_MODEL, D_MODEL, context_length, NUM_HEADS, kv_groups, qkv_bias=bias)
    else:
        kit = module.RoPEAttention(D_MODEL, D_MODEL, context_length, NUM_HEADS, num_kv_groups=kv_groups,
                                   qkv_bias=bias, theta_base=theta)
    rotary = llama.LlamaRotaryEmbedding(config=config) if stage == "m05_rotary_embeddings" else None
    return take_weights(kit, hf), hf, rotary


def causal_mask(past, new, dtype):
    """What LlamaModel gives its layers for ``new`` queries after ``past`` cached tokens: 0 where key j
    takes part for the query at position past + i (j <= past + i), the dtype's most negative value elsewhere."""
    blocked = torch.ones(new, past + new, dtype=torch.bool).triu(diagonal=past + 1)
    return torch.zeros(1, 1, new, past + new, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def hf_forward(attention, rotary, x, cache=None):
    """transformers' output for x, the tokens after those in ``cache`` (None: x is the whole sequence)."""
    past = 0 if cache is None else cache.get_seq_length()
    new = x.shape[1]
    if rotary is None:  # rotation by angle 0
        cos, sin = torch.ones(1, new, HEAD_DIM, dtype=x.dtype), torch.zeros(1, new, HEAD_DIM, dtype=x.dtype)
    else:
        cos, sin = rotary(x, torch.arange(past, past + new)[None])
    # The cache goes by position: its keyword was renamed across versions (past_key_value, past_key_values, cache).
    output, _ = attention(x, (cos, sin), causal_mask(past, new, x.dtype), cache)
    return output


def hf_cached(cache):
    """The keys and values transformers' DynamicCache holds for its one layer: newer versions keep a list of
    layers, older ones a list of keys and one of values."""
    if hasattr(cache, "layers"):
        return cache.layers[0].keys, cache.layers[0].values
    return cache.key_cache[0], cache.value_cache[0]


def tokens(seed, count=TOKENS, batch=BATCH):
    return torch.randn(batch, count, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# (stage, key/value heads, theta_base): m03 is plain multi-head attention (as many key/value heads as query
# heads, no rotation); m04 and m05 take every grouping, 1 being multi-query attention (m05's None: num_heads);
# m05 with the exact tables, and once with the default base.
CASES = [("m03_kv_cache", NUM_HEADS, None), ("m04_grouped_query", NUM_HEADS, None), ("m04_grouped_query", 2, None),
         ("m04_grouped_query", 1, None), ("m05_rotary_embeddings", None, EXACT_THETA),
         ("m05_rotary_embeddings", 2, EXACT_THETA), ("m05_rotary_embeddings", 1, EXACT_THETA),
         ("m05_rotary_embeddings", 2, 10_000.0)]
CASE_IDS = [f"{stage[:3]}-kv{kv or NUM_HEADS}" + (f"-theta{theta:g}" if theta else "") for stage, kv, theta in CASES]


def tolerance(theta, implementation):
    if theta is None:
        return FLOAT64 if implementation == "sdpa" else FLOAT32_SOFTMAX
    return EXACT_TABLES if theta == EXACT_THETA else DEFAULT_TABLES


@pytest.mark.parametrize("theta", [10_000.0, 500_000.0, EXACT_THETA], ids=["llama2", "llama3", "exact"])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 128])
def test_rope_tables_equal_transformers_default_rope(refs, head_dim, theta):
    """rope_angles gives transformers' cos and sin at every position up to far beyond the test length."""
    positions = FAR + TOKENS
    config = transformers.LlamaConfig(hidden_size=head_dim * NUM_HEADS, num_attention_heads=NUM_HEADS,
                                      head_dim=head_dim, rope_theta=theta, max_position_embeddings=positions)
    rotary = llama.LlamaRotaryEmbedding(config=config)
    assert rotary.rope_type == "default"
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    kit_cos, kit_sin = refs["m05_rotary_embeddings"].rope_angles(head_dim, positions, theta_base=theta)
    # The exact angles, in float64, for the bound: position * theta ** (-2i / d), each pair's twice (halves).
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * torch.cat([inv_freq, inv_freq])
    for name, kit, theirs in (("cos", kit_cos, cos[0]), ("sin", kit_sin, sin[0])):
        assert_same(f"rope_angles' {name}", kit, theirs, rtol=0.0, atol=table_bound(angles))


@pytest.mark.parametrize("offset", [0, 3, FAR])
def test_apply_rope_rotates_as_transformers(refs, offset):
    """apply_rope turns queries and keys (of any number of heads) as apply_rotary_pos_emb does, at
    positions offset .. offset + TOKENS - 1, with the same tables (transformers' own, in float64)."""
    config = llama_config(2, False, 10_000.0, FAR + TOKENS)
    rotary = llama.LlamaRotaryEmbedding(config=config)
    generator = torch.Generator().manual_seed(offset)
    queries = torch.randn(BATCH, NUM_HEADS, TOKENS, HEAD_DIM, generator=generator, dtype=torch.float64)
    keys = torch.randn(BATCH, 2, TOKENS, HEAD_DIM, generator=generator, dtype=torch.float64)
    cos, sin = rotary(queries, torch.arange(FAR + TOKENS)[None])  # (1, positions, head_dim)
    window = slice(offset, offset + TOKENS)
    theirs = llama.apply_rotary_pos_emb(queries, keys, cos[:, window], sin[:, window])
    apply_rope = refs["m05_rotary_embeddings"].apply_rope
    for name, x, expected in (("queries", queries, theirs[0]), ("keys", keys, theirs[1])):
        assert_same(f"apply_rope({name}, offset={offset})", apply_rope(x, cos[0], sin[0], offset=offset),
                    expected, **FLOAT64)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["llama-no-bias", "all-biases"])
@pytest.mark.parametrize(("stage", "kv_groups", "theta"), CASES, ids=CASE_IDS)
def test_causal_forward_equals_transformers(refs, stage, kv_groups, theta, bias, implementation):
    """forward(x) without the cache, for the whole sequence at once."""
    kit, hf, rotary = build_pair(refs, stage, kv_groups, theta, bias, implementation)
    x = tokens(seed=1)
    with torch.no_grad():
        assert_same("the causal forward", kit(x), hf_forward(hf, rotary, x), **tolerance(theta, implementation))


def decode_and_compare(kit, hf, rotary, x, chunks, rtol, atol):
    """Feed x chunk by chunk to the kit's module (use_cache=True) and to transformers with a DynamicCache:
    the outputs, and the keys and values cached, are equal after every chunk, and equal to the full forward."""
    cache = transformers.DynamicCache()
    full = hf_forward(hf, rotary, x)
    start = 0
    for chunk in chunks:
        new = x[:, start:start + chunk]
        where = f"tokens {start}..{start + chunk - 1}"
        theirs = hf_forward(hf, rotary, new, cache)
        ours = kit(new, use_cache=True)
        assert_same(f"the cached forward of {where}", ours, theirs, rtol=rtol, atol=atol)
        assert_same(f"the cached forward of {where} (against the full forward)", ours,
                    full[:, start:start + chunk], rtol=rtol, atol=atol)
        # Llama's cache, as transformers', holds keys after the rotation: a step rotates only its new keys.
        keys, values = hf_cached(cache)
        assert_same(f"cache_k after {where}", kit.cache_k, keys, rtol=rtol, atol=atol)
        assert_same(f"cache_v after {where}", kit.cache_v, values, rtol=rtol, atol=atol)
        start += chunk
    assert start == x.shape[1]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["llama-no-bias", "all-biases"])
@pytest.mark.parametrize(("stage", "kv_groups", "theta"), CASES, ids=CASE_IDS)
def test_cached_decoding_equals_transformers_at_every_step(refs, stage, kv_groups, theta, bias, implementation):
    """A prompt chunk, then tokens one by one and another chunk; then reset_cache and a second sequence,
    which must start again from position 0 with nothing of the first one cached."""
    kit, hf, rotary = build_pair(refs, stage, kv_groups, theta, bias, implementation)
    with torch.no_grad():
        decode_and_compare(kit, hf, rotary, tokens(seed=2), STEPS, **tolerance(theta, implementation))
        kit.reset_cache()
        assert kit.cache_k is None and kit.cache_v is None, "reset_cache leaves cache_k/cache_v not None"
        decode_and_compare(kit, hf, rotary, tokens(seed=3), STEPS[::-1], **tolerance(theta, implementation))


@pytest.mark.parametrize("kv_groups", [None, 1])
def test_rope_attention_far_positions(refs, kv_groups):
    """RoPEAttention decoding at positions LONG .. LONG + TOKENS - 1, after a prompt of LONG tokens fed in
    chunks: equal to transformers' at every step (the exact tables keep the comparison tight this far out)."""
    kit, hf, rotary = build_pair(refs, "m05_rotary_embeddings", kv_groups, EXACT_THETA, bias=False,
                                 implementation="sdpa", context_length=LONG + TOKENS)
    x = tokens(seed=4, count=LONG + TOKENS, batch=1)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        for start in range(0, LONG, PROMPT_CHUNK):
            new = x[:, start:start + PROMPT_CHUNK]
            assert_same(f"the cached forward of tokens {start}..{start + PROMPT_CHUNK - 1}", kit(new, use_cache=True),
                        hf_forward(hf, rotary, new, cache), **EXACT_TABLES)
        for position in range(LONG, LONG + TOKENS):
            new = x[:, position:position + 1]
            assert_same(f"the cached forward of token {position}", kit(new, use_cache=True),
                        hf_forward(hf, rotary, new, cache), **EXACT_TABLES)
