"""The notebook of the second assignment, modern-attention: what each stage teaches.

Per stage: (title, explanation in markdown, demo body), as ``grader.course.notebook.STAGES`` for chapter 3.
The demo body runs inside ``@demo(stage) def show():`` so its imports and names stay local; it prints
what the learner's module computes on a small example.
"""

INTRO = """\
# Attention as today's LLMs run it

Chapter 3 of *Build a Large Language Model (From Scratch)* ends with a `MultiHeadAttention` module.
The models people run today keep that module's idea and change how it is computed: PyTorch's fused
kernel, masks for batches of different lengths, a cache of keys and values for generation, fewer
key/value heads than query heads, rotary position embeddings, a sliding window, and attention computed
tile by tile without ever holding the whole score matrix. Each stage below takes one of those steps,
starting from the chapter-3 module you wrote.

Each stage lives in its own module (`m01_pytorch_attention.py`, ...) next to this notebook: fill in the
TODOs there, then run the stage's cells here. `check("kv_cache")` (or `pytest -m kv_cache` in a terminal)
runs a stage's public tests on your module.
"""

OUTRO = """\
## Submitting

Submit this folder as it is: the notebook and your seven stage modules. Grading runs the public
tests you have and hidden tests with other sizes, inputs and weights on your modules, in a separate
process. Each autograder cell above then shows which checks passed, what went wrong in those that
did not, and the points of its stage.
"""

