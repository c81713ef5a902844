"""Grouped-query attention: num_heads query heads sharing num_kv_groups key/value heads, query head h using kv head
h // group_size (repeat_interleave), where a learner may tile them (repeat: h % num_kv_groups) or share them in
another order. The reference's switch is ``attention.KV_REPEAT``; this module reads which kv head each query head
used, from the learner's own output on a case where every kv head's values are one number (its index + 1).
"""
from __future__ import annotations

import numpy as np

from . import attention as A
from .findings import Finding


def kv_heads_used_findings(used, num_heads: int, num_kv_groups: int) -> list[Finding]:
    """``used`` (..., num_heads): the kv head each query head's output came from, measured (its values' number - 1).
    Read only where every query head's output is one kv head's (whole numbers, the same for every token)."""
    used = np.asarray(used, dtype=np.float64).reshape(-1, num_heads)
    rounded = np.round(used)
    if not np.allclose(used, rounded, atol=1e-3) or not np.all(rounded == rounded[:1]):
        return []
    pattern = rounded[0].astype(int)
    group_size = num_heads // num_kv_groups
    right = np.arange(num_heads) // group_size
    if np.array_equal(pattern, right):
        return []
    h = int(np.flatnonzero(pattern != right)[0])
    shows = (f"query heads 0..{num_heads - 1} took their values from kv heads {pattern.tolist()}: query head {h} used "
             f"kv head {pattern[h]}, not h // group_size = {right[h]} (group_size = {group_size}).")
    if np.array_equal(pattern, np.arange(num_heads) % num_kv_groups):
        causes = (A.KV_REPEAT.wrong["tile"],)
    else:
        causes = ("query head h must use kv head h // group_size: repeat each kv head group_size times in a row, "
                  "repeat_interleave(group_size, dim=1)",)
    return [Finding(shows, causes, "grouped-query attention", "probe", weight=2)]


def sharing_case(spec: A.Attention, head_dim: int = 3, num_tokens: int = 5, batch: int = 2):
    """A case where kv head g's values are all g + 1 (a constant input feature, zero other value weights) and
    out_proj is the identity: each query head's output is then the number of the kv head it used, plus 1.
    returns d_in, d_out, x, weights, and how to read the kv head each query head used from the output."""
    h, g = spec.num_heads, spec.groups
    d_in, d_out, kv = num_tokens + 2, h * head_dim, g * head_dim
    rng = np.random.default_rng(41)
    x = np.zeros((batch, num_tokens, d_in), np.float32)
    x[:, np.arange(num_tokens), np.arange(num_tokens)] = 1
    x[:, :, -1] = 1  # the constant feature the values read
    values = np.zeros((kv, d_in), np.float32)
    values[:, -1] = np.repeat(np.arange(1, g + 1), head_dim)
    weights = {"W_query.weight": rng.normal(0, 0.9, (d_out, d_in)).astype(np.float32),
               "W_key.weight": rng.normal(0, 0.9, (kv, d_in)).astype(np.float32), "W_value.weight": values,
               "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32)}

    def read(out):
        out = np.asarray(out)
        return out.reshape(*out.shape[:2], h, head_dim)[..., 0] - 1  # (b, tokens, num_heads)

    return d_in, d_out, x, weights, read


def sharing_findings(subject) -> list[Finding]:
    """Which kv head each query head of the learner's module (an ``AttentionModule`` with grouped keys and values)
    used, read on ``sharing_case``."""
    spec = subject.spec
    if spec.groups in (1, spec.num_heads):
        return []
    d_in, d_out, x, weights, read = sharing_case(spec)
    init = subject.sized(subject.init, d_in, d_out, x.shape[1])
    return kv_heads_used_findings(read(subject.run(x, weights, init=init)), spec.num_heads, spec.groups)
