"""The frontier-attention references against code the kit did not write: Hugging Face transformers' DeepSeek-V3
attention (multi-head latent attention, f01), gpt-oss attention (learned sinks, f02), DeepSeek-V3.2's indexer
(sparse attention, f05) and Qwen3-Next's gated delta rule (its torch fallback functions, f06).

As in test_independent_reference.py (the modern stages against Llama): each model's attention is built from a
small config with random weights, nothing downloaded, CPU only; the kit's reference module is given the same
weights by name, both run in float64, and only the order of operations and what transformers keeps in float32
(the rotation tables, eager attention's softmax) differ. The tolerances of that file apply here and say why.

FlexAttention (f04) runs torch's own flex_attention, and the graded suite compares each variant with a dense
computation of its own; two of its pieces meet outside code here: ALiBi's slopes (BLOOM's build_alibi_tensor) and
Gemma 2's soft-capping (Gemma 2's eager attention). Cross-layer KV sharing (f07) meets Gemma 3n's sharing pattern
(Gemma3nTextConfig); its layers do not meet Gemma 3n's, which normalise queries, keys and values as the kit's
stage does not. The paged KV cache (f03) meets nothing: vLLM's PagedAttention needs a GPU to install and run.

    pip install -e '.[crosscheck]'
    pytest kit_tests/test_independent_reference_frontier.py
"""
import math
import sys
import warnings

import pytest
import torch
from test_independent_reference import EXACT_TABLES, FLOAT32_SOFTMAX, FLOAT64, IMPLEMENTATIONS, assert_same, causal_mask

from grader.kit import SOLUTIONS
from suite_runtime.adapters import load_stage_module

transformers = pytest.importorskip(
    "transformers", minversion="4.48",
    reason="comparing the references with Hugging Face's models needs transformers>=4.48: pip install -e "
    "'.[crosscheck]' (CPU only, no model is downloaded)")

D_MODEL, NUM_HEADS, TOKENS, BATCH = 64, 4, 16, 2
EXACT_THETA = 2.0**16  # with rotary widths 8 and 16 every inverse frequency is a power of two (see the Llama file)
STEPS = (5, 1, 1, 1, 3, 1, 1, 1, 1, 1)  # a prompt chunk, tokens one at a time, another chunk, more single tokens


def stage_module(name):
    return load_stage_module(SOLUTIONS, name)


def randomize(module, seed):
    """Every parameter of ``module`` drawn N(0, 1/fan_in) (queries and keys of order 1: softmax neither saturated
    nor uniform), as float64; a 1-d parameter (a norm's scale) near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1]))
    return module.to(torch.float64).eval()


def load(kit, weights):
    """The kit's module with ``weights`` ({its name: tensor}); an out_proj bias the model lacks becomes 0."""
    state = dict(weights)
    if "out_proj.bias" not in state:
        state["out_proj.bias"] = torch.zeros(kit.out_proj.bias.shape, dtype=torch.float64)
    kit.load_state_dict(state, strict=False)
    missing = {n for n, _ in kit.named_parameters()} - set(state)
    assert not missing, f"no transformers weight for {sorted(missing)}"
    return kit.to(torch.float64).eval()


