"""KV caches: a module fed a sequence a chunk at a time (a prompt, then tokens one by one), each step's new queries
attending to the keys and values the cache holds.

The reference of a cached step is ``attention.forward`` on the step's new tokens with, as keys and values, the
tokens the cache holds at that step (``decode``): a cache's own switches (which tokens it holds: all of them, the
step's own only, a sequence never emptied, a window's oldest positions, its last ones cut before attending; where
the new tokens' rotary positions start; which rows of the mask the new queries take) are searched together with
those of the attention it does, in every stage with a cache. ``CachedModule`` is a stage's module with a cache;
its ``step_evidence`` diagnoses a failed check of a cached step: the search on that step (and on a second case of
other sizes), and probes of the module: its cached steps against its own forward without the cache on the same
tokens, and the attention weights of its cached steps, exposed.
"""
from __future__ import annotations

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
    held = {"own_only": OWN_ONLY}
    if spec.window is not None:  # a bounded cache: which window positions it keeps
        held |= {"oldest": OLDEST, "cut_window": cut_before("window"), "cut_short": cut_before("window - 1")}
    found = [Switch("cache", "caches", held)]
    if spec.rope_theta is not None:
        found.append(Switch("positions", "rotary positions", {"restart": RESTART}))
    if reset:
        found.append(Switch("reset", "caches", {"missing": NOT_RESET}))
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
    cache, window, start = choices.get("cache"), spec.window, 0
    for size in chunks:
        new = np.arange(start, start + size)
        turn = np.arange(size) if choices.get("positions") == "restart" else new
        if cache == "own_only":
            keys, turn_keys = new, turn
        else:
            keys, turn_keys = np.concatenate([kept, new]), np.concatenate([turned, turn])
        at = np.arange(start + size - len(keys), start + size)  # where the mask takes them: by index
        if window is not None and cache in ("cut_window", "cut_short"):
            last = window if cache == "cut_window" else max(window - 1, 1)
            keys, turn_keys, at = keys[-last:], turn_keys[-last:], at[-last:]
        kept, turned = keys, turn_keys
        if window is not None:  # a bounded cache keeps window positions for the next step
            cut = slice(None, window) if cache == "oldest" else slice(-window, None)
            kept, turned = keys[cut], turn_keys[cut]
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


STORED = Switch("stored", "caches", {
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
        switches = with_cached_mask(self.spec, switches) + cache_switches(self.spec, reset=past is not None)
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
                         "call with use_cache=True may append to the cache",), "caches", "probe", weight=1)]

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
                         "nor the cache's length (an offset, a mask's rows) may enter it",), "caches", "probe",
                        weight=1)]

    def probe_own_forward(self, x, weights, chunks, step, past):
        """The learner's cached step against its own forward without the cache on the same tokens: where the two
        disagree and which of them is right says whether the mistake is in the cached path or in what both share."""
        end = int(np.sum(chunks[:step + 1]))
        start = end - chunks[step]
        cached = np.asarray(self.run_steps(x, weights, chunks, past=past)[step], dtype=np.float64)
        own = np.asarray(self.run(x[:, :end], weights), dtype=np.float64)[:, start:end]
        right = A.forward(self.spec, x[:, :end], weights)[:, start:end]
        if cached.shape != own.shape or own.shape != right.shape:
            return []

        def close(a, b):
            return bool(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))

        tokens = f"tokens {start}..{end - 1}" if end - start > 1 else f"token {start}"
        if close(cached, right):
            return []
        if close(own, right):
            causes = ["the rows of the mask the new queries take (they sit at positions start .. start + num_new - 1, "
                      "start = the number of tokens cached before this step)",
                      "the keys and values the new queries attend to (the cache: appended, kept, emptied)"]
            if self.spec.rope_theta is not None:
                causes.append("the positions the new tokens are rotated at (offset = the number of cached tokens)")
            return [Finding(f"your forward without the cache gives the right outputs for {tokens}, your cached step "
                            f"{step} does not: what goes wrong is in the cached path.", tuple(causes), "caches",
                            "probe", weight=9)]
        if close(cached, own):
            return [Finding(f"your cached step {step} gives what your own forward without the cache gives for "
                            f"{tokens}, and both are wrong: the mistake is in the attention both compute, not in the "
                            "cache.", (), "caches", "probe", weight=9)]
        return [Finding(f"your forward without the cache and your cached step {step} are both wrong for {tokens}, "
                        "and differ from each other.", (), "caches", "probe", weight=9)]

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

