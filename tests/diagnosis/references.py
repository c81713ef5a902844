"""NumPy references (float64) of the mechanisms the stages teach, computed by the trusted side itself: the
expected values of randomized cases, and what typical mistakes make of the same inputs."""
from __future__ import annotations

import numpy as np

from .attention import NO_CAUSAL_MASK, NO_OUT_PROJ, NO_QKV_BIAS, not_scaled

# NumPy references for the common mistakes (the trusted side computes them itself).

def softmax(x, axis=-1):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def causal(scores, fill=-np.inf):
    """scores with the strict upper triangle replaced by ``fill``."""
    t = scores.shape[-1]
    return np.where(np.triu(np.ones((t, t), bool), 1), fill, scores)


def linear(x, weights, name):
    out = x @ weights[f"{name}.weight"].T
    bias = weights.get(f"{name}.bias")
    return out if bias is None else out + bias


def safe_softmax(x, axis=-1):
    """softmax, with 0 (not NaN) for a row that is -inf everywhere, as F.scaled_dot_product_attention gives."""
    x = np.asarray(x, dtype=np.float64)
    empty = np.all(np.isneginf(x), axis=axis, keepdims=True)
    return np.where(empty, 0.0, softmax(np.where(empty, 0.0, x), axis=axis)).astype(np.float32)


def split_heads(a, num_heads):
    """(b, num_tokens, d_out) -> (b, num_heads, num_tokens, head_dim): chapter 3's view and transpose."""
    b, t, d = a.shape
    return a.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def multihead(x, weights, num_heads, *, scale="head_dim", split="view_transpose", out_proj=True,
              qkv_bias=True, mask="causal", values="W_value", scores="queries_keys", softmaxes=1):
    """NumPy multi-head causal attention, with switches that reproduce typical mistakes.

    x: (b, T, d_in); weights: MultiHeadAttention state_dict (W_query/W_key/W_value, out_proj).
    scale: "head_dim" (right: divide by sqrt(head_dim)), "d_out" (divide by sqrt(d_out)), "none",
    "times_head_dim" (multiply by sqrt(head_dim)); split: "view_transpose" (right) or "view_only"
    (reshaping straight to (b, heads, T, head_dim)); mask: "causal", "none", "zero" (fill 0),
    "inverted" (only the future takes part: a boolean mask given to F.scaled_dot_product_attention
    as it is; a row with nothing left gives 0) or "inverted_nan" (the same where that row gives NaN);
    values: "W_value" (right) or "inputs" (x itself, when d_in == d_out); scores: "queries_keys"
    (right: queries @ keys^T) or "keys_queries" (transposed); softmaxes: how often softmax is applied.
    """
    if not qkv_bias:
        weights = {k: v for k, v in weights.items() if not (k.startswith("W_") and k.endswith("bias"))}
    b, t, _ = x.shape
    q, k, v = (linear(x, weights, n) for n in ("W_query", "W_key", "W_value"))
    if values == "inputs":
        v = x
    d_out = q.shape[-1]
    hd = d_out // num_heads

    def heads(a):
        if split == "view_only":
            return a.reshape(b, num_heads, t, hd)
        return split_heads(a, num_heads)

    q, k, v = heads(q), heads(k), heads(v)
    s = q @ k.transpose(0, 1, 3, 2) if scores == "queries_keys" else k @ q.transpose(0, 1, 3, 2)
    s = {"head_dim": s / np.sqrt(hd), "d_out": s / np.sqrt(d_out), "none": s,
         "times_head_dim": s * np.sqrt(hd)}[scale]
    future = np.triu(np.ones((t, t), bool), 1)
    if mask == "causal":
        s = causal(s)
    elif mask == "zero":
        s = causal(s, fill=0.0)
    elif mask.startswith("inverted"):
        s = np.where(future, s, -np.inf)
    with np.errstate(invalid="ignore"):  # "inverted_nan": a row of -inf gives NaN, on purpose
        w = safe_softmax(s) if mask == "inverted" else softmax(s)
    for _ in range(softmaxes - 1):
        w = softmax(w)
    context = (w @ v).transpose(0, 2, 1, 3).reshape(b, t, d_out)
    return linear(context, weights, "out_proj") if out_proj else context