def tokens(seed, count=TOKENS, batch=BATCH, width=D_MODEL):
    return torch.randn(batch, count, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def layer_cache(cache):
    """What transformers' DynamicCache holds for its one layer (two tensors), in old and new versions."""
    if hasattr(cache, "layers"):
        return cache.layers[0].keys, cache.layers[0].values
    return cache.key_cache[0], cache.value_cache[0]


def softmax_tolerance(implementation):
    return FLOAT64 if implementation == "sdpa" else FLOAT32_SOFTMAX


# ---------------------------------------------------------------- f01: DeepSeek-V3's multi-head latent attention

deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
LATENT, ROPE, NOPE = 16, 8, D_MODEL // NUM_HEADS


def deepseek_pair(implementation, seed=0):
    """DeepseekV3Attention (no query compression: q_lora_rank=None, as DeepSeek-V2-Lite; halves-layout RoPE:
    rope_interleave=False, the kit's layout) and the kit's MultiHeadLatentAttention with its weights:
    q_proj -> W_query (the same per-head [content | rotary] rows), kv_a_proj_with_mqa's first LATENT rows ->
    W_kv_down and its last ROPE rows -> W_key_rope, kv_a_layernorm -> kv_norm, kv_b_proj's per-head
    [key | value] rows -> W_key_up and W_value_up, o_proj -> out_proj. Returns (kit, hf, rotary)."""
    config = transformers.DeepseekV3Config(
        hidden_size=D_MODEL, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS, q_lora_rank=None,
        kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=NOPE, rope_interleave=False,
        attention_bias=False, rope_theta=EXACT_THETA, max_position_embeddings=TOKENS, num_hidden_layers=1,
        attn_implementation=implementation)
    hf = randomize(deepseek.DeepseekV3Attention(config, layer_idx=0), seed)
    down = hf.kv_a_proj_with_mqa.weight
    up = hf.kv_b_proj.weight.view(NUM_HEADS, 2 * NOPE, LATENT)
    kit = stage_module("f01_latent_attention").MultiHeadLatentAttention(
        D_MODEL, D_MODEL, TOKENS, NUM_HEADS, LATENT, ROPE, theta_base=EXACT_THETA)
    kit = load(kit, {"W_query.weight": hf.q_proj.weight, "W_kv_down.weight": down[:LATENT],
                     "W_key_rope.weight": down[LATENT:], "kv_norm.weight": hf.kv_a_layernorm.weight,
                     "W_key_up.weight": up[:, :NOPE].reshape(D_MODEL, LATENT),
                     "W_value_up.weight": up[:, NOPE:].reshape(D_MODEL, LATENT), "out_proj.weight": hf.o_proj.weight})
    return kit, hf, deepseek.DeepseekV3RotaryEmbedding(config)


def deepseek_forward(hf, rotary, x, cache=None):
    past = 0 if cache is None else cache.get_seq_length()
    cos, sin = rotary(x, torch.arange(past, past + x.shape[1])[None])
    output, _ = hf(x, (cos, sin), causal_mask(past, x.shape[1], x.dtype), cache)
    return output


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_latent_attention_equals_deepseek_v3(implementation, absorbed):
    """Both forms of the whole-sequence forward against DeepseekV3Attention's."""
    kit, hf, rotary = deepseek_pair(implementation)
    x = tokens(seed=1)
    with torch.no_grad():
        assert_same(f"MLA's causal forward ({'absorbed' if absorbed else 'expanded'})", kit(x, absorbed=absorbed),
                    deepseek_forward(hf, rotary, x), **EXACT_TABLES)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_latent_cache_equals_deepseek_v3_at_every_step(implementation):
    """Decoding in chunks (absorbed form) with transformers' DynamicCache beside: the outputs and what is cached
    (transformers keeps the normalised latent and the rotated rotary key, one "head" each) agree at every step;
    after reset_cache a second sequence starts again at position 0."""
    kit, hf, rotary = deepseek_pair(implementation, seed=3)
    with torch.no_grad():
        for seed, steps in ((2, STEPS), (4, STEPS[::-1])):
            x, cache, start = tokens(seed=seed), transformers.DynamicCache(), 0
            for chunk in steps:
                new = x[:, start:start + chunk]
                where = f"tokens {start}..{start + chunk - 1}"
                assert_same(f"the cached forward of {where}", kit(new, use_cache=True, absorbed=True),
                            deepseek_forward(hf, rotary, new, cache), **EXACT_TABLES)
                latent, k_rope = layer_cache(cache)  # (b, 1, tokens, LATENT), (b, 1, tokens, ROPE)
                assert_same(f"cache_latent after {where}", kit.cache_latent, latent[:, 0], **EXACT_TABLES)
                assert_same(f"cache_k_rope after {where}", kit.cache_k_rope, k_rope[:, 0], **EXACT_TABLES)
                start += chunk
            kit.reset_cache()


# ---------------------------------------------------------------- f02: gpt-oss's learned attention sinks

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
KV_HEADS, HEAD_DIM, WINDOW = 2, 16, 5


def gpt_oss_pair(bias, seed=0):
    """GptOssAttention (grouped queries, its learned `sinks`, attention_bias as given; transformers runs it in its
    eager path: its sdpa path has no sinks) and the kit's SinkAttention with its weights by name: q/k/v/o_proj ->
    W_query, W_key, W_value, out_proj, sinks -> sinks."""
    config = transformers.GptOssConfig(
        hidden_size=D_MODEL, num_attention_heads=NUM_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        attention_bias=bias, sliding_window=WINDOW, num_hidden_layers=1, layer_types=["sliding_attention"],
        attn_implementation="eager")
    hf = randomize(gpt_oss.GptOssAttention(config, layer_idx=0), seed)
    with torch.no_grad():  # sink logits of the size of the scores, some above them, some below
        hf.sinks.copy_(torch.linspace(-2.0, 2.0, NUM_HEADS))
    weights = {f"{ours}.{kind}": getattr(getattr(hf, theirs), kind)
               for ours, theirs in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                                    ("out_proj", "o_proj"))
               for kind in ("weight", "bias") if getattr(getattr(hf, theirs), kind) is not None}
    return weights, hf