STAGES = {
    "m01_pytorch_attention": (
        "PyTorch's own attention",
        """\
Your chapter-3 `MultiHeadAttention` computes scores, masks, softmax and the weighted sum of the values
step by step, holding the whole `num_tokens x num_tokens` score matrix. PyTorch has the middle part as
one call, `F.scaled_dot_product_attention` (SDPA): it scales by `1/sqrt(head_dim)` itself, and on a GPU it
runs fused kernels that never store the score matrix. It can be made causal two ways: `is_causal=True`,
or an `attn_mask`. Careful: SDPA's boolean mask is **True where a key takes part**, while the chapter's
`mask` buffer is 1 on the future, the part that is masked out.

PyTorch also ships the whole module, `nn.MultiheadAttention`. Copy your weights into it (its
`in_proj_weight` stacks the query, key and value weights) and run it causally. Its boolean `attn_mask`
uses the **opposite** convention from SDPA's: True = not allowed. All three must give the same output.""",
        """\
import torch
from m01_pytorch_attention import MultiHeadAttention, sdpa_attention, torch_mha_forward

torch.manual_seed(123)
mha = MultiHeadAttention(d_in=4, d_out=4, context_length=6, dropout=0.0, num_heads=2).eval()
x = torch.rand(2, 6, 4)
with torch.no_grad():
    by_hand = mha(x)
    print("SDPA, is_causal:", torch.allclose(sdpa_attention(mha, x), by_hand, atol=1e-6))
    print("SDPA, attn_mask:", torch.allclose(sdpa_attention(mha, x, use_mask=True), by_hand, atol=1e-6))
    print("nn.MultiheadAttention:", torch.allclose(torch_mha_forward(mha, x), by_hand, atol=1e-6))
    print(sdpa_attention(mha, x)[0])""",
    ),
    "m02_padding_and_cross": (
        "Padding masks and cross-attention",
        """\
A batch holds sentences of different lengths, filled up to the longest with padding tokens. A
`key_padding_mask` of shape `(b, n_kv)` says which keys are real (True): no query may attend to padding,
so a real token's output is the same with or without it. The mask is about **keys**: it hides columns
of the score matrix, for every head and every query.

In cross-attention the queries come from one sequence and the keys and values from another, the
context (an encoder's output, image features): the scores are `n_q x n_kv`, and only `W_key` and
`W_value` see the context's width `d_context`.

A query can be left with nothing to attend to (a sequence of padding only, or left padding before a
causal query). Its softmax row is then `0/0`, NaN, which would spread into every later layer: give such
rows attention weights 0, so that the output is just `out_proj.bias`.""",
        """\
import torch
from m02_padding_and_cross import CrossAttention

torch.manual_seed(123)
attn = CrossAttention(d_in=3, d_out=4, num_heads=2, d_context=5).eval()
x = torch.rand(2, 4, 3)  # 4 query tokens
context = torch.rand(2, 6, 5)  # 6 context tokens
real = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])  # the second context has 3 padding tokens
with torch.no_grad():
    out = attn(x, context, key_padding_mask=real)
    alone = attn(x[1:], context[1:, :3])  # the second example without its padding
    print(out.shape, "padding changes nothing:", torch.allclose(out[1:], alone, atol=1e-6))
    nothing = attn(x, context, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    print("all padding gives out_proj.bias:", torch.allclose(nothing, attn.out_proj.bias.expand_as(nothing)))""",
    ),
    "m03_kv_cache": (
        "A KV cache for generation",
        """\
A language model writes one token at a time, and each new token attends to every token before it.
Chapter 3's module would recompute the keys and values of the whole sequence at every step, although
they never change: with a causal mask a token's key and value depend on that token alone. A **KV cache**
keeps them. A step projects only the new tokens (first the prompt, then one token at a time), appends
their keys and values to `cache_k` and `cache_v`, and lets the new queries attend to everything cached.

The new queries do not sit at positions 0, 1, ...: after `start` cached tokens they are at positions
`start`, `start + 1`, ..., so the causal mask is taken at those rows. Done right, every step gives exactly
the rows of the full causal forward. `reset_cache()` empties the cache before the next sequence.""",
        """\
import torch
from m03_kv_cache import MultiHeadAttentionWithCache

torch.manual_seed(0)
attn = MultiHeadAttentionWithCache(d_in=4, d_out=8, context_length=8, num_heads=2).eval()
x = torch.randn(1, 6, 4)
with torch.no_grad():
    full = attn(x)
    steps = [attn(x[:, :3], use_cache=True)]  # the prompt
    for i in range(3, 6):  # then one token at a time
        steps.append(attn(x[:, i:i + 1], use_cache=True))
        print(f"after token {i}: cache_k {tuple(attn.cache_k.shape)} (b, num_heads, tokens_so_far, head_dim)")
print("cached decoding equals the full forward:", torch.allclose(full, torch.cat(steps, dim=1), atol=1e-6))
attn.reset_cache()
print("after reset_cache():", attn.cache_k)""",
    ),
    "m04_grouped_query": (
        "Grouped-query attention",
        """\
The KV cache grows by `num_heads` keys and values per token and layer, and for long texts it outgrows
the model's weights. **Grouped-query attention** keeps all the query heads but only `num_kv_groups` key
and value heads: consecutive query heads form groups of `group_size = num_heads // num_kv_groups` that
share one key head and one value head. `W_key`, `W_value` and the cache shrink by that factor. Llama 3
8B has 32 query heads and 8 key/value heads; `num_kv_groups == num_heads` is chapter 3's multi-head
attention, `num_kv_groups == 1` multi-query attention.

Write the smaller key/value projections, split them into `num_kv_groups` heads, and expand them after
the cache so that query head `h` uses key/value head `h // group_size`. Mind the difference between
`repeat` (which tiles: heads 0, 1, 0, 1) and `repeat_interleave` (heads 0, 0, 1, 1).""",
        """\
import torch
from m04_grouped_query import GroupedQueryAttention

print("repeat:           ", torch.arange(2).repeat(2))
print("repeat_interleave:", torch.arange(2).repeat_interleave(2))
for num_kv_groups in (4, 2, 1):
    attn = GroupedQueryAttention(d_in=8, d_out=8, context_length=6, num_heads=4, num_kv_groups=num_kv_groups).eval()
    with torch.no_grad():
        out = attn(torch.randn(1, 6, 8), use_cache=True)
    params = sum(p.numel() for p in attn.parameters())
    print(f"num_kv_groups={num_kv_groups}: {params} parameters, cache_k {tuple(attn.cache_k.shape)}, "
          f"output {tuple(out.shape)}")""",
    ),
    "m05_rotary_embeddings": (
        "Rotary position embeddings (RoPE)",
        """\
Attention itself does not know where a token is: chapter 2 adds position embeddings to the inputs.
Llama and most models since instead **rotate** each query and key by an angle proportional to its
position. A head's features form pairs; pair `i` turns at frequency `theta_base ** (-2i / head_dim)`,
fast for the first pairs and slow for the last. Since rotations compose, the score of a query at
position `m` with a key at position `n` depends only on `m - n`: the model sees relative distances.

Write `rope_angles` (the cos and sin of every position's angles) and `apply_rope` in the *halves*
layout of Hugging Face's Llama, where feature `i` pairs with feature `i + head_dim/2`
(`x * cos + rotate_half(x) * sin`). Then rotate the queries and keys in `RoPEAttention`, never the
values. With the KV cache the new tokens' positions continue after the cached ones, and the cache
holds keys already rotated.""",
        """\
import torch
from m05_rotary_embeddings import RoPEAttention, apply_rope, rope_angles

torch.manual_seed(0)
cos, sin = rope_angles(head_dim=8, context_length=64)
q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
for m in (3, 13, 53):  # a query 3 positions after its key: the same score wherever the pair sits
    score = (apply_rope(q, cos, sin, offset=m) * apply_rope(k, cos, sin, offset=m - 3)).sum()
    print(f"query at {m}, key at {m - 3}: score {score.item():.5f}")
attn = RoPEAttention(d_in=4, d_out=8, context_length=16, num_heads=2, num_kv_groups=1).eval()
x = torch.randn(1, 5, 4)
with torch.no_grad():
    full = attn(x)
    steps = torch.cat([attn(x[:, :3], use_cache=True), attn(x[:, 3:4], use_cache=True),
                       attn(x[:, 4:], use_cache=True)], dim=1)
print("cached decoding equals the full forward:", torch.allclose(full, steps, atol=1e-6))""",
    ),
    "m06_sliding_window": (
        "Sliding-window attention",
        """\
In causal attention the last token of a long document looks at every token before it, and the KV
cache grows with the document. Mistral and Gemma let (some) layers look at the last `window` tokens
only, the query's own token included: key `j` takes part for query `i` when `j <= i` and
`i - j < window`. Information from further back still arrives, passed on from layer to layer.

Write `sliding_window_mask`, a band below the diagonal (boolean, True where a key takes part, as
`F.scaled_dot_product_attention` wants it), then the cache of `SlidingWindowAttention`: a new token
can never reach more than `window` positions back, so after each step the cache keeps only the last
`window` keys and values. Decoding token by token must still give exactly the full forward's outputs,
long after the sequence has passed the window.""",
        """\
import torch
from m06_sliding_window import SlidingWindowAttention, sliding_window_mask

print(sliding_window_mask(6, 3).int())
torch.manual_seed(0)
attn = SlidingWindowAttention(d_in=4, d_out=8, context_length=12, num_heads=2, window=3).eval()
x = torch.randn(1, 10, 4)
with torch.no_grad():
    full = attn(x)
    steps = [attn(x[:, :2], use_cache=True)]
    for i in range(2, 10):
        steps.append(attn(x[:, i:i + 1], use_cache=True))
print("cache_k after 10 tokens:", tuple(attn.cache_k.shape), "(b, num_heads, window, head_dim)")
print("cached decoding equals the full forward:", torch.allclose(full, torch.cat(steps, dim=1), atol=1e-6))""",
    ),
    "m07_tiled_attention": (
        "Attention tile by tile: the online softmax of FlashAttention",
        """\
Chapter 3 builds the whole `num_tokens x num_tokens` score matrix before the softmax. At 4096 tokens
and 32 heads that is half a billion scores per sequence and layer, written to memory and read back. FlashAttention
never builds it: it walks over tiles of `block_size` queries x `block_size` keys and keeps, for every
query row, a running max `row_max`, a running sum `row_sum` of `exp(score - row_max)` and an accumulator
`acc` of `exp(score - row_max) * value`. When a tile brings a larger max, what was summed so far is
rescaled by `exp(old max - new max)`; after the last tile, `acc / row_sum` is exactly the
softmax-weighted sum of the values.

Write `tiled_attention(q, k, v, is_causal, block_size)` in plain PyTorch. With `is_causal`, the tiles
above the diagonal can be skipped, and a row whose scores are all masked so far must not turn into
`-inf - (-inf) = NaN`. The tests compare it with standard attention, also with scores in the thousands,
and check that no tensor as large as the score matrix is ever created.""",
        """\
import torch
import torch.nn.functional as F
from m07_tiled_attention import tiled_attention

torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
out = tiled_attention(q, k, v, is_causal=True, block_size=4)
print(out.shape)
print("equals F.scaled_dot_product_attention:",
      torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
print("finite with scores in the thousands:", torch.isfinite(tiled_attention(q * 1e3, k, v)).all().item())""",
    ),
}
