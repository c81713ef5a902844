"""Padding masks and cross-attention: keys that must not count (a key_padding_mask, True = a real key), rows with
nothing to attend to, and keys and values taken from a context rather than from x.

``PaddedAttention`` is a stage's module whose forward takes x and keyword inputs (``context``, ``key_padding_mask``,
``causal``). A failed check of its output is diagnosed with the attention reference's switches (those of padding,
of rows with no key, of the context's keys among them: ``attention.PADDING``, ``EMPTY``, ``CONTEXT``), searched
on the check's case and separated on a second case of other sizes, and with probes of the module:

- its attention weights, exposed on a case of the diagnoser's (one-hot tokens whose values are those one-hot
  vectors), read for weight on padding keys, real keys left out, and what a row with no key gets (NaN, weight
  spread over every key, or 0 as it must);
- padding keys perturbed on the check's own case: no output of a query that has real keys may move;
- the context and x perturbed (cross-attention): the context must move the outputs, another query's token must not.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import attention as A
from .explain import Evidence, Probed, Searched
from .findings import Finding
from .probes import TINY, ExposedWeights, batch_findings, dtype_findings, weight_findings
from .subjects import AttentionModule, Deferred


def _where(b, i) -> str:
    return f"query {i} of sequence {b}"


def padding_findings(observed, structure, real, *, self_attention: bool) -> list[Finding]:
    """Exposed weights (b, heads, n_q, n_kv) read against the key padding mask ``real`` (b, n_kv; True = a real key)
    and the mask without it (``structure``: (n_q, n_kv), causal or all True): which mask the weights' support equals
    (the padding inverted, on the query axis, ignored), weight on padding keys, real keys left out, and rows with no
    key to attend to, which must get weights 0."""
    observed = np.asarray(observed, dtype=np.float64)
    real = np.asarray(real, bool)
    allowed = np.broadcast_to(A.padded(structure, real), observed.shape)
    finite = np.all(np.isfinite(observed), axis=-1)
    got = (np.nan_to_num(observed) > TINY) & finite[..., None]
    empty = ~allowed.any(axis=-1)
    nan = Finding("", (A.EMPTY.wrong["nan"],), "padding", "probe", weight=2)
    candidates = {"inverted": "the weights' support is that of the inverted mask: each query sees exactly the padding "
                              "keys its mask leaves and none of the real ones",
                  "none": "every query sees its padding keys too, as if no key_padding_mask had been given"}
    if self_attention:
        candidates["queries"] = ("the queries at padding positions see no key at all, and the others see every key, "
                                 "padding included: the mask hides rows (queries), not columns (keys)")
    for choice, shows in candidates.items():
        try:
            support = np.broadcast_to(A.padded(structure, real, choice), got.shape)
        except ValueError:
            continue
        if np.any(got != (allowed & finite[..., None])) and np.array_equal(got, support & finite[..., None]):
            nan_rows = ~finite & ~support.any(axis=-1)
            return [Finding(shows[0].upper() + shows[1:] + ".", (A.PADDING.wrong[choice],), "padding", "probe",
                            weight=1)] + ([Finding("a query left with no key by that mask gets NaN.", nan.causes,
                                                   "padding", "probe", weight=2)] if np.any(nan_rows) else [])
    found = []
    nan_empty = empty & ~finite
    if np.any(nan_empty):
        b, _, i = (int(v) for v in np.argwhere(nan_empty)[0])
        found.append(Finding(f"{_where(b, i)} has no key to attend to (every key is masked for it) and its weights "
                             "are NaN.", nan.causes, "padding", "probe", weight=2))
    spread = empty & finite & got.any(axis=-1)
    if np.any(spread):
        b, h, i = (int(v) for v in np.argwhere(spread)[0])
        row = observed[b, h, i]
        uniform = np.allclose(row, 1 / row.size, atol=1e-4)
        shows = (f"{_where(b, i)} has no key to attend to (every key is masked for it), yet "
                 + (f"spreads its weight evenly, {1 / row.size:.3g} on each of the {row.size} keys, padding included."
                    if uniform else f"puts weight {row.max():.3g} on key {int(np.argmax(row))}."))
        found.append(Finding(shows, (A.EMPTY.wrong["uniform"] if uniform else
                                     "a query with no key to attend to must get attention weights 0 (its context "
                                     "vector 0)",), "padding", "probe", weight=2))
    rows = finite & ~empty
    on_padding = got & ~real[:, None, None, :] & rows[..., None]
    if np.any(on_padding):
        b, h, i, j = (int(v) for v in np.argwhere(on_padding)[0])
        found.append(Finding(f"{_where(b, i)} puts weight {observed[b, h, i, j]:.3g} on key {j}, a padding token "
                             "(key_padding_mask False there): padding takes part.",
                             ("the key_padding_mask does not hide the padding keys' columns for every query: it is "
                              "ignored, inverted, applied along another axis (key_padding_mask[:, None, None, :] "
                              "against the scores (b, num_heads, n_q, n_kv)), or joined to the causal mask by | where "
                              "& is meant",), "padding", "probe", weight=1))
    lost = ~got & allowed & rows[..., None]
    if np.any(lost) and not np.any(on_padding):
        b, h, i, j = (int(v) for v in np.argwhere(lost)[0])
        found.append(Finding(f"{_where(b, i)} puts no weight on key {j}, a real key it must see.",
                             ("a key that must take part was masked: check the key_padding_mask's convention (True = "
                              "a real key) and which axis it masks",), "padding", "probe", weight=3))
    return found


def moved(a, b) -> np.ndarray:
    """(b, tokens): whether each token's output differs between a and b."""
    diff = ~np.isclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-5, equal_nan=True)
    return diff.reshape(*diff.shape[:2], -1).any(axis=-1)