def window_mask(past, new, window, dtype):
    """What GptOssModel gives a sliding layer: the causal mask with keys window or more positions back masked too."""
    i = torch.arange(past, past + new)[:, None]
    j = torch.arange(past + new)[None, :]
    blocked = (j > i) | (i - j >= window) if window is not None else j > i
    return torch.zeros(1, 1, new, past + new, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def gpt_oss_forward(hf, x, window, cache=None):
    """transformers' output for x after the tokens in ``cache``, RoPE by angle 0 (the kit's stage has none)."""
    past = 0 if cache is None else cache.get_seq_length()
    new = x.shape[1]
    cos, sin = torch.ones(1, new, HEAD_DIM // 2, dtype=x.dtype), torch.zeros(1, new, HEAD_DIM // 2, dtype=x.dtype)
    output, _ = hf(x, (cos, sin), window_mask(past, new, window, x.dtype), cache)
    return output


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "gpt-oss-biases"])
def test_sinks_equal_gpt_oss(bias, window):
    """The whole-sequence forward, full causal and on a sliding layer, against GptOssAttention's; then cached decoding
    (the kit's cache bounded by the window, transformers' holding every token under the same mask) at every step."""
    weights, hf = gpt_oss_pair(bias)
    kit = stage_module("f02_attention_sinks").SinkAttention(
        D_MODEL, NUM_HEADS * HEAD_DIM, TOKENS, NUM_HEADS, num_kv_groups=KV_HEADS, window=window, qkv_bias=bias)
    kit = load(kit, {**weights, "sinks": hf.sinks})
    x = tokens(seed=5)
    with torch.no_grad():
        assert_same("the forward with sinks", kit(x), gpt_oss_forward(hf, x, window), **FLOAT32_SOFTMAX)
        cache, start = transformers.DynamicCache(), 0
        for chunk in STEPS:
            new = x[:, start:start + chunk]
            assert_same(f"the cached forward of tokens {start}..{start + chunk - 1}", kit(new, use_cache=True),
                        gpt_oss_forward(hf, new, window, cache), **FLOAT32_SOFTMAX)
            start += chunk
        assert kit.cache_k.shape[2] <= (WINDOW if window else TOKENS)


# ---------------------------------------------------------------- f04: BLOOM's ALiBi slopes, Gemma 2's soft-capping

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")


