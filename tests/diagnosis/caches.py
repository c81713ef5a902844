"""KV caches, the one mechanism of every stage whose module is fed a sequence a chunk at a time (a prompt, then
tokens one by one), each step's new queries attending to what the cache holds: chapter 3's keys and values (m03-m06),
latent attention's latents (f01), a sink cache that drops old positions (f02), a paged pool (f03), a recurrence's
state (f06), a stack's shared keys and values (f07).

Three parts, written once for all of them:

- *The steps* (``steps``, ``Step``, ``switches``): for each step of a decoding, which tokens its queries are, which
  tokens its keys are and at which positions each was rotated, as a cache's switches make them (the new tokens
  alone, the first step's only, positions restarting at 0, keys cached unrotated). A stage's reference computation
  loops over these steps, so that the switches change every cached stage the same way.
- *Probes of a cached module* (``session_findings``, ``positions_findings``, ``entries_findings``,
  ``write_findings``): its cached steps against its own forward without the cache on the same tokens (which steps and
  tokens differ, and whether the first wrong step is the first after the cache dropped entries), the positions a
  cache records against those of the tokens it holds, which layers' keys a cache's entries hold, and which slots a
  write into a cache reached.
- *Chapter 3's cache* (``decode``, ``CachedModule``): ``attention.forward`` on a step's new tokens with, as keys and
  values, the tokens the cache holds at that step; its own switches (which tokens it holds: all of them, the step's
  own only, a sequence never emptied, a window's oldest positions, its last ones cut before attending; where the new
  tokens' rotary positions start; which rows of the mask the new queries take) are searched with those of the
  attention, and ``CachedModule.step_evidence`` adds the probes above.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from . import attention as A
from .explain import Evidence, Probed, Searched
from .findings import Finding
from .groups import sharing_findings
from .probes import TINY, ExposedWeights, batch_findings, weight_findings
from .search import Switch
from .subjects import AttentionModule, Deferred

# ---------------------------------------------------------------- the mechanism's words

NOT_OFFSET = ("the causal mask was not offset by the cache length: the new tokens were masked as if they sat at "
              "positions 0, 1, ... (a single new token saw only the first key), which is also what "
              "F.scaled_dot_product_attention(is_causal=True) does with fewer queries than keys (it aligns the "
              "diagonal top-left); take the mask's rows start .. start + num_new - 1, start = the number of tokens "
              "cached before this step (for SDPA: attn_mask=~self.mask[start:start + num_new, :num_keys], not "
              "is_causal)")
ROWS_NOT_OFFSET = ("the new queries took the band's first rows: in a cached step they are the last num_new of "
                   "num_keys positions, rows num_cached .. num_cached + num_new - 1 of the band")
ONE_LATE = ("each query also sees the token after it (j <= i + 1): the mask rows are one position late. The new "
            "tokens sit at positions start .. start + num_new - 1, start = the number of tokens cached before this "
            "step (0 without the cache)")
UNMASKED = ("no key after a query is masked: the causal mask is missing, or its rows are taken too late (past the "
            "queries' positions: start = num_keys - num_new, the tokens cached before this step, 0 without the "
            "cache): tokens see the future (in a cached step, a chunk's later tokens)")
OWN_ONLY = ("each step attended to its own new tokens only: the cached keys and values were not used (append the "
            "new ones to the cache with torch.cat on the token axis, then attend to the whole cache)")
NOT_RESET = ("the cache was not reset: the second sequence attended to the first one's keys and values "
             "(reset_cache() must set cache_k and cache_v back to None)")
OLDEST = ("the cache kept the OLDEST window positions: keep the most recent ones, keys[:, :, -window:], since a "
          "new token can only reach the last window positions")
UNBOUNDED = ("the cache is not bounded: it grows with the sequence, but no query reaches further back than "
             "window positions; keep only the last window positions (keys[:, :, -window:])")
RESTART = ("positions restart at 0 in each cached step: the new tokens' positions continue after the cached "
           "ones, offset = the number of tokens in the cache")
NEW_ONLY = ("each cached step attended to its new tokens alone: the keys and values cached by the earlier steps were "
            "not read (append the new ones to the cache, then attend to all of it)")


# ---------------------------------------------------------------- the steps of a decoding (every cached stage)

Choices = Mapping[str, Hashable]
NONE: Choices = {}

FROM_LENGTH = ("the new tokens' positions were counted from the number of entries the cache holds (its length), which "
               "is the number of tokens fed only until the cache drops an entry: continue after the newest cached "
               "position (its last recorded position + 1)")
ONE_LATE_POSITIONS = ("the new tokens' positions start one too late in cached steps: they sit at positions cached .. "
                      "cached + num_new - 1 (offset = the number of tokens cached, not that + 1)")
ONE_EARLY_POSITIONS = ("the new tokens' positions start one too early in cached steps: they sit at positions cached .. "
                       "cached + num_new - 1 (offset = the number of tokens cached, not that - 1)")
KEYS_RESTART = ("the new keys were rotated from position 0 in each cached step, the new queries at their true "
                "positions: rotate a step's new keys at the same positions as its new queries (offset = the number of "
                "tokens cached)")
STALE = ("from the second step on, the new queries attended to the cache as it was before this step's keys and values "
         "were appended (so no new token saw itself): append the new keys and values first, then attend to "
         "everything the cache holds, this step's tokens included")
OVERWRITTEN = ("each step replaced the cache with its own keys and values instead of appending them: the next step saw "
               "the previous step's tokens only (torch.cat([cache, new], dim=<the token axis>) and store the result)")
POSITIONS = Switch("positions", "KV cache", {
    "restart": RESTART,
    "unrotated": "the cached keys were stored before RoPE and read back unrotated: rotate each key at its own "
                 "position when it is made, and cache it rotated",
    "one_late": ONE_LATE_POSITIONS,
    "one_early": ONE_EARLY_POSITIONS,
    "keys_restart": KEYS_RESTART,
    "from_length": "the new tokens' positions were counted from the number of entries the cache holds (its length), "
                   "which is the number of tokens fed only while the cache holds every one of them",
})
CACHE = Switch("cache", "KV cache", {
    "new_only": NEW_ONLY,
    "first_only": "the cache kept the first step's keys and values only: later steps were not appended to it "
                  "(torch.cat([cache, new], dim=<the token axis>) and store the result)",
    "last_only": OVERWRITTEN,
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
    previous = np.arange(0)  # the tokens of the step before
    turned = {}  # token -> the position it was rotated at when it was new
    for a, e in spans(chunks):
        new = np.arange(a, e)
        cache = choices.get("cache")
        keys = new if cache == "new_only" else np.concatenate([np.arange(chunks[0] if a else 0), new]) \
            if cache == "first_only" else np.concatenate([previous, new]) if cache == "last_only" else np.arange(e)
        # from_length: the new tokens numbered from the number of entries the cache holds (as the choices make it)
        rotated = len(keys) - len(new) + np.arange(len(new)) if position == "from_length" else rotated_at[new]
        turned.update(zip(new.tolist(), rotated.tolist()))
        key_rotary = np.asarray([turned[k] for k in keys.tolist()])
        if position == "unrotated":
            key_rotary[keys < a] = 0  # (a rotation at position 0 is none)
        # (keys_restart: the keys, cached ones too, rotated as each was when new; the queries at their own positions)
        found.append(Step(new, keys, new if position == "keys_restart" else rotated, key_rotary))
        previous = new
    return found


def rotation_positions(num_tokens: int, chunks=None, choices: Choices = NONE) -> np.ndarray:
    """The position each token is rotated at when it is new (its own, or counted from its step's start)."""
    chunks = list(chunks) if chunks else [num_tokens]
    starts = np.concatenate([np.full(e - a, a) for a, e in spans(chunks)]).astype(int)
    tokens = np.arange(num_tokens)
    shift = {"one_late": 1, "one_early": -1}.get(choices.get("positions"), 0) * (starts > 0)
    return tokens - starts if choices.get("positions") in ("restart", "keys_restart") else tokens + shift


def switches(chunks, *, rotary: bool) -> list[Switch]:
    """The cache's switches that a decoding in ``chunks`` can show (none for a single step)."""
    if not chunks or len(chunks) < 2:
        return []
    found = [CACHE if len(chunks) > 2 else CACHE.without("first_only", "last_only")]
    if rotary:
        found.append(POSITIONS)
    return found


# ---------------------------------------------------------------- chapter 3's cache: its switches

CACHED_ONLY = "in your cached steps only (your forward without the cache gets this right): "


def cut_before(kept: str) -> str:
    return (f"the cache was cut to the last {kept} positions before the new queries attended, so some of them lost "
            "keys they must see (the query at position p attends to keys p - window + 1 .. p); attend over the "
            "cached and the new keys first, then keep the last window positions for the next step")


def cached_mask(spec: A.Attention) -> Switch:
    """The causal mask's switch in a cached module: chapter 3's mistakes, and the new queries' rows."""
    rows = ROWS_NOT_OFFSET if spec.window is not None else NOT_OFFSET
    return A.CAUSAL.plus({"top_left": rows, "next": ONE_LATE, "none": UNMASKED})


def cache_switches(spec: A.Attention, *, reset: bool = False) -> list[Switch]:
    """What a cache holds and where its new tokens' positions start: the switches a cached step adds."""
    held = {"own_only": OWN_ONLY, "last_only": OVERWRITTEN, "stale": STALE}
    if spec.window is not None:  # a bounded cache: which window positions it keeps
        held |= {"oldest": OLDEST, "cut_window": cut_before("window"), "cut_short": cut_before("window - 1")}
    found = [Switch("cache", "KV cache", held)]
    if spec.rope_theta is not None:
        found.append(Switch("positions", "rotary positions", {
            "restart": RESTART, "one_late": ONE_LATE_POSITIONS, "one_early": ONE_EARLY_POSITIONS,
            "keys_restart": KEYS_RESTART, "from_length": POSITIONS.wrong["from_length"]}))
    if reset:
        found.append(Switch("reset", "KV cache", {"missing": NOT_RESET}))
    return found


def with_cached_mask(spec: A.Attention, switches: list[Switch]) -> list[Switch]:
    return [cached_mask(spec) if s.name == "causal" else s for s in switches]


# ---------------------------------------------------------------- the reference

def held(spec: A.Attention, chunks, choices: A.Choices = A.NONE):
    """For each step of feeding chunks of these lengths to a cached module, as ``choices`` make it: (the new tokens'
    positions, the positions they are rotated at, the tokens whose keys the new queries attend to, the positions
    the mask takes those keys at, the positions they were rotated at, the tokens the cache keeps after the step and
    the positions they were rotated at). A module masks its cache by index: the cached keys are taken to be the
    positions right before the new ones (true while it keeps the most recent ones)."""
    kept = turned = np.arange(0)  # the tokens the cache holds, and the positions they were rotated at
    previous = previous_turned = np.arange(0)  # the step before's new tokens (a cache overwritten by each step)
    cache, window, start, position = choices.get("cache"), spec.window, 0, choices.get("positions")
    for size in chunks:
        new = np.arange(start, start + size)
        # The positions the new keys are rotated at (the shared position switches of ``steps``), and the queries'.
        later = int(start > 0)
        turn = {"restart": np.arange(size), "keys_restart": np.arange(size), "one_late": new + later,
                "one_early": new - later, "from_length": len(kept) + np.arange(size)}.get(position, new)
        appended, appended_turn = np.concatenate([kept, new]), np.concatenate([turned, turn])
        if cache == "own_only":
            keys, turn_keys = new, turn
        elif cache == "stale" and start > 0:  # (the cache read before this step's keys were appended to it)
            keys, turn_keys = kept, turned
        elif cache == "last_only":
            keys, turn_keys = np.concatenate([previous, new]), np.concatenate([previous_turned, turn])
        else:
            keys, turn_keys = appended, appended_turn
        previous, previous_turned = new, turn
        if position == "keys_restart":
            turn = new
        at = np.arange(start + size - len(keys), start + size)  # where the mask takes them: by index
        if window is not None and cache in ("cut_window", "cut_short"):
            last = window if cache == "cut_window" else max(window - 1, 1)
            keys, turn_keys, at = keys[-last:], turn_keys[-last:], at[-last:]
        kept, turned = (appended, appended_turn) if cache == "stale" else (keys, turn_keys)
        if window is not None:  # a bounded cache keeps window positions for the next step
            cut = slice(None, window) if cache == "oldest" else slice(-window, None)
            kept, turned = kept[cut], turned[cut]
        yield new, turn, keys, at, turn_keys, kept, turned
        start += size


def decode(spec: A.Attention, x, weights, chunks, choices: A.Choices = A.NONE, *, past=None) -> list[np.ndarray]:
    """The outputs of feeding ``x`` (b, T, d_in) to a cached module chunk by chunk (``chunks``: their lengths), one
    array per step, as ``choices`` make them. past: a sequence fed before x, its cache emptied before x (right) or
    not ({"reset": "missing"})."""
    x = np.asarray(x, dtype=np.float64)
    first = 0
    if past is not None and choices.get("reset") == "missing":
        first = np.shape(past)[1]
        x = np.concatenate([np.asarray(past, dtype=np.float64), x], axis=1)
    outputs = [A.forward(spec, x[:, new], weights, choices, context=x[:, keys], positions=new, key_positions=at,
                         mask_context=True, rotary_positions=turn, rotary_key_positions=turn_keys)
               for new, turn, keys, at, turn_keys, _, _ in held(spec, ([first] if first else []) + list(chunks),
                                                                choices)]
    return outputs[1:] if first else outputs


STORED = Switch("stored", "KV cache", {
    "W_query": "the cache holds the queries' projection (W_query) where the keys' (W_key) belong in cache_k",
    "W_value": "cache_k holds the values (W_value) and cache_v the keys: they are swapped",
    "W_key": "cache_v holds the keys (W_key) and cache_k the values: they are swapped"})
EXPANDED = Switch("stored_heads", "grouped-query attention", {
    "expanded": "the cache holds the expanded heads (num_heads, each kv head repeated for its group): cache the "
                "num_kv_groups key/value heads and expand them after the cache"})


def contents(spec: A.Attention, x, weights, chunks, which: str, choices: A.Choices = A.NONE) -> np.ndarray:
    """What cache_k (``which`` "keys") or cache_v ("values") holds after feeding x in chunks: (b, kv heads,
    positions kept, head_dim), the keys rotated at their positions where the module has rotary positions."""
    x = np.asarray(x, dtype=np.float64)
    name = {"keys": "W_key", "values": "W_value"}[which]
    stored = choices.get("stored")
    if stored in ("W_value", "W_key") and stored != name:  # the two swapped
        name = stored
    elif stored == "W_query":
        name = "W_query" if which == "keys" else name
    heads = spec.num_heads if name == "W_query" else spec.groups
    projected = A.split(A.linear(x, weights, name, choices.get("bias") != "ignored"), heads, choices)
    *_, kept, turned = list(held(spec, chunks, choices))[-1]
    if spec.rope_theta is not None and name != "W_value" and choices.get("rope") != "none":
        projected = A.rope(projected[:, :, kept], turned, spec.rope_theta, choices.get("rope"))
    else:
        projected = projected[:, :, kept]
    if choices.get("stored_heads") == "expanded":
        projected = np.repeat(projected, spec.num_heads // spec.groups, axis=1)
    return projected


def steps_of(x, chunks) -> list[dict]:
    """Session steps feeding x's tokens to forward(use_cache=True) chunk by chunk."""
    ends = np.cumsum(chunks)
    return [{"method": "forward", "args": [np.asarray(x)[:, e - n:e]], "kwargs": {"use_cache": True}}
            for n, e in zip(chunks, ends)]


# ---------------------------------------------------------------- probes of a cached module (every cached stage)

DROPPED = ("the cache dropped entries that later queries still see, or kept others in their place: keep exactly what a "
           "later query can reach")
CARRIED = ("what the cache carries from one step to the next: the keys and values appended (and kept), the position "
           "the next step starts at, or a recurrence's state")
COPY = ("the write went to a copy, not to the cache: indexing with tensors (pool[blocks, :, slots]) returns a copy, so "
        ".copy_(), .fill_() or any in-place op on it leaves the pool as it was (as on a .clone() or .to() of it); "
        "write through the index itself: pool[blocks, :, slots] = keys")
REUSED_ENTRIES = ("the layers that reuse another layer's keys and values stored a copy of them in the cache: only a "
                  "layer l with kv_sources[l] == l appends to cache_k / cache_v; a reusing layer reads its source's "
                  "entry")


def _close(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))


def _tokens(positions) -> str:
    runs = _keys(np.isin(np.arange(max(positions) + 1), positions))
    return runs.replace("keys", "tokens", 1).replace("no key", "no token")


def session_findings(cached, own, right, chunks, *, kept=None, newest=None, causes=(), what="your cached steps",
                     mechanism="KV cache") -> list[Finding]:
    """The learner's cached steps (``cached``: one output (b, num_new, ...) per step of feeding a sequence in
    ``chunks``) against its own forward without the cache on the whole sequence (``own``, (b, T, ...)) and the right
    full forward (``right``): which tokens the cached path gets wrong, and which step first. ``kept``: the number of
    entries the cache must hold after each step (a cache that drops some), to tell whether the first wrong step is the
    first after it dropped one, and ``newest``: (the newest position the module records, the newest token's), which
    tells the two causes of that apart; ``causes``: what the stage's cached path does that its forward does not."""
    cached = [np.asarray(c, np.float64) for c in cached]
    own, right = np.asarray(own, np.float64), np.asarray(right, np.float64)
    spans_ = spans(chunks)
    if own.shape != right.shape or any(c.shape != right[:, a:e].shape for c, (a, e) in zip(cached, spans_)):
        return []
    wrong = [k for k, (c, (a, e)) in enumerate(zip(cached, spans_)) if not _close(c, right[:, a:e])]
    if not wrong:
        return []

    def bad_tokens(k):
        a, e = spans_[k]
        diff = ~np.isclose(cached[k], right[:, a:e], rtol=1e-4, atol=1e-5, equal_nan=True)
        return [a + int(t) for t in np.flatnonzero(diff.reshape(diff.shape[0], diff.shape[1], -1).any(axis=(0, 2)))]

    tokens = [t for k in wrong for t in bad_tokens(k)]
    first = wrong[0]
    a, e = spans_[first]
    if _close(own, right):
        shows = (f"your forward without the cache gives the right outputs for every token; {what} get "
                 f"{_tokens(tokens)} wrong, the first at step {first} (tokens {a}..{e - 1})")
        if first == 0:
            return [Finding(shows + ", whose cache was empty: the cached path computes the new tokens differently.",
                            tuple(causes), mechanism, "probe", weight=9)]
        fed = [end for _, end in spans_]
        dropped = kept is not None and kept[first - 1] < fed[first - 1]
        if dropped and all(kept[k] == fed[k] for k in range(first - 1)):
            both = (FROM_LENGTH, DROPPED)
            if newest is not None:  # the positions recorded say which: too small, or right (then what was kept)
                both = (FROM_LENGTH,) if newest[0] < newest[1] else (DROPPED,) if newest[0] == newest[1] else both
            return [Finding(shows + f", the first step after the cache dropped entries (after step {first - 1} it "
                            f"holds {kept[first - 1]} of the {fed[first - 1]} tokens fed); the steps before are right.",
                            both, mechanism, "probe", weight=9)]
        return [Finding(shows + ": the first step (an empty cache) is right, what goes wrong is carried from one step "
                        "to the next.", tuple(causes) or (CARRIED,), mechanism, "probe", weight=9)]
    full = np.concatenate(cached, axis=1)
    if full.shape == own.shape and _close(full, own):
        return [Finding(f"{what} give what your own forward without the cache gives, and both are wrong (at "
                        f"{_tokens(tokens)}): the mistake is in what both compute, not in the cache.", (),
                        mechanism, "probe", weight=9)]
    return [Finding(f"your forward without the cache and {what} are both wrong, and differ from each other.", (),
                    mechanism, "probe", weight=9)]


def other_path_findings(this: str, other: str, other_steps, own, right, chunks, cause: str,
                        mechanism="KV cache") -> list[Finding]:
    """A module with two code paths for a cached step (two forms of one computation): when ``this`` path's own
    forward without the cache (``own``) is right and the ``other`` path's cached steps (``other_steps``) all equal
    the right rows, what goes wrong is in ``this`` path's handling of the cache (``cause``)."""
    if not _close(own, right):
        return []  # (this path is wrong without the cache too: its mistake need not be the cache's)
    if not all(_close(o, np.asarray(right)[:, a:e]) for o, (a, e) in zip(other_steps, spans(chunks))):
        return []
    return [Finding(f"your {other}'s cached steps are right, your {this}'s are not: the cache is handled on one path "
                    "and not on the other.", (cause,), mechanism, "probe", weight=8)]


def positions_findings(recorded, expected, chunks, *, name="cache_positions", mechanism="KV cache") -> list[Finding]:
    """The positions a cache records for its entries after each step of feeding a sequence in ``chunks``
    (``recorded``) against those of the tokens it must hold then (``expected``): where the newest token's position
    first goes wrong and by how much each step (counted from the cache's length, one off each step, wrong from the
    start), or, the positions right, which ones the cache dropped or kept beside the right ones."""
    recorded = [np.asarray(r).ravel() for r in recorded]
    expected = [np.asarray(e).ravel() for e in expected]
    fed = [end for _, end in spans(chunks)]
    off = [int(r[-1]) - int(e[-1]) if r.size and e.size else None for r, e in zip(recorded, expected)]
    if None in off:
        return []
    wrong = [k for k, d in enumerate(off) if d]
    if wrong:
        k = wrong[0]
        # (what the cache must hold, never what it holds: a cache that kept the wrong tokens, labelled rightly,
        # reads the same numbers as right tokens labelled wrongly)
        shows = (f"after step {k} ({fed[k]} tokens fed) your {name} are {recorded[k].tolist()}; the cache must then "
                 f"hold the tokens at positions {expected[k].tolist()}: your newest is {abs(off[k])} too "
                 f"{'small' if off[k] < 0 else 'large'}")
        held = [len(r) for r in recorded]  # (the learner's own cache's lengths)
        if k > 0 and all(off[j] == held[j - 1] - fed[j - 1] for j in range(k, len(off))):
            return [Finding(shows + f": by the {fed[k - 1] - held[k - 1]} entries your cache had dropped before the "
                            "step, its length then being less than the tokens fed.", (FROM_LENGTH,), mechanism,
                            "probe", weight=3)]
        if k == 0:
            return [Finding(shows + ", from the first step.", (f"the positions do not start at 0: the first step's "
                            f"tokens are at 0 .. num_new - 1 (yours start at {off[0]})",), mechanism, "probe",
                            weight=3)]
        step = off[k] // max(k, 1)
        if step and all(off[j] == (j - k + 1) * step + (off[k] - step) for j in range(k, len(off))):
            start = "itself (which then stands for two tokens)" if step == -1 else f"+ {1 + step}"
            return [Finding(shows + f", and {abs(step)} more with each step.", (
                f"each step's new tokens were numbered from the newest cached position {start}: they continue right "
                "after it, at the newest cached position + 1",), mechanism, "probe", weight=3)]
        return [Finding(shows + ".", (), mechanism, "probe", weight=3)]
    for k, (r, e) in enumerate(zip(recorded, expected)):
        if set(r.tolist()) == set(e.tolist()):
            continue
        lost, extra = sorted(set(e.tolist()) - set(r.tolist())), sorted(set(r.tolist()) - set(e.tolist()))
        shows = (f"after step {k} ({fed[k]} tokens fed) your cache holds positions {r.tolist()}; it must hold "
                 f"{e.tolist()}")
        if lost and not extra:
            return [Finding(shows + f": {lost} were dropped.", (DROPPED,), mechanism, "probe", weight=3)]
        return [Finding(shows + ".", (), mechanism, "probe", weight=3)]
    return []


def entries_findings(entries, made: dict, sources, *, name="cache_k", mechanism="KV cache") -> list[Finding]:
    """Which layers' keys each entry of a layered cache holds: ``entries`` the learner's list, ``made`` {computing
    layer: the keys it makes}, ``sources`` each layer's source (kv_sources). Copies of a source's keys besides its own
    entry are the reusing layers' own entries."""
    found = []
    for entry in entries:
        owners = [layer for layer, keys in made.items() if _close(entry, keys)]
        found.append(owners[0] if owners else None)
    computing = [layer for layer, source in enumerate(sources) if source == layer]
    said = ", ".join(f"entry {i}: " + (f"layer {o}'s keys" if o is not None else "no layer's keys")
                     for i, o in enumerate(found))
    if found == computing:
        return []
    shows = f"your {name} holds {len(found)} entries ({said}); the computing layers are {computing}"
    if len(found) == len(sources) and found == [sources[layer] for layer in range(len(sources))]:
        return [Finding(shows + ": every layer has an entry, the reusing ones a copy of their source's.",
                        (REUSED_ENTRIES,), mechanism, "probe", weight=2)]
    return [Finding(shows + ".", (), mechanism, "probe", weight=2)]


def deciding(probe, others):
    """Probes where ``probe`` reads the cache itself: when it names a cause, what ``others`` (general probes of the
    module's outputs) find stays as evidence, their causes left to it."""
    def run():
        first = probe()
        rest = [f for other in others for f in _tried(other)]
        if any(f.causes for f in first):
            rest = [Finding(f.shows, (), f.mechanism, f.source, f.weight) for f in rest]
        return first + rest
    return run


def _tried(probe) -> list[Finding]:
    try:
        return probe()
    except Exception:  # a probe that cannot run on this code says nothing
        return []


def write_findings(before, after, places, new, *, name="k_pool", mechanism="KV cache") -> list[Finding]:
    """Which slots a write into a cache reached: ``before`` / ``after`` the cache (a pool laid out (blocks, slots,
    ...)) around a step that must put ``new[i]`` at ``places[i]`` ((block, slot) for each new token)."""
    before, after = np.asarray(before, np.float64), np.asarray(after, np.float64)
    if before.shape != after.shape:
        return []
    reached = [_close(after[p], v) for p, v in zip(places, new)]
    if all(reached):
        return []
    where = [tuple(int(i) for i in p) for p in places]
    if _close(before, after):
        return [Finding(f"your {name} is the same before and after a step that must write {len(places)} new tokens "
                        f"at {where} (block, slot): the write did not reach it.", (COPY,), mechanism, "probe",
                        weight=1)]
    # Where each new token's keys landed: the slots of the pool after the step that hold them.
    slots = after.reshape(after.shape[0] * after.shape[1], -1)
    landed = []
    for v in new:
        hits = np.flatnonzero(np.all(np.isclose(slots, np.asarray(v, np.float64).ravel(), rtol=1e-4, atol=1e-5),
                                     axis=-1))
        landed.append(tuple(int(i) for i in np.unravel_index(hits[0], after.shape[:2])) if hits.size else None)
    shows = (f"after a step that must write its new tokens at {where} (block, slot) of your {name}, they are at "
             f"{[w if w is not None else 'nowhere' for w in landed]}")
    if None not in landed:
        size = after.shape[1]
        shift = {(s - w[1]) % size for (b, s), w in zip(landed, where)}
        if len(shift) == 1 and all(b == w[0] for (b, _), w in zip(landed, where)):
            d = shift.pop()
            return [Finding(shows + ".", (f"each token was written {d} slot{'s' if d > 1 else ''} after its own (in "
                                         "its block, wrapping round): the token at position p goes to slot "
                                         "p % block_size of block table[p // block_size]",), mechanism, "probe",
                            weight=1)]
    return [Finding(shows + ".", (), mechanism, "probe", weight=1)]


# ---------------------------------------------------------------- the learner's module with a cache

@dataclass
class CachedModule(AttentionModule):
    """A stage's module with a KV cache: forward(x, use_cache=True) takes a step's new tokens, reset_cache()
    empties the cache (see ``AttentionModule`` for the fields)."""

    def run_steps(self, x, weights, chunks, init=None, past=None, **options):
        """The learner's output of each cached step (after feeding ``past`` and emptying the cache, if given)."""
        state = self.layout(weights, self.spec.num_heads)
        steps = steps_of(x, chunks)
        if past is not None:
            steps = [*steps_of(past, [np.shape(past)[1]]), {"method": "reset_cache"}, *steps]
        results = self.stage.session(self.cls, init or self.init, state, steps=steps, **{**self.options, **options})
        return results[len(results) - len(chunks):]

    def evidence(self, x, weights, *, rows=slice(None)) -> list[Evidence]:
        """A check of the forward without the cache: the attention's evidence, with the cached mask's words (the
        same code computes the mask's rows with and without the cache)."""
        return [Deferred(lambda: self.full_sources(x, weights, rows))]

    def full_sources(self, x, weights, rows):
        sources = self.sources(x, weights, rows)
        for source in sources:
            if isinstance(source, Searched):
                source.switches = with_cached_mask(self.spec, list(source.switches))
        return sources

    def step_evidence(self, x, weights, chunks, step, *, past=None) -> list[Evidence]:
        """What a failed check of cached step ``step`` (x fed in ``chunks``; after ``past`` and reset_cache(), if
        given) is diagnosed with. Nothing is worked out unless the check fails."""
        return [Deferred(lambda: self.step_sources(np.asarray(x), weights, list(chunks), step, past))]

    def step_sources(self, x, weights, chunks, step, past) -> list[Evidence]:
        d_in, d_out = x.shape[-1], weights["W_query.weight"].shape[0]
        kv_width = weights["W_key.weight"].shape[0]
        switches = A.switches(self.spec, d_in, d_out, kv_width, cached=True, values_from_inputs=d_in == kv_width)
        if not any(k.endswith(".bias") and k.startswith("W_") for k in weights):
            switches = [s for s in switches if s.name != "bias"]
        switches = with_cached_mask(self.spec, switches)
        end = int(np.sum(chunks))
        if _close(self.run(x[:, :end], weights), A.forward(self.spec, x[:, :end], weights)):
            # Your forward without the cache is right: a change of the attention both compute gives these steps only
            # where the cached path computes it on its own (its own mask, its own call): it is said of that path.
            switches = [Switch(w.name, w.mechanism, {v: CACHED_ONLY + words for v, words in w.wrong.items()})
                        for w in switches]
        switches += cache_switches(self.spec, reset=past is not None)
        if self.adjust is not None:
            switches = self.adjust(switches)

        def compute(choices):
            return decode(self.spec, x, weights, chunks, choices, past=past)[step]

        def second():
            init2, x2, weights2 = self.second_case(x, weights)
            chunks2 = [*chunks[:-1], chunks[-1] + 1]  # (as many steps, one more token)
            past2 = None if past is None else np.random.default_rng(98).normal(
                size=(x2.shape[0], np.shape(past)[1] + 1, x2.shape[-1])).astype(np.float32)
            outputs = self.run_steps(x2, weights2, chunks2, init=init2, past=past2)
            return outputs[step], lambda choices: decode(self.spec, x2, weights2, chunks2, choices, past=past2)[step]

        return [Searched(compute, switches, f"your cached step {step}'s output", second),
                Probed([lambda: self.probe_own_forward(x, weights, chunks, step, past),
                        lambda: self.probe_cached_weights(), lambda: self.probe_weights() or [],
                        lambda: batch_findings(lambda a: np.concatenate(self.run_steps(a, weights, chunks), axis=1), x,
                                               what="your cached steps' output"),
                        lambda: sharing_findings(self), *self.more_probes])]

    def cache_evidence(self, x, weights, chunks, which) -> list[Evidence]:
        """What a failed check of cache_k (``which`` "keys") or cache_v ("values") after feeding x in ``chunks`` is
        diagnosed with: what the cache holds, searched (the projection stored, the heads' split, the rotation of
        the keys, the positions kept)."""
        def make():
            switches = [STORED, A.HEADS["split"], *cache_switches(self.spec)]
            if self.spec.groups != self.spec.num_heads:
                switches.append(EXPANDED)
            if self.spec.rope_theta is not None and which == "keys":
                switches.append(A.ROPE.without("values"))
            return [Searched(lambda choices: contents(self.spec, x, weights, chunks, which, choices), switches,
                             f"your cache_{which[0]}")]
        return [Deferred(make)]

    # -- probes

    def probe_plain_forward_between(self, x, weights, chunks, other):
        """A forward without the cache (of ``other``) run between the cached steps must leave the cache as it was:
        the learner's last cached step with and without it in between."""
        state = self.layout(weights, self.spec.num_heads)
        steps = steps_of(x, chunks)
        between = [*steps[:-1], {"method": "forward", "args": [other]}, steps[-1]]
        plain = self.stage.session(self.cls, self.init, state, steps=steps, **self.options)[-1]
        mixed = self.stage.session(self.cls, self.init, state, steps=between, **self.options)[-1]
        if np.allclose(np.asarray(plain), np.asarray(mixed), rtol=1e-4, atol=1e-5, equal_nan=True):
            return []
        return [Finding("your cached step gives another output when a forward without the cache ran before it: that "
                        "forward changed the cache.",
                        ("forward(x) without use_cache touched cache_k / cache_v (or the position it counts): only a "
                         "call with use_cache=True may append to the cache",), "KV cache", "probe", weight=1)]

    def probe_forward_after_steps(self, x, weights, chunks):
        """A forward without the cache after cached steps must give what it gives on a fresh module."""
        state = self.layout(weights, self.spec.num_heads)
        after = self.stage.session(self.cls, self.init, state, steps=[*steps_of(x, chunks),
                                                                      {"method": "forward", "args": [x]}],
                                   **self.options)[-1]
        fresh = self.run(x, weights)
        if np.allclose(np.asarray(after), np.asarray(fresh), rtol=1e-4, atol=1e-5, equal_nan=True):
            return []
        return [Finding("your forward(x) without the cache gives another output after cached steps than on a fresh "
                        "module: it reads the cache.",
                        ("without use_cache, forward(x) attends over x alone from position 0: neither the cached keys "
                         "nor the cache's length (an offset, a mask's rows) may enter it",), "KV cache", "probe",
                        weight=1)]

    def probe_own_forward(self, x, weights, chunks, step, past):
        """The learner's cached steps against its own forward without the cache on the same tokens (``caches``'
        ``session_findings``): which tokens the cached path gets wrong, and from which step."""
        end = int(np.sum(chunks))
        cached = self.run_steps(x[:, :end], weights, chunks[:len(chunks)], past=past)
        own = self.run(x[:, :end], weights)
        right = A.forward(self.spec, x[:, :end], weights)
        causes = ["the rows of the mask the new queries take (they sit at positions start .. start + num_new - 1, "
                  "start = the number of tokens cached before this step)",
                  "the keys and values the new queries attend to (the cache: appended, kept, emptied)"]
        if self.spec.rope_theta is not None:
            causes.append("the positions the new tokens are rotated at (offset = the number of cached tokens)")
        return session_findings(cached, own, right, chunks, causes=causes, what="your cached steps",
                                mechanism="KV cache")

    def probe_cached_weights(self):
        """The attention weights of a cached session, exposed (one-hot tokens whose values are those one-hot
        vectors, out_proj the identity: a step's output is its new queries' weights over every position fed): read
        against causal attention (or the window) over the tokens' positions, and each step's rows against the
        positions its new queries sit at."""
        spec = self.spec
        init, x, weights, _ = self.exposure()
        t = x.shape[1]
        chunks = [2, 1, 2, *([1] * (t - 5))]
        outputs = self.run_steps(x, weights, chunks, init=init)
        h, head_dim = spec.num_heads, t
        observed = np.concatenate([np.asarray(o) for o in outputs], axis=1)
        if observed.shape != (x.shape[0], t, h * head_dim):
            return []
        observed = observed.reshape(x.shape[0], t, h, t).transpose(0, 2, 1, 3)  # (b, heads, queries, keys)
        positions = np.arange(t)
        q = A.split(A.linear(x, weights, "W_query"), h)
        k = A.split(A.linear(x, weights, "W_key"), spec.groups)
        if spec.rope_theta is not None:
            q, k = A.rope(q, positions, spec.rope_theta), A.rope(k, positions, spec.rope_theta)
        scores = q @ np.swapaxes(np.repeat(k, h // spec.groups, axis=1), -1, -2)
        allowed = A.allowed_keys(spec, positions, positions)
        # (no window's width read here: a cache that drops keys narrows some rows, which is no window of its own)
        found = weight_findings(ExposedWeights(observed, scores, allowed, 1 / np.sqrt(head_dim), {}, {}, positions,
                                               positions, None, what="your cached steps' attention weights"))
        rows = step_rows_findings(observed, allowed, chunks, spec)
        if rows:  # (the steps' own reading says which keys their queries see: the generic reading of them goes)
            found = [f for f in found if f.mechanism != "masking" or "future" in f.shows]
        return found + rows


# ---------------------------------------------------------------- errors

MASK_ROWS = ("a cached step's scores are (b, num_heads, num_new, num_keys), num_keys counting every cached token and "
             "the new ones; the mask rows of its new queries are mask[start:start + num_new, :num_keys], start = "
             "num_keys - num_new (the tokens cached before this step; 0 without the cache)")


def cache_mask_sizes(match, call):
    """An error reading (diagnosis.errors, for BROADCAST): two sizes that could not be combined in a cached step,
    read against the steps the check ran: which of the step's sizes met at which axis of its scores (b, num_heads,
    num_new, num_keys). Facts only: a mask cut for the new tokens alone and keys that miss the cached ones give the
    same numbers (as do a mask kept whole and keys read from a preallocated buffer), so no cause is said. What the
    message adds, MASK_ROWS, is what a cached step computes, true of every correct module."""
    from .errors import broadcast_sizes

    sizes, dim = broadcast_sizes(match)
    length = call.init.get("context_length")
    runs = call.forwards()
    met = f"torch could not combine two tensors at dimension {dim}"
    first = [n for _, n, k in runs if n == k and sizes == {0, n}]  # (steps with nothing cached before them)
    if first and dim == 2:
        return Finding(f"{met}, the queries' axis of the scores: one has 0 rows there, the other the {first[0]} new "
                       "queries of the first step, whose keys are its own tokens (nothing cached before it); "
                       + MASK_ROWS + ".", (), "KV cache", "error")
    for _, num_new, num_keys in runs:
        step = f"a step of {num_new} new tokens over {num_keys} keys"
        # A tensor of the buffer's length on the keys' axis (or, when the step's keys fill the buffer, its queries')
        other, name, axis = (num_keys, "num_keys", 3) if num_keys != length else (num_new, "num_new", 2)
        if length and sizes == {length, other} and dim == axis:
            return Finding(f"{met}, in {step}: one is {length} long there, context_length (the mask buffer is "
                           f"{length} x {length}), the other {other}, the step's {name}: a tensor as long as the "
                           "buffer met one sized by the step; " + MASK_ROWS + ".", (), "KV cache", "error")
        if num_new < num_keys and sizes == {num_new, num_keys} and dim == 3:
            return Finding(f"{met}, the keys' axis of the scores, in {step}: one is {num_new} long there, the new "
                           f"tokens alone, the other {num_keys}, every key: something sized for the new tokens alone "
                           "met something sized for all the keys (in a cached step the new queries attend to every "
                           "cached key as well as their own); " + MASK_ROWS + ".", (), "KV cache", "error")
        short = sizes - {num_new}
        if dim == 2 and num_new in sizes and len(short) == 1 and min(short) < num_new and length:
            return Finding(f"{met}, the queries' axis of the scores, in {step}: one has {min(short)} rows there, the "
                           f"other the {num_new} new queries (the mask buffer has {length} rows); " + MASK_ROWS + ".",
                           (), "KV cache", "error")
    return None


def step_rows_findings(observed, allowed, chunks, spec: A.Attention) -> list[Finding]:
    """Which keys the new queries of each cached step (after the first) see, against what their positions allow:
    the rows of the mask they took (those of positions 0.. where they sit at start.., or one position late), or
    no cached key at all."""
    observed = np.nan_to_num(np.asarray(observed, dtype=np.float64))
    if np.any(observed < -1e-6) or np.any(observed > 1 + 1e-4):
        # Not attention weights at all: the exposure makes the outputs the weights only where the values mixed are
        # the tokens' own (one-hot) values; a cache that holds anything else gives numbers no mask can be read from.
        return []
    seen = observed > TINY
    n = allowed.shape[-1]
    ends = np.cumsum(chunks)
    for start, end in zip(ends[:-1], ends[1:]):
        rows = np.arange(start, end)
        got = seen[..., rows, :]
        must = np.broadcast_to(allowed[rows], got.shape)
        if np.array_equal(got, must):
            continue
        held = np.arange(0 if spec.window is None else max(0, start - spec.window), end)  # what the cache holds
        words = {"top_left": ROWS_NOT_OFFSET if spec.window is not None else NOT_OFFSET, "next": ONE_LATE,
                 "none": UNMASKED}
        # Every reading the rows fit: on a step of few new tokens, rows one late and no mask at all can take the same
        # keys, and then neither is a fact.
        fits = []
        for kind, cause in words.items():
            keys = np.zeros((len(rows), n), bool)
            try:
                keys[:, held] = A.allowed_keys(spec, rows, held, {"causal": kind})
            except Exception:  # (a reading this mechanism's mask does not have)
                continue
            if np.array_equal(got, np.broadcast_to(keys, got.shape)):
                fits.append((keys, cause))
        if fits:
            keys = fits[0][0]
            return [Finding(f"the new queries of a cached step, at positions {start}..{end - 1} after {start} "
                            f"cached tokens, see {_keys(keys[0])} (query {start}) where they must see "
                            f"{_keys(allowed[start])}.", tuple(cause for _, cause in fits), "KV cache", "probe",
                            weight=2)]
        if not got[..., :start].any() and must[..., :start].any():
            return [Finding(f"the new queries of a cached step, at positions {start}..{end - 1}, put no weight on "
                            f"the {start} cached tokens before them.", (OWN_ONLY,), "KV cache", "probe", weight=2)]
        index = tuple(int(i) for i in np.argwhere(got != must)[0])
        return [Finding(f"query {rows[index[-2]]}, a new token of a cached step after {start} cached tokens, sees "
                        f"{_keys(got[index[:-1]])} where it must see {_keys(must[index[:-1]])}.", (), "KV cache",
                        "probe", weight=2)]
    return []


def _keys(row) -> str:
    found = np.flatnonzero(row)
    if found.size == 0:
        return "no key"
    runs = np.split(found, np.flatnonzero(np.diff(found) > 1) + 1)
    return "keys " + ", ".join(f"{r[0]}..{r[-1]}" if r.size > 1 else f"{r[0]}" for r in runs)