MASK_ROWS = ("take the mask buffer's rows start .. start + num_new - 1 and its first num_keys columns, "
             "mask[start:start + num_new, :num_keys], start = num_keys - num_new (the tokens cached before this "
             "step; 0 without the cache)")


def cache_mask_sizes(match, call):
    """An error reading (diagnosis.errors, for BROADCAST): a mask that does not fit a cached step's scores (b,
    num_heads, num_new, num_keys): kept whole (context_length on a side), or cut for the new tokens alone (num_new
    x num_new: the columns of the cached keys missing). Each is read only when the sizes and the axis in the error
    are those it predicts for a step the check ran."""
    from .errors import broadcast_sizes

    sizes, dim = broadcast_sizes(match)
    length = call.init.get("context_length")
    for _, num_new, num_keys in call.forwards():
        uncut = {length, num_keys} if num_keys != length else {length, num_new}
        if length and sizes == uncut and dim == (3 if num_keys != length else 2):
            return (f"the mask buffer is context_length x context_length ({length} x {length}) and met the scores "
                    f"of {num_new} new tokens over {num_keys} keys: {MASK_ROWS}")
        if num_new < num_keys and sizes == {num_new, num_keys} and dim == 3:
            return (f"a cached step's scores are num_new x num_keys = {num_new} x {num_keys} (the new queries attend "
                    f"to every cached key), but the mask was cut for the new tokens alone ({num_new} x {num_new}): "
                    + MASK_ROWS)
        short = sizes - {num_new}
        if dim == 2 and num_new in sizes and len(short) == 1 and min(short) < num_new and length:
            return (f"the mask gave {min(short)} rows for {num_new} new queries: its rows were taken past the end of "
                    f"the mask buffer ({length} rows), so they start too late; " + MASK_ROWS)
    return None


def step_rows_findings(observed, allowed, chunks, spec: A.Attention) -> list[Finding]:
    """Which keys the new queries of each cached step (after the first) see, against what their positions allow:
    the rows of the mask they took (those of positions 0.. where they sit at start.., or one position late), or
    no cached key at all."""
    seen = np.asarray(observed) > TINY
    n = allowed.shape[-1]
    ends = np.cumsum(chunks)
    for start, end in zip(ends[:-1], ends[1:]):
        rows = np.arange(start, end)
        got = seen[..., rows, :]
        must = np.broadcast_to(allowed[rows], got.shape)
        if np.array_equal(got, must):
            continue
        held = np.arange(0 if spec.window is None else max(0, start - spec.window), end)  # what the cache holds
        words = {"top_left": ROWS_NOT_OFFSET if spec.window is not None else NOT_OFFSET, "next": ONE_LATE}
        for kind, cause in words.items():
            keys = np.zeros((len(rows), n), bool)
            keys[:, held] = A.allowed_keys(spec, rows, held, {"causal": kind})
            if np.array_equal(got, np.broadcast_to(keys, got.shape)):
                return [Finding(f"the new queries of a cached step, at positions {start}..{end - 1} after {start} "
                                f"cached tokens, see {_keys(keys[0])} (query {start}) where they must see "
                                f"{_keys(allowed[start])}.", (cause,), "caches", "probe", weight=2)]
        if not got[..., :start].any() and must[..., :start].any():
            return [Finding(f"the new queries of a cached step, at positions {start}..{end - 1}, put no weight on "
                            f"the {start} cached tokens before them.", (OWN_ONLY,), "caches", "probe", weight=2)]
        index = tuple(int(i) for i in np.argwhere(got != must)[0])
        return [Finding(f"query {rows[index[-2]]}, a new token of a cached step after {start} cached tokens, sees "
                        f"{_keys(got[index[:-1]])} where it must see {_keys(must[index[:-1]])}.", (), "caches",
                        "probe", weight=2)]
    return []


def _keys(row) -> str:
    found = np.flatnonzero(row)
    if found.size == 0:
        return "no key"
    runs = np.split(found, np.flatnonzero(np.diff(found) > 1) + 1)
    return "keys " + ", ".join(f"{r[0]}..{r[-1]}" if r.size > 1 else f"{r[0]}" for r in runs)