@pytest.mark.parametrize("num_heads", [1, 4, 6, 12, 16, 40])
def test_alibi_slopes_equal_bloom(num_heads):
    """alibi_slopes against the slopes in BLOOM's build_alibi_tensor (its bias at distance 1), powers of 2 and not."""
    bias = bloom.build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)  # (heads, 1, 2)
    assert_same(f"alibi_slopes({num_heads})", stage_module("f04_flex_attention").alibi_slopes(num_heads),
                bias[:, 0, 1], rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("window", [None, 5], ids=["global", "local"])
def test_soft_capping_equals_gemma2(window, monkeypatch):
    """gemma2_attention (flex_attention with the kit's soft_cap and causal or sliding-window mask_mod) against
    Gemma 2's eager attention with softcap and the same mask, scores large enough for the cap to act. Both in
    float64 but Gemma 2's softmax, taken in float32: FLOAT32_SOFTMAX."""
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(BATCH, NUM_HEADS, TOKENS, HEAD_DIM, generator=generator, dtype=torch.float64)
               for _ in range(3))
    q = 6 * q  # scores of std ~6: many beyond the cap of 5
    layer = type("Layer", (), {"num_key_value_groups": 1, "training": False, "head_dim": HEAD_DIM})()
    theirs, _ = gemma2.eager_attention_forward(layer, q, k, v, window_mask(0, TOKENS, window, torch.float64),
                                               scaling=HEAD_DIM**-0.5, softcap=5.0)
    flex = stage_module("f04_flex_attention")
    monkeypatch.setitem(sys.modules, flex.__name__, flex)  # importable by name, as torch.compile's tracing needs
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        ours = flex.gemma2_attention(q, k, v, cap=5.0, window=window)
    assert_same(f"gemma2_attention(cap=5, window={window})", ours, theirs.transpose(1, 2), **FLOAT32_SOFTMAX)


# ---------------------------------------------------------------- f05: DeepSeek-V3.2's lightning indexer

deepseek_v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
INDEX_HEADS, INDEX_DIM, INDEX_ROPE, TOP_K, Q_RANK = 16, 16, 8, 5, 32


def test_indexer_selects_as_deepseek_v32():
    """DeepseekV32Indexer's top-k keys per query (its queries from a query residual, its keys layer-normed; RoPE by
    angle 0) against the kit's lightning_index_scores of the same queries, keys and head weights (caught on their way
    through transformers' module), masked causally, top TOP_K: the same keys for every query, and where a query has
    fewer keys, all of them. transformers scores in float32: each query's kept and dropped keys are checked to be
    apart by far more than that rounding, so the comparison is exact."""
    config = transformers.DeepseekV32Config(
        hidden_size=D_MODEL, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS, q_lora_rank=Q_RANK,
        kv_lora_rank=16, qk_rope_head_dim=INDEX_ROPE, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM, index_topk=TOP_K, num_hidden_layers=1)
    indexer = randomize(deepseek_v32.DeepseekV32Indexer(config, layer_idx=0), seed=7)
    caught = {}
    for name in ("wq_b", "k_norm", "weights_proj"):
        getattr(indexer, name).register_forward_hook(lambda module, args, out, name=name: caught.__setitem__(name, out))
    x, q_resid = tokens(seed=8), tokens(seed=9, width=Q_RANK)
    cos = torch.ones(BATCH, TOKENS, INDEX_ROPE, dtype=torch.float64)
    past = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril().expand(BATCH, TOKENS, TOKENS)
    with torch.no_grad():
        theirs = indexer(x, q_resid, (cos, torch.zeros_like(cos)), past, None).long()  # (b, T, TOP_K)
    queries = caught["wq_b"].view(BATCH, TOKENS, INDEX_HEADS, INDEX_DIM)
    scores = stage_module("f05_sparse_indexer").lightning_index_scores(queries, caught["k_norm"],
                                                                       caught["weights_proj"])
    scores = scores.masked_fill(~past, -torch.inf)
    ranked = scores.sort(dim=-1, descending=True).values
    gap = (ranked[..., TOP_K - 1] - ranked[..., TOP_K])[:, TOP_K:]  # the queries with more than TOP_K keys
    assert bool((gap > 1e-4 * ranked[..., 0].abs()[:, TOP_K:]).all()), "a near tie at the top-k boundary: another seed"
    ours = torch.zeros_like(past).scatter_(-1, scores.topk(TOP_K, dim=-1).indices, True) & past
    selected = torch.zeros_like(past).scatter_(-1, theirs, True) & past
    assert torch.equal(ours, selected), (
        f"the kit's top-{TOP_K} differs from DeepseekV32Indexer's for queries "
        f"{sorted({int(i) for i in (ours != selected).any(-1).nonzero()[:, 1]})}")


