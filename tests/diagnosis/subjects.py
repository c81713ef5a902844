"""The learner's code as the diagnoser runs it again: an attention module of a stage (``AttentionModule``), with
what it computes (``attention.Attention``) and how its weights are named, so that a failed check can search the
mechanism's switches on the check's case and probe the module on cases of its own.

A check of a module's output passes ``module.evidence(x, weights)`` as its diagnosis:

    assert_close("context_vecs", out, expected, diagnosis=CAUSAL.evidence(x, weights))

Weights are always the canonical ones (W_query, W_key, W_value, out_proj, each ``nn.Linear``'s weight and bias);
``layout`` names them as the module's state_dict does (a module of heads: heads.{h}.W_query ...).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import attention as A
from .explain import Evidence, Probed, Said, Searched
from .probes import (
    HEAD_MODULES,
    ExposedWeights,
    batch_findings,
    dependency_findings,
    dtype_findings,
    heads_findings,
    weight_findings,
)

Layout = Callable[[dict, int], dict]  # (canonical weights, num_heads) -> the module's state_dict
# What the probes found on each stage module of a submission (its adapter Stage: one per test file and submission),
# by module and sizes: gone with the submission's Stage.
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def same_names(weights: dict, num_heads: int) -> dict:
    return dict(weights)


def without_out_proj(weights: dict, num_heads: int) -> dict:
    return {k: v for k, v in weights.items() if not k.startswith("out_proj.")}


def module_of_heads(weights: dict, num_heads: int, prefix: str = "heads.") -> dict:
    """heads.{h}.W_query ...: head h owns rows h*head_dim .. (h+1)*head_dim - 1 of each projection."""
    head_dim = weights["W_query.weight"].shape[0] // num_heads
    found = {f"{prefix}{h}.{name}": value[h * head_dim:(h + 1) * head_dim] for h in range(num_heads)
             for name, value in weights.items() if name.startswith("W_")}
    return found | {k: v for k, v in weights.items() if k.startswith("out_proj.")}


def heads_as_one(weights: dict, num_heads: int, prefix: str = "heads.") -> dict:
    """A module of heads' state_dict (heads.{h}.W_query ...) as the canonical weights: the heads' projections
    stacked, head h's rows after head h - 1's."""
    found = {}
    for name in sorted({k.split(".", 2)[2] for k in weights if k.startswith(prefix)}):
        found[name] = np.concatenate([weights[f"{prefix}{h}.{name}"] for h in range(num_heads)])
    return found | {k: v for k, v in weights.items() if not k.startswith(prefix)}


def as_parameters(weights: dict, num_heads: int) -> dict:
    """SelfAttention_v1's layout: each projection an nn.Parameter of shape (d_in, d_out), used as x @ W."""
    return {name: weights[f"{name}.weight"].T for name in ("W_query", "W_key", "W_value")}


def sizes_only(init: dict, d_in: int, d_out: int, context_length: int) -> dict:
    """Constructor arguments of a module with no context_length or dropout (SelfAttention): its sizes."""
    return {**{k: v for k, v in init.items() if k == "qkv_bias"}, "d_in": d_in, "d_out": d_out}


def sizes(init: dict, d_in: int, d_out: int, context_length: int) -> dict:
    """A module's constructor arguments for these sizes (the book's names), no dropout, no biases."""
    return {**init, "d_in": d_in, "d_out": d_out, "context_length": context_length, "dropout": 0.0,
            "qkv_bias": False}