@dataclass
class PaddedAttention(AttentionModule):
    """A module whose forward takes keyword inputs besides x: ``context`` (keys and values from it), a
    ``key_padding_mask`` (b, n_kv; True = a real key) and ``causal``. ``inputs``: the check's inputs. Its spec's
    ``causal`` is the check's flag, its ``empty_rows`` "zero" (a query with no key gets weights 0)."""

    inputs: dict = field(default_factory=dict)

    def run(self, x, weights, init=None, inputs=None, **options):
        state = self.layout(weights, self.spec.num_heads)
        step = {"method": "forward", "args": [x], "kwargs": self.inputs if inputs is None else inputs}
        [out] = self.stage.session(self.cls, init or self.init, state, steps=[step], **{**self.options, **options})
        return out

    def reference(self, x, weights, inputs, choices=A.NONE):
        context, real = inputs.get("context"), inputs.get("key_padding_mask")
        return A.forward(self.spec, x, weights, choices, context=context, key_padding=real,
                         mask_context=context is not None)

    def evidence(self, x, weights, *, rows=slice(None)) -> list[Evidence]:
        return [Deferred(lambda: self.sources(np.asarray(x), weights, rows))]

    def sources(self, x, weights, rows):
        inputs = self.inputs
        context, real = inputs.get("context"), inputs.get("key_padding_mask")
        source = x if context is None else np.asarray(context)
        d_out, kv_width = weights["W_query.weight"].shape[0], weights["W_key.weight"].shape[0]
        switches = A.switches(self.spec, x.shape[-1], d_out, kv_width, values_from_inputs=source.shape[-1] == kv_width,
                              padded=real is not None, context=context is not None and source.shape[-1] == x.shape[-1],
                              causal_added=not self.spec.causal)
        if not any(k.endswith(".bias") and k.startswith("W_") for k in weights):
            switches = [s for s in switches if s.name != "bias"]
        if real is not None and self.spec.causal:  # (two masks: one of them lost when they are joined by |)
            switches = [s.plus({"none": "the causal mask is missing, or combined with the padding mask by | (or) where "
                                        "& (and) is meant: tokens see the future"}) if s.name == "causal" else s
                        for s in switches]
        if self.adjust is not None:
            switches = self.adjust(switches)

        def second():
            init2, x2, weights2, inputs2 = self.second_case(x, weights)
            return (self.run(x2, weights2, init=init2, inputs=inputs2)[:, rows],
                    lambda choices: self.reference(x2, weights2, inputs2, choices)[:, rows])

        return [Searched(lambda choices: self.reference(x, weights, inputs, choices)[:, rows], switches, self.what,
                         second),
                Probed([self.probe_padding_weights, lambda: self.probe_padding_keys(x, weights),
                        lambda: self.probe_context(x, weights),
                        lambda: batch_findings(lambda a: self.run(a, weights), x, what=self.what),
                        lambda: self.probe_heads(x, weights),
                        lambda: dtype_findings(lambda: self.run(x, weights, dtype="float64"), what=self.what),
                        *self.more_probes])]

    def second_case(self, x, weights):
        """Other sizes (one more feature, one more feature per head, one more token, key and context feature),
        fresh numbers, a padding mask of the same kind (padding at the end, or at the start)."""
        rng = np.random.default_rng(97)
        inputs, h = self.inputs, self.spec.num_heads
        context, real = inputs.get("context"), inputs.get("key_padding_mask")
        b, t, d_in = x.shape
        head_dim = weights["W_query.weight"].shape[0] // h + 1
        d_out = h * head_dim
        d_kv = d_in + 1 if context is None else np.shape(context)[-1] + 1
        shapes = {"W_query": (d_out, d_in + 1), "W_key": (d_out, d_kv), "W_value": (d_out, d_kv),
                  "out_proj": (d_out, d_out)}
        weights2 = {}
        for name, shape in shapes.items():
            if f"{name}.weight" in weights:
                weights2[f"{name}.weight"] = rng.uniform(-0.6, 0.6, size=shape).astype(np.float32)
            if f"{name}.bias" in weights:
                weights2[f"{name}.bias"] = rng.uniform(-0.3, 0.3, size=shape[:1]).astype(np.float32)
        x2 = rng.normal(size=(b, t + 1, d_in + 1)).astype(np.float32)
        inputs2 = {k: v for k, v in inputs.items() if k == "causal"}
        n_kv = t + 1
        if context is not None:
            n_kv = np.shape(context)[1] + 1
            inputs2["context"] = rng.normal(size=(b, n_kv, d_kv)).astype(np.float32)
        if real is not None:
            real = np.asarray(real, bool)
            left = bool(np.any(~real[:, 0])) and bool(np.all(real[:, -1]))
            lengths = np.maximum(1, real.sum(axis=1))
            positions = np.arange(n_kv)
            inputs2["key_padding_mask"] = (positions >= n_kv - lengths[:, None]) if left else \
                (positions < lengths[:, None])
        init = {**self.init, "d_in": d_in + 1, "d_out": d_out}
        if "d_context" in init or context is not None:
            init["d_context"] = d_kv
        if "qkv_bias" in init:
            init["qkv_bias"] = "W_query.bias" in weights
        return init, x2, weights2, inputs2

    # -- probes

    def exposing(self):
        """A case whose output is the attention weights: one-hot query tokens (x) and one-hot key tokens (the
        context, or x itself), the values those one-hot keys, out_proj the identity; three sequences: no padding,
        two padding keys (at the end, or at the start where the check's padding is there), every key padding.
        returns init, x, weights, inputs, how to read the weights from the output."""
        h = self.spec.num_heads
        context, real = self.inputs.get("context"), self.inputs.get("key_padding_mask")
        t = 5
        n_kv = t if context is None else t + 2
        d_in, d_kv = t + 2, n_kv + 1 if context is not None else t + 2
        head_dim = n_kv
        d_out = h * head_dim
        rng = np.random.default_rng(2025)
        x = np.zeros((3, t, d_in), np.float32)
        x[:, np.arange(t), np.arange(t)] = 1
        keys = x if context is None else np.zeros((3, n_kv, d_kv), np.float32)
        if context is not None:
            keys[:, np.arange(n_kv), np.arange(n_kv)] = 1
        values = np.zeros((d_out, d_kv), np.float32)
        for head in range(h):
            values[head * head_dim + np.arange(n_kv), np.arange(n_kv)] = 1
        weights = {"W_query.weight": rng.normal(0, 0.9, (d_out, d_in)).astype(np.float32),
                   "W_key.weight": rng.normal(0, 0.9, (d_out, d_kv)).astype(np.float32), "W_value.weight": values,
                   "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32)}
        left = real is not None and bool(np.any(~np.asarray(real)[:, 0]))
        positions = np.arange(n_kv)
        mask = np.stack([np.ones(n_kv, bool), positions >= 2 if left else positions < n_kv - 2, np.zeros(n_kv, bool)])
        inputs = {**{k: v for k, v in self.inputs.items() if k == "causal"}, "key_padding_mask": mask}
        if context is not None:
            inputs["context"] = keys
        init = {**self.init, "d_in": d_in, "d_out": d_out}
        if "d_context" in init or context is not None:
            init["d_context"] = d_kv
        if "qkv_bias" in init:
            init["qkv_bias"] = False
        if "dropout" in init:
            init["dropout"] = 0.0

        def read(out):
            out = np.asarray(out)
            return out.reshape(out.shape[0], t, h, head_dim).transpose(0, 2, 1, 3)  # (b, heads, queries, keys)

        return init, x, weights, inputs, read, keys

    def probe_padding_weights(self):
        init, x, weights, inputs, read, keys = self.exposing()
        observed = read(self.run(x, weights, init=init, inputs=inputs))
        t, n_kv = observed.shape[-2:]
        structure = A.allowed_keys(self.spec, np.arange(t), np.arange(n_kv))
        real = inputs["key_padding_mask"]
        h, head_dim = self.spec.num_heads, n_kv
        q = A.split(A.linear(x, weights, "W_query"), h)
        k = A.split(A.linear(keys, weights, "W_key"), h)
        scores = q @ np.swapaxes(k, -1, -2)
        found = padding_findings(observed, structure, real, self_attention=self.inputs.get("context") is None)
        general = weight_findings(ExposedWeights(
            observed, scores, A.padded(structure, real), 1 / np.sqrt(head_dim), {}, {}, np.arange(t),
            np.arange(n_kv), what="your attention weights", empty_rows="zero", causal=self.spec.causal))
        if found:  # (the padding's reading says which keys each query sees, and what empty rows get: said once)
            general = [f for f in general if f.mechanism in ("scaling", "scores") or "future" in f.shows]
        return found + general

    def probe_padding_keys(self, x, weights):
        """Change the padding keys of the check's own case: no query that has a real key may see its output move."""
        real = self.inputs.get("key_padding_mask")
        if real is None or np.all(real):
            return []
        real = np.asarray(real, bool)
        context = self.inputs.get("context")
        source = np.asarray(x if context is None else context)
        changed = source.copy()
        noise = np.random.default_rng(7).normal(0, 3.0, size=changed.shape).astype(changed.dtype)
        changed[~real] += noise[~real]
        before = self.run(x, weights)
        if context is None:
            after = self.run(changed, weights)
        else:
            after = self.run(x, weights, inputs={**self.inputs, "context": changed})
        structure = A.allowed_keys(self.spec, np.arange(x.shape[1]), np.arange(source.shape[1]))
        counted = np.asarray(A.padded(structure, real)).any(axis=-1)[:, 0]  # (b, n_q): queries with a real key
        if context is None:
            counted &= real  # (a padding query's own output moves with its own token)
        hit = moved(before, after) & counted
        if not np.any(hit):
            return []
        b, i = (int(v) for v in np.argwhere(hit)[0])
        return [Finding(f"the output of {_where(b, i)} changes when the padding keys (key_padding_mask False) change: "
                        "padding takes part in your attention.",
                        tuple(A.PADDING.wrong[c] for c in ("none", "inverted", "queries")), "padding", "probe",
                        weight=4)]

    def probe_context(self, x, weights):
        """Cross-attention (not causal): a query's output depends on its own token and the context alone, so
        changing x's last token moves no other query's output."""
        context = self.inputs.get("context")
        if context is None or self.spec.causal or x.shape[1] < 2:
            return []
        tokens = np.asarray(x).copy()
        tokens[:, -1] += np.random.default_rng(8).normal(0, 1.0, size=tokens[:, -1].shape).astype(tokens.dtype)
        others = moved(self.run(x, weights), self.run(tokens, weights))[:, :-1]
        if not np.any(others):
            return []
        b, i = (int(v) for v in np.argwhere(others)[0])
        return [Finding(f"the output of {_where(b, i)} changes when x's last token changes: in cross-attention a "
                        "query's output depends on its own token and the context alone.",
                        (A.CONTEXT.wrong["self"],), "cross attention", "probe", weight=1)]


def padding_axis_sizes(match, call):
    """An error reading (diagnosis.errors): a size of n_kv (the keys, key_padding_mask's length) that met the scores'
    query axis (n_q, dimension 2) where n_q != n_kv. Facts only: a mask put on the query axis and scores whose axes
    are swapped give the same numbers, so no cause is said; where a key padding mask goes is said as the rule."""
    from .errors import broadcast_sizes

    sizes, dim = broadcast_sizes(match)
    for args, kwargs in [(s.get("args") or (), s.get("kwargs") or {}) for s in call.kwargs.get("steps") or ()
                         if s.get("method") == "forward"]:
        real, context = kwargs.get("key_padding_mask"), kwargs.get("context")
        if real is None or not args or len(np.shape(args[0])) < 2:
            continue
        n_q, n_kv = np.shape(args[0])[1], np.shape(real)[-1]
        if n_q != n_kv and sizes == {n_q, n_kv} and dim == 2:
            keys = f"the context's {n_kv} tokens" if context is not None else f"{n_kv} keys"
            return Finding(f"torch could not combine two tensors at dimension 2, the query axis of the scores (b, "
                           f"num_heads, n_q, n_kv): one holds the {n_q} queries there, the other {n_kv}, the length "
                           f"of the key_padding_mask ({keys}): something as long as the keys sat on the query axis. "
                           "A key padding mask says which KEYS are padding: it masks columns, the last axis, "
                           "key_padding_mask[:, None, None, :] against (b, num_heads, n_q, n_kv).", (), "padding",
                           "error")
    return None