# ---------------------------------------------------------------- f06: Qwen3-Next's gated delta rule

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
# transformers' torch functions compute in float32 whatever their inputs ("make sure all tensors are fp32"): the two
# sides then differ by float32 rounding carried through the recurrence, a few 1e-7 on outputs of order 1 over these
# 40 tokens (seen: 3e-7); 1e-5 leaves room, while a mistake of the rule (no correction, the decay after the write,
# a state not carried) moves outputs by 1e-2 or more.
DELTA_RULE = dict(rtol=1e-5, atol=1e-5)


def delta_rule_inputs(seed, b=2, h=3, t=40, d_k=8, d_v=6):
    """q, unit keys, v, log decays g <= 0, rates beta in (0, 1) (kit layout (b, h, T, ...)) and an initial state."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    k = draw(b, h, t, d_k)
    return (draw(b, h, t, d_k), k / k.norm(dim=-1, keepdim=True), draw(b, h, t, d_v),
            torch.nn.functional.logsigmoid(draw(b, h, t) + 2), torch.sigmoid(draw(b, h, t)), 0.5 * draw(b, h, d_k, d_v))


@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64], ids=["recurrent", "chunks-1", "chunks-7", "chunks-64"])
def test_gated_delta_rule_equals_qwen3_next(chunk_size):
    """The kit's recurrent and chunked forms against transformers' torch_recurrent_gated_delta_rule (token by token)
    and torch_chunk_gated_delta_rule (chunks of 64, padded), outputs and final states, from an initial state.
    transformers lays tensors out as (b, T, h, ...): transposed here."""
    q, k, v, g, beta, state = delta_rule_inputs(seed=11)
    stage = stage_module("f06_gated_delta_rule")
    ours = (stage.gated_delta_rule_recurrent(q, k, v, g, beta, state) if chunk_size is None
            else stage.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size, state))
    theirs_in = [t.transpose(1, 2) for t in (q, k, v, g, beta)]
    for name, function in (("recurrent", qwen3_next.torch_recurrent_gated_delta_rule),
                           ("chunked", qwen3_next.torch_chunk_gated_delta_rule)):
        out, final = function(*theirs_in, initial_state=state, output_final_state=True)
        form = "recurrent form" if chunk_size is None else f"chunked form ({chunk_size})"
        assert_same(f"the {form}'s outputs against transformers' {name}", ours[0], out.transpose(1, 2), **DELTA_RULE)
        assert_same(f"the {form}'s final state against transformers' {name}", ours[1], final, **DELTA_RULE)


# ---------------------------------------------------------------- f07: Gemma 3n's sharing pattern

@pytest.mark.parametrize(("num_layers", "num_shared"), [(35, 15), (30, 10), (6, 2), (4, 1)])
def test_shared_tail_matches_gemma3n(num_layers, num_shared):
    """shared_tail_kv_sources against transformers' Gemma3nTextConfig.kv_sharing_modes with every layer of one type
    (the kit's stage has no sliding layers): the "reuse" layers are the ones that read another's keys and values,
    all of them the one "store" layer's; the others compute their own. The default config (35 layers, the last 15
    shared) is also what test_f07's cache-bytes check counts."""
    config = transformers.Gemma3nTextConfig(num_hidden_layers=num_layers, num_kv_shared_layers=num_shared,
                                            layer_types=["full_attention"] * num_layers)
    modes = config.kv_sharing_modes
    [store] = [layer for layer, mode in enumerate(modes) if mode == "store"]
    theirs = [store if mode == "reuse" else layer for layer, mode in enumerate(modes)]
    ours = list(stage_module("f07_cross_layer_kv").shared_tail_kv_sources(num_layers, num_shared))
    assert ours == theirs, f"shared_tail_kv_sources({num_layers}, {num_shared}) = {ours}; Gemma 3n's: {theirs}"


def test_gemma3n_defaults_are_the_ones_the_suite_counts():
    config = transformers.Gemma3nTextConfig()
    assert (config.num_hidden_layers, config.num_kv_shared_layers, config.num_key_value_heads, config.head_dim) == (
        35, 15, 2, 256), "test_f07_cross_layer_kv's cache-bytes check quotes these defaults: update it"