def sizes_per_head(init: dict, d_in: int, d_out: int, context_length: int) -> dict:
    """MultiHeadAttentionWrapper's arguments: its d_out is each head's width."""
    return sizes(init, d_in, d_out // init["num_heads"], context_length)


@dataclass
class AttentionModule:
    """A stage's attention module: ``stage`` (the adapter's Stage), its class, the constructor arguments of the
    check (``init``), what it computes (``spec``), how its weights are named (``layout``) and how sizes go into
    its arguments (``sized``)."""

    stage: object
    cls: str
    init: dict
    spec: A.Attention
    layout: Layout = same_names
    sized: Callable[[dict, int, int, int], dict] = sizes
    what: str = "your output"
    options: dict = field(default_factory=dict)  # passed to every forward (device, dtype)
    batched: bool = True  # False: forward takes one sequence (num_tokens, d_in), as chapter 3's SelfAttention does

    def run(self, x, weights, init=None, **options):
        """The learner's output for ``x`` (b, num_tokens, d_in) with the canonical ``weights``."""
        state = self.layout(weights, self.spec.num_heads)
        options = {**self.options, **options}
        if self.batched:
            return self.stage.forward(self.cls, init or self.init, x, state, **options)
        return np.stack([self.stage.forward(self.cls, init or self.init, row, state, **options) for row in x])

    # -- the evidence of a failed check of this module's output

    def evidence(self, x, weights, *, rows=slice(None)) -> list[Evidence]:
        """What a failed check of ``run(x, weights)[:, rows]`` is diagnosed with: the mechanism's switches searched
        on this case (and a second one to tell candidates apart), and the probes of this module. Nothing is worked
        out unless the check fails. An unbatched module's check compares one sequence: its evidence is about that
        sequence, as a batch of one."""
        if not self.batched:
            return [Unbatched(Deferred(lambda: self.sources(np.asarray(x)[None], weights, rows)))]
        return [Deferred(lambda: self.sources(x, weights, rows))]

    def sources(self, x, weights, rows) -> list[Evidence]:
        x = np.asarray(x)
        d_in, d_out = x.shape[-1], weights["W_query.weight"].shape[0]
        kv_width = weights["W_key.weight"].shape[0]
        values_from_inputs = d_in == kv_width
        switches = A.switches(self.spec, d_in, d_out, kv_width, values_from_inputs=values_from_inputs)
        if not any(k.endswith(".bias") and k.startswith("W_") for k in weights):
            switches = [s for s in switches if s.name != "bias"]

        def compute(choices):
            return A.forward(self.spec, x, weights, choices)[:, rows]

        def second():
            init2, x2, weights2 = self.second_case(x, weights)
            return (self.run(x2, weights2, init=init2)[:, rows],
                    lambda choices: A.forward(self.spec, x2, weights2, choices)[:, rows])

        return [Searched(compute, switches, self.what, second),
                Probed([lambda: self.probes(x, weights)])]

    def probes(self, x, weights) -> list:
        """The probes of this module, on a case of the probes' own with the check's sizes (fresh numbers): what they
        find is a property of the module, so a submission's checks of one module with the same sizes share it (it is
        worked out once per stage module of a submission: ``_PROBED``)."""
        x = np.asarray(x)
        key = (self.cls, repr(sorted(self.init.items())), self.spec, self.layout.__name__, self.sized.__name__,
               self.batched, repr(sorted(self.options.items())), x.shape,
               tuple(sorted((k, np.shape(v)) for k, v in weights.items())))
        table = _PROBED.setdefault(self.stage, {})
        if key not in table:
            rng = np.random.default_rng(77)
            own_x = rng.normal(size=x.shape).astype(np.float32)
            own = {k: rng.uniform(-0.6, 0.6, size=np.shape(v)).astype(np.float32) for k, v in weights.items()}
            found = self.probe_weights_or_dependencies(own_x, own)
            found += batch_findings(lambda a: self.run(a, own), own_x, what=self.what)
            found += self.probe_heads(own_x, own) if self.batched else []
            found += dtype_findings(lambda: self.run(own_x, own, dtype="float64"), what=self.what)
            table[key] = found
        return table[key]

    def second_case(self, x, weights):
        """A case of other sizes (one more input feature, one more feature per head, one more token), fresh
        numbers: changes that the check's sizes cannot tell apart (a divisor of 4 = head_dim = sqrt(d_out)) give
        different outputs here."""
        rng = np.random.default_rng(97)
        spec = self.spec
        b, t, d_in = x.shape
        head_dim = weights["W_query.weight"].shape[0] // spec.num_heads + 1
        d_out, kv = spec.num_heads * head_dim, spec.groups * head_dim
        context_length = max(self.init.get("context_length", t), t) + 1
        init = self.sized(self.init, d_in + 1, d_out, context_length)
        if "qkv_bias" in init:
            init["qkv_bias"] = "W_query.bias" in weights
        shapes = {"W_query": (d_out, d_in + 1), "W_key": (kv, d_in + 1), "W_value": (kv, d_in + 1),
                  "out_proj": (d_out, d_out)}
        weights2 = {}
        for name, shape in shapes.items():
            if f"{name}.weight" in weights:
                weights2[f"{name}.weight"] = rng.uniform(-0.6, 0.6, size=shape).astype(np.float32)
            if f"{name}.bias" in weights:
                weights2[f"{name}.bias"] = rng.uniform(-0.3, 0.3, size=shape[:1]).astype(np.float32)
        x2 = rng.normal(size=(b, t + 1, d_in + 1)).astype(np.float32)
        return init, x2, weights2

    # -- probes

    def exposure(self, num_tokens: int | None = None):
        """One-hot tokens whose values are those one-hot vectors, out_proj the identity: the output is the
        module's attention weights. returns (init, x, weights, how to read the weights from the output)."""
        spec = self.spec
        t = num_tokens or max(5, (spec.window or 0) + 3)
        h, g = spec.num_heads, spec.groups
        head_dim, d_in = t, t + 2  # (d_in != head_dim != d_out: the temperature says which divisor was used)
        d_out, kv = h * head_dim, g * head_dim
        rng = np.random.default_rng(2024)
        x = np.zeros((2, t, d_in), np.float32)
        x[:, np.arange(t), np.arange(t)] = 1
        values = np.zeros((kv, d_in), np.float32)
        for group in range(g):
            values[group * head_dim + np.arange(t), np.arange(t)] = 1
        weights = {"W_query.weight": rng.normal(0, 0.9, (d_out, d_in)).astype(np.float32),
                   "W_key.weight": rng.normal(0, 0.9, (kv, d_in)).astype(np.float32),
                   "W_value.weight": values,
                   "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32)}
        init = self.sized(self.init, d_in, d_out, t)

        def read(out):
            out = np.asarray(out)
            return out.reshape(out.shape[0], t, h, head_dim).transpose(0, 2, 1, 3)  # (b, heads, queries, keys)

        return init, x, weights, read

    def probe_weights_or_dependencies(self, x, weights):
        """The module's attention weights read on an exposing case; where they cannot be read (the module fails on
        it, or its output is not the weights), which tokens each output depends on, on the check's own case."""
        try:
            found = self.probe_weights()
        except Exception:
            found = None
        return self.probe_dependencies(x, weights) if found is None else found

    def probe_weights(self):
        """Findings on the exposed weights, or None where the module's output on the exposing case is not them."""
        spec = self.spec
        init, x, weights, read = self.exposure()
        observed = read(self.run(x, weights, init=init))
        alone = read(self.run(x[:1], weights, init=init))
        if not np.allclose(alone, observed[:1], rtol=1e-5, atol=1e-7, equal_nan=True):
            return None  # a batch row's weights depend on the other rows: batch_findings says so
        if spec.num_heads > 1 and not self._heads_kept_apart(init, x, weights, observed, read):
            return None  # the output is not the heads' weights side by side
        t, d_in = x.shape[1], x.shape[-1]
        head_dim, d_out = t, spec.num_heads * t
        q = A.split(A.linear(x, weights, "W_query"), spec.num_heads)
        k = A.split(A.linear(x, weights, "W_key"), spec.groups)
        positions = np.arange(t)
        if spec.rope_theta is not None:
            q, k = A.rope(q, positions, spec.rope_theta), A.rope(k, positions, spec.rope_theta)
        k = np.repeat(k, spec.num_heads // spec.groups, axis=1)
        scores = q @ np.swapaxes(k, -1, -2)
        switch = A.scaling_switch(spec, head_dim, d_in, d_out)
        name = spec.head_name
        divisors = {f"sqrt({name})": np.sqrt(head_dim), "1": 1.0, f"1/sqrt({name})": 1 / np.sqrt(head_dim),
                    name: float(head_dim), "sqrt(d_out)": np.sqrt(d_out), "sqrt(d_in)": np.sqrt(d_in)}
        if spec.num_heads > 1:
            divisors["sqrt(num_heads)"] = np.sqrt(spec.num_heads)
        value_of = {"none": "1", "times": f"1/sqrt({name})", "no_sqrt": name, "d_out": "sqrt(d_out)",
                    "d_in": "sqrt(d_in)", "num_heads": "sqrt(num_heads)"}
        words = {value_of[v]: w for v, w in switch.wrong.items()}
        return weight_findings(ExposedWeights(
            observed, scores, A.allowed_keys(spec, positions, positions), 1 / np.sqrt(head_dim), divisors, words,
            positions, positions, spec.window, what="your attention weights"))

    def _heads_kept_apart(self, init, x, weights, observed, read) -> bool:
        """Whether swapping two heads' weights swaps their blocks of the exposed output, as independent heads do."""
        swapped, order = self._swap_heads(weights, out_proj=False)  # (the identity: the heads' blocks swap)
        try:
            again = read(self.run(x, swapped, init=init))
        except Exception:
            return False
        return again.shape == observed.shape and np.allclose(again, observed[:, order], rtol=1e-5, atol=1e-7,
                                                             equal_nan=True)

    def _swap_heads(self, weights, out_proj=True):
        """The canonical weights with heads 0 and 1 swapped (whole key/value groups when there are several), and
        the order of the heads that results. With ``out_proj``, its columns are swapped too, so that independent
        heads give the same output."""
        spec = self.spec
        h, g = spec.num_heads, spec.groups
        d_out = weights["W_query.weight"].shape[0]
        head_dim = d_out // h
        per_group = h // g
        if g > 1:  # swap groups 0 and 1: their query heads and their key/value heads
            order = list(range(h))
            order[:2 * per_group] = list(range(per_group, 2 * per_group)) + list(range(per_group))
            kv_order = [1, 0, *range(2, g)]
        else:
            order, kv_order = [1, 0, *range(2, h)], list(range(g))

        def rows(a, heads):
            return np.concatenate([a[i * head_dim:(i + 1) * head_dim] for i in heads])

        swapped = dict(weights)
        for name, value in weights.items():
            if name.startswith("W_query."):
                swapped[name] = rows(value, order)
            elif name.startswith(("W_key.", "W_value.")):
                swapped[name] = rows(value, kv_order)
            elif name == "out_proj.weight" and out_proj:
                swapped[name] = np.concatenate([value[:, i * head_dim:(i + 1) * head_dim] for i in order], axis=1)
        return swapped, order

    def probe_heads(self, x, weights):
        if self.spec.num_heads < 2:
            return []
        swapped, order = self._swap_heads(weights)
        if self.spec.out_proj:
            return heads_findings(lambda: (self.run(x, weights), self.run(x, swapped)), what=self.what)
        # without out_proj the heads' outputs sit side by side: swapped heads swap their blocks
        head_dim = weights["W_query.weight"].shape[0] // self.spec.num_heads

        def both():
            before, after = self.run(x, weights), self.run(x, swapped)
            b, t, _ = after.shape
            blocks = after.reshape(b, t, -1, head_dim)[:, :, np.argsort(order)].reshape(b, t, -1)
            return before, blocks

        return heads_findings(both, what=self.what, words=HEAD_MODULES)

    def probe_dependencies(self, x, weights):
        t = np.asarray(x).shape[1]
        positions = np.arange(t)
        return dependency_findings(lambda a: self.run(a, weights), x,
                                   A.allowed_keys(self.spec, positions, positions), what=self.what)


@dataclass
class Deferred:
    """Sources of evidence worked out only when a check fails (``make()`` gives them)."""

    make: Callable[[], list[Evidence]]

    def findings(self, actual, rtol, atol):
        found = []
        for source in self.make():
            try:
                found += source.findings(actual, rtol, atol)
            except Exception:  # a source that cannot run on this code says nothing
                continue
        return found


@dataclass
class Unbatched:
    """Evidence about one sequence of an unbatched module, found on it as a batch of one."""

    evidence: Evidence

    def findings(self, actual, rtol, atol):
        return self.evidence.findings(np.asarray(actual)[None], rtol, atol)


@dataclass
class WeightsFunction:
    """A function of a stage that turns scores (..., n_queries, n_keys) into attention weights: softmax(scores *
    scale) over the keys each query may see (``spec``: causal or not). ``head_name``: what the stage calls the
    width the scale comes from (d_k); ``rerun(scores, width)``: the learner's weights for other scores and another
    width (a second case), or None."""

    spec: A.Attention
    width: int | None = None  # the d_k the scale is 1/sqrt(d_k) of; None: no scale
    rerun: Callable[[np.ndarray, int | None], np.ndarray] | None = None
    what: str = "your weights"
    by_hand: bool = False  # a softmax the stage writes by hand: its own mistakes are searched too

    def scale(self, width, choices=A.NONE) -> float:
        if width is None:
            return 1.0
        return A.scale_of(self.spec, width, width, width, choices)

    def allowed(self, scores, choices=A.NONE):
        n_queries, n_keys = np.shape(scores)[-2:]
        return A.allowed_keys(self.spec, np.arange(n_queries) + n_keys - n_queries, np.arange(n_keys), choices)

    def compute(self, scores, width):
        return lambda choices: A.attention_weights(scores, self.allowed(scores, choices), self.scale(width, choices),
                                                   choices)

    def evidence(self, scores) -> list[Evidence]:
        scores = np.asarray(scores, dtype=np.float64)
        if scores.ndim == 1:  # one query's scores: a row of one
            return [Unbatched(source) for source in self.evidence(scores[None])]
        switches = [A.SCORES, A.SOFTMAX] + ([A.FILL, A.CAUSAL] if self.spec.causal else [])
        if self.by_hand:
            switches.append(A.SOFTMAX_BY_HAND)
        if self.width is not None:
            switches.insert(0, A.scaling_switch(self.spec, self.width, self.width, self.width))
        if scores.shape[-1] != scores.shape[-2]:
            switches.remove(A.SCORES)

        def second():
            rng = np.random.default_rng(31)
            width = None if self.width is None else self.width + 3
            other = rng.normal(0, 2.0, size=scores.shape[:-2] + (scores.shape[-2] + 1, scores.shape[-1] + 1))
            return self.rerun(other.astype(np.float32), width), self.compute(other, width)

        return [Searched(self.compute(scores, self.width), switches, self.what,
                         second if self.rerun is not None else None),
                Said(lambda actual: self.probe(*self.probe_case(actual, scores)))]

    def probe_case(self, actual, scores):
        """The learner's weights on moderate scores of the probe's own (no weight that underflows to 0 there when
        the computation is right, or wrong by a scale), else the check's own."""
        if self.rerun is None:
            return actual, scores
        rng = np.random.default_rng(5)
        moderate = rng.normal(0, 1.0, size=(2, 6, 6))
        return self.rerun(moderate.astype(np.float32), self.width), moderate

    def probe(self, actual, scores):
        width = self.width
        name = self.spec.head_name
        divisors = {"1": 1.0}
        words = {}
        if width is not None:
            divisors |= {f"sqrt({name})": np.sqrt(width), f"1/sqrt({name})": 1 / np.sqrt(width), name: float(width)}
            switch = A.scaling_switch(self.spec, width, width, width)
            value_of = {"none": "1", "times": f"1/sqrt({name})", "no_sqrt": name}
            words = {value_of[v]: w for v, w in switch.wrong.items() if v in value_of}
        return weight_findings(ExposedWeights(np.asarray(actual), np.broadcast_to(scores, np.shape(actual)),
                                              self.allowed(scores), self.scale(width), divisors, words,
                                              what=self.what)) or []
