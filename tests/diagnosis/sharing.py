"""Keys and values shared across layers (Cross-Layer Attention, Gemma 3n, YOCO) as a mechanism, in NumPy (float64),
written once with its switches: a stack of attention layers with a residual stream in which a layer either computes
its keys and values from its own input or attends to those an earlier layer computed from ITS input.

``stack(x, weights, spec, choices, chunks)`` gives the stack's outputs for a decoding in ``chunks`` (each step's new
tokens attending to everything each computing layer cached, ``caches``'s steps); ``switches`` lists what a learner
chooses there with attention's switches that apply. ``sources(kind, num_layers, n, choices)`` are the sharing
patterns, ``source_findings`` reads a learner's pattern (a layer reading a later layer, or one that computes none).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from . import attention as A
from . import caches as C
from .findings import Finding
from .search import Switch

Choices = Mapping[str, Hashable]
NONE: Choices = {}


@dataclass(frozen=True)
class Sharing:
    """A stack's heads, key/value groups and kv_sources (layer l attends to layer kv_sources[l]'s keys and values)."""

    num_heads: int
    kv_sources: tuple
    num_kv_groups: int | None = None

    @property
    def groups(self) -> int:
        return self.num_kv_groups or self.num_heads


def stack(x, weights, spec: Sharing, choices: Choices = NONE, chunks=None, cached: dict | None = None):
    """The stack's outputs for x (b, T, d_model) fed in ``chunks`` (None: one full forward), concatenated; ``cached``
    (a dict) receives what the cache holds at the end, {computing layer: [keys, values]}."""
    x = np.asarray(x, np.float64)
    h, g = spec.num_heads, spec.groups
    sharing = choices.get("sharing")
    cache = {}  # computing layer -> [keys, values] of every token so far, (b, g, tokens, head_dim)

    def kv_of(inputs, owner):
        return [A.split(A.linear(inputs, weights, f"layers.{owner}.{n}"), g, choices) for n in ("W_key", "W_value")]

    outputs = []
    for step in C.steps(x.shape[1], chunks, choices):
        stream = x[:, step.queries]
        fresh = {}
        for layer, source in enumerate(spec.kv_sources):
            if layer == source:
                fresh[layer] = kv_of(x[:, step.queries] if sharing == "stack_input" else stream, layer)
                old = cache.get(layer)
                cache[layer] = fresh[layer] if old is None or choices.get("cache") == "new_only" else \
                    [np.concatenate(p, axis=2) for p in zip(old, fresh[layer])]
            reprojected = choices.get("reprojected")
            if sharing == "weights" and source != layer:
                k, v = kv_of(stream, source)
            elif reprojected and source != layer:
                own = kv_of(stream, source)
                k, v = (own[0], cache[source][1]) if reprojected == "keys" else (cache[source][0], own[1])
            elif sharing == "new_only" and source != layer:
                k, v = fresh[source]
            else:
                k, v = cache[source]
            q = A.split(A.linear(stream, weights, f"layers.{layer}.W_query"), h, choices)
            if g != h:
                expand = (lambda t: np.tile(t, (1, h // g, 1, 1))) if choices.get("kv_repeat") == "tile" else \
                    (lambda t: np.repeat(t, h // g, axis=1))
                k, v = expand(k), expand(v)
            n, m = q.shape[2], k.shape[2]
            allowed = A.allowed_keys(A.Attention(), np.arange(m - n, m), np.arange(m), choices)
            head_dim = q.shape[-1]
            scale = A.scale_of(A.Attention(num_heads=h), head_dim, head_dim, head_dim, choices)
            w = A.attention_weights(q @ np.swapaxes(k, -1, -2), allowed, scale, choices)
            out = A.merge(w @ v, choices)
            if choices.get("out_proj") != "missing":
                out = A.linear(out, weights, f"layers.{layer}.out_proj")
            residual = {"missing": 0, "stack_input": x[:, step.queries]}.get(choices.get("residual"), stream)
            stream = residual + out
        outputs.append(stream)
    if cached is not None:
        cached.update(cache)
    return np.concatenate(outputs, axis=1)


# ---------------------------------------------------------------- the switches

WEIGHTS_NOT_KV = ("the reusing layers applied their source's W_key and W_value to their OWN input: that shares "
                  "weights, not keys and values; attend to the keys and values the source layer made from its input")
NEW_KEYS_ONLY = ("in cached steps a reusing layer attended to its source's NEW keys only: it reads everything its "
                 "source has cached")
SHARING = Switch("sharing", "cross-layer sharing", {
    "weights": WEIGHTS_NOT_KV,
    "new_only": NEW_KEYS_ONLY,
    "stack_input": "the computing layers projected the stack's input x: each computes its keys and values from ITS "
                   "input, the residual stream h as it reaches that layer"})
REPROJECTED = Switch("reprojected", "cross-layer sharing", {
    "values": "the reusing layers took their source's keys but re-projected the values (the source's W_value applied "
              "to their own input): attend to the values the source layer made from its input too",
    "keys": "the reusing layers took their source's values but re-projected the keys (the source's W_key applied to "
            "their own input): attend to the keys the source layer made from its input too"})
RESIDUAL = Switch("residual", "layers", {
    "missing": "the residual connection is missing: h = h + layer(h, ...), not h = layer(h, ...)",
    "stack_input": "each layer's residual added the stack's input x, not the layer's own input: h = h + layer(h, ...) "
                   "with h the stream as it reaches that layer"})


def switches(spec: Sharing, chunks=None) -> list[Switch]:
    """The choices of the stack's computation that a decoding in ``chunks`` can show."""
    reusing = any(source != layer for layer, source in enumerate(spec.kv_sources))
    cached = bool(chunks and len(chunks) > 1)
    sharing = SHARING if reusing else SHARING.only("stack_input")
    if not cached:
        sharing = sharing.without("new_only")
    causal = A.CAUSAL.only("none", "diagonal").plus(A.CACHED_ROWS if cached else {})
    found = [sharing, *([REPROJECTED] if reusing else []), RESIDUAL, causal,
             A.scaling_switch(A.Attention(num_heads=spec.num_heads), 1, 1, 1).only("none", "times", "no_sqrt"),
             A.FILL.only("zero"), A.PROJECTIONS["out_proj"], *[c.only("new_only") for c in C.switches(chunks,
                                                                                                    rotary=False)]]
    if spec.num_heads > 1:
        found += list(A.HEADS.values())
    if spec.groups not in (1, spec.num_heads):
        found.append(A.KV_REPEAT)
    return found


