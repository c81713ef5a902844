"""Stage f04: FlexAttention, many attention variants from two small functions.

Every variant of the earlier stages changed one thing in the same computation: which keys a query may see
(causal, sliding window, padding) or how a score is changed before the softmax. PyTorch's FlexAttention
(torch.nn.attention.flex_attention, PyTorch 2.5 on) takes exactly those two things as Python functions and
runs the rest:

    score_mod(score, b, h, q_idx, kv_idx) -> the new score   (score: q . k already scaled by 1/sqrt(head_dim))
    mask_mod(b, h, q_idx, kv_idx) -> True where the key takes part

Both are called with 0-d tensors for one (batch, head, query, key) at a time, as written; PyTorch vectorizes
them (torch.vmap) over all of them. So they must be plain tensor expressions: `&`, `|`, torch.where, indexing a
tensor they captured, never Python's `and`, `or` or `if` on a tensor. A mask_mod goes through
create_block_mask first, which records which blocks of (query, key) pairs are empty so that the kernel skips
them. With torch.compile FlexAttention becomes one fused kernel; without it (as here, on the CPU) it runs an
eager implementation that computes the full score matrix: slow, but the same numbers, which is what this
stage checks against a dense reference for each variant:

    causal            q_idx >= kv_idx
    sliding window    causal and q_idx - kv_idx < window (Mistral, Gemma 2's local layers; stage m06)
    ALiBi             score - slope[h] * (q_idx - kv_idx): a penalty growing with distance, a slope per head,
                      instead of position embeddings (Press et al.; BLOOM, MPT)
    soft-capping      cap * tanh(score / cap): scores squashed smoothly into (-cap, cap) (Gemma 2, cap 50)
    documents         several documents packed into one sequence: a token sees earlier tokens of its own
                      document only (document_ids[q_idx] == document_ids[kv_idx], and causal)

API (q, k, v: (b, num_heads, num_tokens, head_dim); every attention returns q's shape)
    causal(b, h, q_idx, kv_idx); sliding_window(window) -> mask_mod; document_causal(document_ids) -> mask_mod
    alibi_slopes(num_heads) -> (num_heads,) float32; alibi(slopes) -> score_mod; soft_cap(cap) -> score_mod
    attend(q, k, v, score_mod=None, mask_mod=None): flex_attention with a block mask made from mask_mod
    causal_attention, sliding_window_attention, alibi_attention, gemma2_attention, packed_attention (given)

What the checks test besides: each model's attention against a dense computation of the same scores, mask and
softmax, in float32, with values of any width (the probes use values as wide as the keys are many); a query with no
key gets 0, as flex_attention gives.
"""
import math
import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# flex_attention called as it is here, eagerly, warns once "flex_attention called without torch.compile() ... Use
# torch.compile(flex_attention)": the eager call is what this stage means (graded code may not compile, see attend),
# so that advice would only contradict it.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def causal(b, h, q_idx, kv_idx):
    """mask_mod of causal attention: query q_idx sees keys kv_idx <= q_idx."""
    # TODO: One comparison of the two indices (tensors).
    raise NotImplementedError("f04_flex_attention: causal: see its TODO")


def sliding_window(window):
    """The mask_mod of a causal sliding window of `window` tokens (the query's own included), as stage m06's band."""
    # TODO: Return a function (b, h, q_idx, kv_idx) -> bool tensor: causal AND q_idx - kv_idx < window. Combine the two
    #       with `&`: Python's `and` asks a tensor for its truth value, which vmap cannot give.
    raise NotImplementedError("f04_flex_attention: sliding_window: see its TODO")


def document_causal(document_ids):
    """The mask_mod of packed documents: document_ids (num_tokens,) says which document each token belongs to; a
    query sees the keys of its own document up to itself."""
    # TODO: Index the captured document_ids with q_idx and kv_idx (tensors work as indices inside a mask_mod).
    raise NotImplementedError("f04_flex_attention: document_causal: see its TODO")


def alibi_slopes(num_heads):
    """ALiBi's slope per head, float32 (num_heads,). For num_heads a power of 2: 2^(-8/n), 2^(-16/n), ...,
    2^(-8), i.e. slope[h] = 2^(-8 (h + 1) / num_heads). Otherwise (the paper's rule, as BLOOM and MPT): the slopes
    of the largest power of 2 below num_heads, n, followed by every other slope of 2n (its odd-numbered ones,
    2^(-8 (2i + 1) / (2n))), as many as are missing."""
    # TODO: A geometric sequence for the power of 2; the interleaving rule for the rest.
    raise NotImplementedError("f04_flex_attention: alibi_slopes: see its TODO")


def alibi(slopes):
    """The score_mod of ALiBi with the given slopes (num_heads,): score - slopes[h] * (q_idx - kv_idx)."""
    # TODO: The penalty grows linearly with the distance q_idx - kv_idx (0 for the query's own token).
    raise NotImplementedError("f04_flex_attention: alibi: see its TODO")


def soft_cap(cap):
    """The score_mod of logit soft-capping: cap * tanh(score / cap), close to score when |score| << cap, never
    beyond +-cap."""
    # TODO: Return a function (score, b, h, q_idx, kv_idx) -> the capped score (torch.tanh works on the 0-d score).
    raise NotImplementedError("f04_flex_attention: soft_cap: see its TODO")


def attend(q, k, v, score_mod=None, mask_mod=None):
    """flex_attention of q (b, num_heads, n_q, head_dim) over k, v (b, num_heads, n_kv, head_dim) with the given
    score_mod and mask_mod (None: no change, every key takes part)."""
    # TODO: A mask_mod becomes a block mask: create_block_mask(mask_mod, None, None, n_q, n_kv, device=q.device) (None
    #       for the batch and head sizes: the mask is the same for all). Then flex_attention(q, k, v, score_mod=...,
    #       block_mask=...), called directly: torch.compile would write and compile C++, which graded code may not.
    raise NotImplementedError("f04_flex_attention: attend: see its TODO")


# The attention of models, each from the pieces above.

def causal_attention(q, k, v):
    return attend(q, k, v, mask_mod=causal)


def sliding_window_attention(q, k, v, window):
    return attend(q, k, v, mask_mod=sliding_window(window))


def alibi_attention(q, k, v):
    """Causal attention with ALiBi's biases, as BLOOM and MPT run it (no position embeddings anywhere else)."""
    slopes = alibi_slopes(q.shape[1]).to(device=q.device)  # a captured tensor must be on q's device
    return attend(q, k, v, score_mod=alibi(slopes), mask_mod=causal)


def gemma2_attention(q, k, v, cap=50.0, window=None):
    """Gemma 2: scores soft-capped at `cap` (attn_logit_softcapping = 50), causal, and on its local layers a
    sliding window (4096 tokens in Gemma 2)."""
    return attend(q, k, v, score_mod=soft_cap(cap), mask_mod=causal if window is None else sliding_window(window))


def packed_attention(q, k, v, document_ids):
    """Causal attention over a sequence that packs several documents (document_ids: (num_tokens,) ints)."""
    return attend(q, k, v, mask_mod=document_causal(document_ids.to(device=q.device)))
