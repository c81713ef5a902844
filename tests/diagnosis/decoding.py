"""Cached decoding as a mechanism of its own: a sequence fed to a module in steps (a prompt, then a token at a time),
each step's new tokens attending to everything cached before them, written once for every stage whose module keeps
a cache (latent attention's latents, a sink cache, a stack's shared keys and values).

``steps(num_tokens, chunks, choices)`` says, for each step, which tokens its queries are, which tokens its keys
are, and at which positions each was rotated (RoPE), as ``choices`` make it: a reference computation loops over
the steps and computes each from these, so that the switches below change every such stage's computation the same
way. A full forward is one step of every token: the switches change nothing there (a search drops them).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from .search import Switch

Choices = Mapping[str, Hashable]
NONE: Choices = {}

RESTART = ("positions restart at 0 in each cached step: the new tokens' positions continue after the cached ones, "
           "offset = the number of tokens in the cache")
POSITIONS = Switch("positions", "KV cache", {
    "restart": RESTART,
    "unrotated": "the cached keys were stored before RoPE and read back unrotated: rotate each key at its own "
                 "position when it is made, and cache it rotated",
})
CACHE = Switch("cache", "KV cache", {
    "new_only": "each cached step attended to its new tokens alone: the keys and values cached by the earlier steps "
                "were not read (append the new ones to the cache, then attend to all of it)",
    "first_only": "the cache kept the first step's keys and values only: later steps were not appended to it "
                  "(torch.cat([cache, new], dim=<the token axis>) and store the result)",
})


@dataclass(frozen=True)
class Step:
    """One step of a cached decoding: ``queries`` the token indices of its new tokens, ``keys`` those of the keys it
    attends to (its new tokens last), and the positions each was rotated at."""

    queries: np.ndarray
    keys: np.ndarray
    query_rotary: np.ndarray
    key_rotary: np.ndarray


def spans(chunks) -> list[tuple[int, int]]:
    ends = np.cumsum(chunks).tolist()
    return list(zip([0, *ends[:-1]], ends))


def steps(num_tokens: int, chunks=None, choices: Choices = NONE) -> list[Step]:
    """The steps of feeding ``num_tokens`` tokens in ``chunks`` (None: one full forward), as ``choices`` make them."""
    chunks = list(chunks) if chunks else [num_tokens]
    position = choices.get("positions")
    rotated_at = rotation_positions(num_tokens, chunks, choices)
    found = []
    for a, e in spans(chunks):
        new = np.arange(a, e)
        cache = choices.get("cache")
        keys = new if cache == "new_only" else np.concatenate([np.arange(chunks[0] if a else 0), new]) \
            if cache == "first_only" else np.arange(e)
        key_rotary = rotated_at[keys].copy()
        old = keys < a
        if position == "unrotated":
            key_rotary[old] = 0  # (a rotation at position 0 is none)
        found.append(Step(new, keys, rotated_at[new], key_rotary))
    return found


def rotation_positions(num_tokens: int, chunks=None, choices: Choices = NONE) -> np.ndarray:
    """The position each token is rotated at when it is new (its own, or counted from its step's start)."""
    chunks = list(chunks) if chunks else [num_tokens]
    starts = np.concatenate([np.full(e - a, a) for a, e in spans(chunks)]).astype(int)
    tokens = np.arange(num_tokens)
    return tokens - starts if choices.get("positions") == "restart" else tokens


def switches(chunks, *, rotary: bool) -> list[Switch]:
    """The cache's switches that a decoding in ``chunks`` can show (none for a single step)."""
    if not chunks or len(chunks) < 2:
        return []
    found = [CACHE if len(chunks) > 2 else CACHE.without("first_only")]
    if rotary:
        found.append(POSITIONS)
    return found
