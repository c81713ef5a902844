"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in NumPy (float64), written once with its switches: the
expected values of the stages whose keys and values come from a cached latent, and the searched mistakes of each.

Each token's keys and values for every head are made from one latent c = kv_norm(W_kv_down(x)) by W_key_up and
W_value_up; position is kept out of the latent ("decoupled RoPE"): each head's query has head_dim content features
then rope_dim rotary ones, and every head shares one rotary key W_key_rope(x). A score is content . content +
rope . rope, scaled by 1 / sqrt(head_dim + rope_dim). The absorbed form (W_key_up moved into the query, W_value_up
after the mix) computes the same numbers: one reference stands for both forms, and a mistake in either is a switch
of it (a wrong split of the up-projections into heads is the same mistake in both).

``forward(spec, x, weights, choices, chunks=...)`` computes the output of a decoding in ``chunks`` (the steps and
their cache switches are ``caches``'s); ``switches(spec, ...)`` lists the choices a learner makes here, with the
attention switches that apply (``attention``'s causal mask, softmax, fill and RoPE layouts); ``exposure`` makes
weights and inputs whose output IS the attention weights, for ``probes.weight_findings``.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from . import attention as A
from . import caches as C
from .probes import ExposedWeights, weight_findings
from .search import Switch, no_effect

Choices = Mapping[str, Hashable]
NONE: Choices = {}
EPS = 1e-6  # RMSNorm's eps in the stage


@dataclass(frozen=True)
class Latent:
    """What a latent attention module computes: its heads, rotary width and RoPE base (causal, out_proj)."""

    num_heads: int
    rope_dim: int
    theta: float = 10_000.0


def rms_norm(x, weight, choice=None):
    x = np.asarray(x, dtype=np.float64)
    if choice == "missing":
        return x
    if choice == "no_weight":
        weight = 1.0
    axis = -2 if choice == "tokens" else -1
    return x / np.sqrt(np.mean(x ** 2, axis=axis, keepdims=True) + EPS) * weight


def heads(a, num_heads, choice=None):
    """(b, T, num_heads * width) -> (b, num_heads, T, width); ``choice`` "columns": head h takes every num_heads-th
    feature (a view of (width, num_heads))."""
    b, t, d = a.shape
    if choice == "columns":
        return a.reshape(b, t, d // num_heads, num_heads).transpose(0, 3, 1, 2)
    return a.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def queries(spec: Latent, x, weights, head_dim, choices: Choices = NONE):
    """The content and rotary parts of every head's query, (b, num_heads, T, head_dim) and (..., rope_dim)."""
    q = A.linear(x, weights, "W_query")
    h, r = spec.num_heads, spec.rope_dim
    layout = choices.get("query_layout")
    if layout == "blocks":  # every head's content first, then every head's rotary part
        return heads(q[..., :h * head_dim], h), heads(q[..., h * head_dim:], h)
    q = heads(q, h)
    if layout == "rope_first":
        return q[..., r:], q[..., :r]
    return q[..., :head_dim], q[..., head_dim:]


def scale(spec: Latent, head_dim: int, latent_dim: int, choices: Choices = NONE) -> float:
    width = {None: head_dim + spec.rope_dim, "head_dim": head_dim, "rope_dim": spec.rope_dim,
             "latent": latent_dim, "latent_rope": latent_dim + spec.rope_dim, "twice": 2 * head_dim + spec.rope_dim,
             "none": 1, "no_sqrt": (head_dim + spec.rope_dim) ** 2}[choices.get("scale")]
    return 1 / np.sqrt(width)


def forward(spec: Latent, x, weights, choices: Choices = NONE, chunks=None):
    """The module's outputs for ``x`` (b, T, d_in) fed in ``chunks`` (None: one full forward), concatenated."""
    x = np.asarray(x, dtype=np.float64)
    b, t, _ = x.shape
    d_out = weights["out_proj.weight"].shape[0]
    h = spec.num_heads
    head_dim = d_out // h
    latent = A.linear(x, weights, "W_kv_down")
    latent = rms_norm(latent, weights.get("kv_norm.weight", 1.0), choices.get("norm"))
    q_content, q_rope = queries(spec, x, weights, head_dim, choices)
    k_rope = A.linear(x, weights, "W_key_rope")  # (b, T, rope_dim)
    split = choices.get("up_split")
    keys = heads(A.linear(latent, weights, "W_key_up"), h, split)
    values = heads(A.linear(latent, weights, {"keys": "W_key_up"}.get(choices.get("values"), "W_value_up")), h, split)
    rope = choices.get("rope")
    causal = A.Attention(num_heads=h)
    outputs = []
    for step in C.steps(t, chunks, choices):
        qc, qr = q_content[:, :, step.queries], q_rope[:, :, step.queries]
        kr = k_rope[:, step.keys]
        if rope != "none":
            qr = A.rope(qr, step.query_rotary, spec.theta, rope)
            kr = A.rope(kr, step.key_rotary, spec.theta, rope)
        scores = qc @ np.swapaxes(keys[:, :, step.keys], -1, -2)
        if choices.get("rope_score") != "missing":
            scores = scores + qr @ np.swapaxes(kr, -1, -2)[:, None]
        allowed = A.allowed_keys(causal, step.queries, step.keys, choices)
        w = A.attention_weights(scores, allowed, scale(spec, head_dim, latent.shape[-1], choices), choices)
        outputs.append(A.merge(w @ values[:, :, step.keys], choices))
    return A.linear(np.concatenate(outputs, axis=1), weights, "out_proj")


def cache(spec: Latent, x, weights, chunks, choices: Choices = NONE):
    """What the cache holds after a decoding in ``chunks``: (cache_latent, cache_k_rope), as ``choices`` make it
    ("cached_rope": "unrotated", the rotary keys cached before RoPE)."""
    x = np.asarray(x, dtype=np.float64)
    latent = rms_norm(A.linear(x, weights, "W_kv_down"), weights.get("kv_norm.weight", 1.0), choices.get("norm"))
    k_rope = A.linear(x, weights, "W_key_rope")
    if choices.get("cached_rope") == "unrotated" or choices.get("rope") == "none":
        return latent, k_rope
    return latent, A.rope(k_rope, C.rotation_positions(x.shape[1], chunks, choices), spec.theta, choices.get("rope"))


CACHED_ROPE = Switch("cached_rope", "KV cache", {
    "unrotated": "the rotary keys were cached before RoPE: cache them rotated at their positions (a key's rotation "
                 "depends on its own position only)"})


# ---------------------------------------------------------------- the switches

SCALE_WORDS = {
    "head_dim": "the scores were scaled by 1/sqrt(head_dim): a score sums head_dim content products AND rope_dim "
                "rotary ones, so scale by 1 / sqrt(head_dim + rope_dim)",
    "rope_dim": "the scores were scaled by 1/sqrt(rope_dim): a score sums head_dim content products and rope_dim "
                "rotary ones, so scale by 1 / sqrt(head_dim + rope_dim)",
    "latent": "the scores were scaled by 1/sqrt(kv_latent_dim), the latent's width (the absorbed form's dot "
              "products run over the latent, but they equal the content scores of head_dim features): scale by "
              "1 / sqrt(head_dim + rope_dim)",
    "latent_rope": "the scores were scaled by 1/sqrt(kv_latent_dim + rope_dim): the content part counts head_dim "
                   "features whatever form computes it, so scale by 1 / sqrt(head_dim + rope_dim)",
    "twice": "the scores were scaled by 1/sqrt(2 head_dim + rope_dim): head_dim counted twice",
    "none": no_effect("with the scores not scaled", "the scaling", "divide the scores by sqrt(head_dim + rope_dim)"),
    "no_sqrt": "the scores were divided by head_dim + rope_dim; divide by its square root",
}
NORM = Switch("norm", "latent", {
    "missing": no_effect("without kv_norm", "kv_norm", "the latent is kv_norm(W_kv_down(x)), and it is the "
                         "normalised latent that is cached"),
    "no_weight": no_effect("with kv_norm's weight (its learned scale) left out", "kv_norm's weight", "RMSNorm "
                           "multiplies the normalised latent by kv_norm.weight"),
    "tokens": "kv_norm normalised over the tokens: RMSNorm takes the mean of squares over the latent's features "
              "(the last axis)"})
ROPE_SCORE = Switch("rope_score", "latent", {
    "missing": no_effect("with the content scores alone", "the rotary part of the scores", "add q_rope . k_rope "
                         "(the one rotary key, broadcast over the heads) to the content scores")})
QUERY_LAYOUT = Switch("query_layout", "latent", {
    "rope_first": "each head's query was split rotary part first: W_query gives, per head, head_dim content features "
                  "THEN rope_dim rotary ones (split([head_dim, rope_dim], dim=-1))",
    "blocks": "W_query's output was split as all heads' content features, then all heads' rotary ones: it is per "
              "head, head_dim content features then rope_dim rotary ones (view (b, T, num_heads, head_dim + "
              "rope_dim) first)"})
UP_SPLIT = Switch("up_split", "heads", {
    "columns": "the up-projection weights were split into heads the wrong way: W_key_up.weight and W_value_up.weight "
               "are (d_out, kv_latent_dim), head h owns rows h*head_dim .. (h+1)*head_dim - 1: "
               "weight.view(num_heads, head_dim, kv_latent_dim)"})
VALUES = Switch("values", "projections", {
    "keys": "the values were made with W_key_up: each head's values are W_value_up(latent)"})
NO_ROPE = no_effect("with no rotation at all", "RoPE", "rotate q_rope and the rotary keys at the tokens' positions "
                    "(apply_rope, along the token axis: a query and a key turned by one angle whatever their positions "
                    "give the scores of no rotation)")


def rope_switch() -> Switch:
    """``attention.ROPE``'s layouts and mistakes, said of the rotary parts (rope_dim features) of MLA."""
    wrong = {v: w.replace("head_dim", "rope_dim") for v, w in A.ROPE.wrong.items() if v != "values"}
    return Switch("rope", "rotary positions", {**wrong, "none": NO_ROPE})


def switches(spec: Latent, head_dim: int, latent_dim: int, chunks=None) -> list[Switch]:
    """The choices of the computation that a case of these sizes can show, each wrong value with its words."""
    widths = {None: head_dim + spec.rope_dim}
    scaling = {}
    for value, words in SCALE_WORDS.items():
        width = 1 / scale(spec, head_dim, latent_dim, {"scale": value}) ** 2
        if all(abs(width - other) > 1e-9 for other in widths.values()):
            widths[value] = width
            scaling[value] = words
    found = [Switch("scale", "scaling", scaling), NORM, ROPE_SCORE, QUERY_LAYOUT, VALUES, rope_switch(),
             A.CAUSAL.plus(A.CACHED_ROWS) if chunks and len(chunks) > 1 else A.CAUSAL, A.SOFTMAX, A.FILL,
             A.HEADS["merge"], *C.switches(chunks, rotary=True)]
    if spec.num_heads > 1 and head_dim > 1:
        found.append(UP_SPLIT)
    if spec.rope_dim == head_dim:
        found.remove(QUERY_LAYOUT)
    return found


# ---------------------------------------------------------------- the weights, exposed

def exposure(spec: Latent, num_tokens: int):
    """(init sizes, x, weights, read): one-hot tokens, a latent that is the one-hot token itself (W_kv_down the
    identity, kv_norm's weight undoing the norm), values that are those latents (W_value_up the identity per head)
    and out_proj the identity: the output is each head's attention weights. ``read`` turns an output into
    (b, heads, queries, keys)."""
    t, h, r = num_tokens, spec.num_heads, spec.rope_dim
    head_dim = latent_dim = t
    d_in, d_out = t + 1, h * t
    rng = np.random.default_rng(2025)
    x = np.zeros((2, t, d_in), np.float32)
    x[:, np.arange(t), np.arange(t)] = 1
    down = np.zeros((latent_dim, d_in), np.float32)
    down[np.arange(t), np.arange(t)] = 1
    weights = {"W_query.weight": rng.normal(0, 0.8, (h * (head_dim + r), d_in)).astype(np.float32),
               "W_kv_down.weight": down,
               "kv_norm.weight": np.full(latent_dim, 1 / np.sqrt(latent_dim), np.float32),
               "W_key_rope.weight": rng.normal(0, 0.8, (r, d_in)).astype(np.float32),
               "W_key_up.weight": rng.normal(0, 0.8, (d_out, latent_dim)).astype(np.float32),
               "W_value_up.weight": np.tile(np.eye(latent_dim, dtype=np.float32), (h, 1)),
               "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32)}
    sizes = dict(d_in=d_in, d_out=d_out, context_length=t, num_heads=h, kv_latent_dim=latent_dim, rope_dim=r,
                 theta_base=spec.theta)

    def read(out):
        out = np.asarray(out)
        return out.reshape(out.shape[0], t, h, t).transpose(0, 2, 1, 3)

    return sizes, x, weights, read


def scores_of(spec: Latent, x, weights):
    """The raw scores (content + rotary, unscaled) of the exposing case, (b, heads, T, T)."""
    x = np.asarray(x, dtype=np.float64)
    h = spec.num_heads
    d_out = weights["out_proj.weight"].shape[0]
    head_dim = d_out // h
    latent = rms_norm(A.linear(x, weights, "W_kv_down"), weights["kv_norm.weight"])
    qc, qr = queries(spec, x, weights, head_dim)
    positions = np.arange(x.shape[1])
    qr = A.rope(qr, positions, spec.theta)
    kr = A.rope(A.linear(x, weights, "W_key_rope"), positions, spec.theta)
    keys = heads(A.linear(latent, weights, "W_key_up"), h)
    return qc @ np.swapaxes(keys, -1, -2) + qr @ np.swapaxes(kr, -1, -2)[:, None]


def weight_probe(spec: Latent, run, num_tokens: int = 5):
    """Findings on the learner's attention weights read through ``exposure`` (``run(sizes, x, weights)`` gives the
    learner's output); None where the output is not weights (the probe cannot read them)."""
    sizes, x, weights, read = exposure(spec, num_tokens)
    observed = read(run(sizes, x, weights))
    t, head_dim = num_tokens, num_tokens
    width = head_dim + spec.rope_dim
    divisors = {"sqrt(head_dim + rope_dim)": np.sqrt(width), "sqrt(head_dim)": np.sqrt(head_dim),
                "sqrt(rope_dim)": np.sqrt(spec.rope_dim), "1": 1.0, "head_dim + rope_dim": float(width)}
    words = {"sqrt(head_dim)": SCALE_WORDS["head_dim"], "sqrt(rope_dim)": SCALE_WORDS["rope_dim"],
             "1": SCALE_WORDS["none"], "head_dim + rope_dim": SCALE_WORDS["no_sqrt"]}
    positions = np.arange(t)
    return weight_findings(ExposedWeights(observed, scores_of(spec, x, weights), np.tril(np.ones((t, t), bool)),
                                          1 / np.sqrt(width), divisors, words, positions, positions,
                                          what="your attention weights"))