def multihead_mistakes(x, weights, num_heads, out_proj=True, head_counts=True):
    """What typical multi-head mistakes produce on these inputs, keyed by a plain description.

    out_proj=False, head_counts=False: a single head (CausalAttention). Mistakes that happen to give
    the right answer for this configuration (e.g. a missing transpose with a single head) are left out.
    """
    def run(**change):
        return multihead(x, weights, num_heads, out_proj=out_proj, **change)

    sdpa = ("the boolean mask is inverted: F.scaled_dot_product_attention takes attn_mask True where a "
            "token takes part, so pass the allowed positions, ~mask (the causal buffer marks the future)")
    candidates = {
        "the scores were scaled by sqrt(d_out), the model width; each head's dot products have "
        "head_dim terms, so divide by sqrt(head_dim)": run(scale="d_out"),
        not_scaled("head_dim"): run(scale="none"),
        "the scores were multiplied by sqrt(d_k) (d_k = head_dim, the width of one head's keys); "
        "divide by it": run(scale="times_head_dim"),
        "keys @ queries^T: the scores are transposed (row i must hold query i's scores, "
        "queries @ keys.transpose(...))": run(scores="keys_queries"),
        "softmax was applied twice: the weights were already normalised, and a second softmax "
        "flattens them and gives the masked future weight exp(0) > 0": run(softmaxes=2),
        "the heads were split with view alone: view to (b, num_tokens, num_heads, head_dim), "
        "then transpose(1, 2)": run(split="view_only"),
        NO_CAUSAL_MASK: run(mask="none"),
        "masked with 0 instead of -inf: a masked score of 0 still gets weight": run(mask="zero"),
        sdpa: run(mask="inverted"),
        sdpa + " (here a row left with nothing to attend to gives NaN)": run(mask="inverted_nan"),
        NO_QKV_BIAS: run(qkv_bias=False),
    }
    if x.shape[-1] == weights["W_value.weight"].shape[0]:
        candidates["the values were the inputs: mix the projected values W_value(x), not x"] = run(values="inputs")
    if out_proj:
        candidates[NO_OUT_PROJ] = multihead(
            x, weights, num_heads, out_proj=False)
    d_out = weights["W_query.weight"].shape[0]
    for other in range(1, d_out + 1) if head_counts else ():
        if d_out % other == 0 and other != num_heads:
            candidates[f"the output is that of {other} heads, not num_heads={num_heads}: take every size from "
                       "the constructor's arguments (num_heads, d_out), never from a global or the book's "
                       "example"] = multihead(x, weights, other, out_proj=out_proj)
    right = run()
    return {why: c for why, c in candidates.items() if not np.allclose(c, right, rtol=1e-4, atol=1e-6)}


def single_head_mistakes(x, weights):
    """multihead_mistakes for CausalAttention: one head, no out_proj."""
    return multihead_mistakes(x, weights, 1, out_proj=False, head_counts=False)





# Rotary position embeddings in NumPy (float64), Llama's halves layout and the typical mistakes' other layouts:
# the stages that rotate queries and keys (m05, f01) compute their expected values with these.

def np_angles(head_dim, positions, theta_base=10_000.0, layout="halves", frequency="pairs"):
    """(len(positions), head_dim) angles. layout "halves" (right: cat([freqs, freqs])) or "interleaved"
    (each repeated twice); frequency "pairs" (right: exponent 2i/head_dim) or "features" (i/head_dim)."""
    step = 2 if frequency == "pairs" else 1
    inv_freq = float(theta_base) ** (-np.arange(0, step * head_dim // 2, step, dtype=np.float64) / head_dim)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # (T, head_dim/2)
    return np.concatenate([freqs, freqs], axis=-1) if layout == "halves" else np.repeat(freqs, 2, axis=-1)


def np_rope(x, positions, theta_base=10_000.0, pairs="halves", angles="halves", sign=1):
    """x (..., T, head_dim) rotated at positions (T,). pairs "halves" (right: i with i + head_dim/2) or
    "interleaved" (2i with 2i + 1); angles: np_angles' layout; sign=-1 rotates the other way."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    a = sign * np_angles(d, positions, theta_base, angles)
    if pairs == "halves":
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    else:
        rotated = np.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
    return x * np.cos(a) + rotated * np.sin(a)