# ---------------------------------------------------------------- sharing patterns

CLA_BLOCK_INDEX = ("the group's index was taken for a layer: layer l reads layer l - l % share_every, the first "
                   "layer of its group (l // share_every numbers the groups)")
TAIL_FIRST_SHARED = ("the shared layers point at the first of them: they read the last layer BEFORE them, "
                     "num_layers - num_shared - 1, which computes its own keys and values")


def sources(kind: str, num_layers: int, n: int, choices: Choices = NONE) -> list[int]:
    """cla_kv_sources(num_layers, share_every=n) or shared_tail_kv_sources(num_layers, num_shared=n)."""
    choice = choices.get("pattern")
    if kind == "cla":
        return [{None: layer - layer % n, "group_index": layer // n, "last_of_group": min(layer - layer % n + n - 1,
                                                                                          num_layers - 1),
                 "previous": max(layer - 1, 0)}[choice] for layer in range(num_layers)]
    first = num_layers - n
    return [layer if layer < first else {None: first - 1, "first_shared": first, "last": num_layers - 1,
                                         "zero": 0}[choice] for layer in range(num_layers)]


PATTERNS = {
    "cla": Switch("pattern", "cross-layer sharing", {
        "group_index": CLA_BLOCK_INDEX,
        "last_of_group": "each layer reads the LAST layer of its group: it reads the first, l - l % share_every (a "
                         "source comes before its readers)",
        "previous": "each layer reads the layer before it: layers in groups of share_every read their group's first "
                    "layer, l - l % share_every"}),
    "tail": Switch("pattern", "cross-layer sharing", {
        "first_shared": TAIL_FIRST_SHARED,
        "last": "the shared layers point at the last layer: they read the last layer BEFORE them, num_layers - "
                "num_shared - 1",
        "zero": "the shared layers read layer 0: they read the last layer before them, num_layers - num_shared - 1"}),
}


def source_findings(got, *, what: str) -> list[Finding]:
    """What a learner's kv_sources show: a layer that reads a later layer, or one that reads a layer which does not
    compute its own keys and values."""
    got = [int(s) for s in got]
    for layer, source in enumerate(got):
        if not 0 <= source < len(got):
            return [Finding(f"{what}[{layer}] = {source}: there is no layer {source}.",
                            ("a source is one of the layers 0 .. num_layers - 1 at or before its reader",),
                            "cross-layer sharing", "probe", weight=2)]
        if source > layer:
            return [Finding(f"{what}[{layer}] = {source}: layer {layer} reads a LATER layer's keys and values, which "
                            "do not exist yet when it runs.", ("a layer reads its own or an earlier layer's keys and "
                                                              "values",), "cross-layer sharing", "probe", weight=2)]
        if got[source] != source:
            return [Finding(f"{what}[{layer}] = {source}, but layer {source} reads layer {got[source]}: it computes no "
                            f"keys and values of its own for layer {layer} to read.",
                            ("a source must compute its own keys and values (kv_sources[source] == source)",),
                            "cross-layer sharing", "probe", weight=2)]
    return []
