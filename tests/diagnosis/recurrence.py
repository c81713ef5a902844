"""Linear attention with a gated delta rule (Gated DeltaNet) as a mechanism, in NumPy (float64), written once with
its switches: the recurrent form (a state S of d_k x d_v per head, decayed, corrected and written token by token),
the chunked form (the same outputs from a few matrix products per chunk) and the layer around them.

``recurrent(q, k, v, g, beta, state, choices)`` and ``chunked(..., chunk_size, ...)`` give (outputs, final state);
``layer(x, weights, num_heads, choices, chunks, chunk_size)`` a GatedDeltaNet's outputs, decoded in ``chunks``.
``RECURRENT``, ``CHUNKED`` and ``LAYER`` are the switches of each. The probes run the learner's form once on inputs
of their own (``probe_case``) and read the recurrence's properties from its outputs (``recurrence_findings``): the
decay the state shows when nothing is written (gates applied, and when), the first write's size from an empty
state (beta, read after write), and what writing the same key twice leaves (the delta rule's correction).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping

import numpy as np

from . import attention as A
from .findings import Finding
from .search import Switch

Choices = Mapping[str, Hashable]
NONE: Choices = {}


def _start(q, k, v, g, beta, state, choices):
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    b, h, t, d_k = k.shape
    scale = {None: 1 / np.sqrt(d_k), "missing": 1.0, "d_v": 1 / np.sqrt(v.shape[-1])}[choices.get("query_scale")]
    if choices.get("beta") == "missing":
        beta = np.ones_like(beta)
    s = np.zeros((b, h, d_k, v.shape[-1])) if state is None or choices.get("initial_state") == "ignored" \
        else np.array(state, np.float64)
    return q * scale, k, v, g, beta, s


def decays(g, choices: Choices = NONE):
    """What the state is multiplied by at each token: exp(g)."""
    gate = choices.get("gate")
    return {None: np.exp(g), "raw": g, "sign": np.exp(-g), "missing": np.ones_like(g)}[gate]


def recurrent(q, k, v, g, beta, state=None, choices: Choices = NONE):
    """Token by token: S <- exp(g_t) S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = S^T q_t."""
    q, k, v, g, beta, s = _start(q, k, v, g, beta, state, choices)
    out = np.zeros(v.shape)
    alpha = decays(g, choices)
    order = choices.get("decay")
    for i in range(k.shape[2]):
        a = alpha[..., i][..., None, None]
        before = s
        if order != "after":
            s = s * a
        predicted = np.einsum("bhk,bhkv->bhv", k[..., i, :], before if order == "prediction" else s)
        delta = choices.get("delta")
        if delta == "missing":
            u = beta[..., i, None] * v[..., i, :]
        elif delta == "beta_on_v":
            u = beta[..., i, None] * v[..., i, :] - predicted
        elif delta == "sign":
            u = beta[..., i, None] * (predicted - v[..., i, :])
        else:
            u = beta[..., i, None] * (v[..., i, :] - predicted)
        written = s + k[..., i, :, None] * u[..., None, :]
        if order == "after":
            written = written * a
        out[..., i, :] = np.einsum("bhk,bhkv->bhv", q[..., i, :], s if choices.get("read") == "before_write"
                                   else written)
        s = written
    return out, s


def chunked(q, k, v, g, beta, chunk_size: int, state=None, choices: Choices = NONE):
    """The chunked ("WY") form of the same recurrence, chunk by chunk (the last one may be shorter)."""
    q, k, v, g, beta, s = _start(q, k, v, g, beta, state, choices)
    g = {None: g, "missing": np.zeros_like(g), "sign": -g}.get(choices.get("gate"), g)
    t = k.shape[2]
    out = np.zeros(v.shape)
    c = choices.get("chunk")
    for start in range(0, t, chunk_size):
        part = slice(start, min(start + chunk_size, t))
        qc, kc, vc, bc = q[..., part, :], k[..., part, :], v[..., part, :], beta[..., part]
        gamma = {"gamma_not_cumulative": g[..., part], "gamma_global": np.cumsum(g, axis=-1)[..., part]}.get(
            c, np.cumsum(g[..., part], axis=-1))
        size = part.stop - part.start
        below = np.tril(np.ones((size, size), bool))
        diff = gamma[..., :, None] - gamma[..., None, :]
        if c == "decay_transposed":
            diff = -diff
        decay = np.where(below, np.exp(np.where(below, diff, 0)), 0)
        a = bc[..., :, None] * (kc @ kc.swapaxes(-1, -2)) * decay
        a = a if c == "diagonal_in_a" else np.tril(a, -1)
        system = a + (0 if c == "diagonal_in_a" else np.eye(size))
        u = np.linalg.solve(system, (bc * (np.exp(gamma) if c == "u_with_decay" else 1))[..., None] * vc)
        w = np.linalg.solve(system, (bc * (1 if c == "w_without_decay" else np.exp(gamma)))[..., None] * kc)
        v_new = u if c == "no_state_correction" else u - w @ s
        inner = qc @ kc.swapaxes(-1, -2) * (below if c == "no_intra_decay" else decay)
        read = 0 if c == "no_state_read" else (qc * (1 if c == "state_read_undecayed" else
                                                     np.exp(gamma))[..., None]) @ s
        out[..., part, :] = read + inner @ v_new
        last = gamma[..., -1:]
        weights = 1 if c == "written_undecayed" else np.exp(last - gamma)[..., None]
        written = (kc * weights).swapaxes(-1, -2) @ v_new
        s = (s if c == "state_not_decayed" else np.exp(last)[..., None] * s) + written
    return out, s


def layer(x, weights, num_heads: int, choices: Choices = NONE, chunks=None, chunk_size=None):
    """GatedDeltaNet's outputs for x (b, T, d_in) decoded in ``chunks`` (None: one forward; each step starts from the
    state the last one left), by the recurrent form (``chunk_size`` None) or the chunked one."""
    x = np.asarray(x, np.float64)
    b, t, _ = x.shape
    q, k, v = (A.split(A.linear(x, weights, n), num_heads, choices) for n in ("W_query", "W_key", "W_value"))
    norm = choices.get("norm")

    # (heads / tokens: over axis 1 of (b, num_heads, T, d) or of (b, T, num_heads, d), F.normalize's default dim)
    axis = {"heads": 1, "tokens": 2}.get(norm, -1)

    def unit(a):
        return a / np.linalg.norm(a, axis=axis, keepdims=True)

    if norm != "missing":
        k = unit(k)
        q = q if norm == "keys_only" else unit(q)
    raw_beta = A.linear(x, weights, "W_beta").transpose(0, 2, 1)
    raw_gate = A.linear(x, weights, "W_gate").transpose(0, 2, 1)
    beta = raw_beta if choices.get("beta_act") == "missing" else 1 / (1 + np.exp(-raw_beta))
    gate_act = choices.get("gate_act")
    g = {None: -np.log1p(np.exp(-raw_gate)), "sigmoid": 1 / (1 + np.exp(-raw_gate)), "missing": raw_gate}[gate_act]
    outputs, state = [], None
    start = 0
    for size in (chunks or [t]):
        part = slice(start, start + size)
        args = (q[..., part, :], k[..., part, :], v[..., part, :], g[..., part], beta[..., part])
        initial = None if choices.get("cache") == "ignored" else state
        if chunk_size is None:
            out, state = recurrent(*args, initial, choices)
        else:
            out, state = chunked(*args, chunk_size, initial, choices)
        outputs.append(out)
        start += size
    out = A.merge(np.concatenate(outputs, axis=2), choices)
    return A.linear(out, weights, "out_proj"), state


# ---------------------------------------------------------------- the switches

DECAY_AFTER = ("the state was decayed after the update instead of before it: forget first (S <- exp(g_t) S), then "
               "predict, correct and write")
NO_DELTA = ("the delta rule's correction is missing: write u_t = beta_t (v_t - S^T k_t), the part of v_t the state "
            "does not already predict (writing beta_t v_t is plain linear attention)")
UNDECAYED_PREDICTION = ("the prediction S^T k_t was read from the state before its decay: decay first, then predict "
                        "from the decayed state")
READ_BEFORE_WRITE = "the output read the state before the token's write: o_t = S^T q_t after S includes k_t u_t^T"
NO_QUERY_SCALE = "the queries were not scaled by 1/sqrt(d_k)"
BETA_ON_V_ONLY = ("beta multiplied v_t alone: u_t = beta_t (v_t - S^T k_t), the learning rate scales the whole "
                  "correction")
GATE_RAW = "the state was multiplied by g_t itself: the gate is alpha_t = exp(g_t) (g_t is its logarithm, <= 0)"
NO_GATE = "the gate was not applied: the state forgets, S <- exp(g_t) S, before each token's update"
NO_BETA = "beta was not applied: u_t = beta_t (v_t - S^T k_t), the learning rate scales the correction"
RECURRENT = [
    Switch("decay", "recurrence", {"after": DECAY_AFTER, "prediction": UNDECAYED_PREDICTION}),
    Switch("gate", "recurrence", {
        "raw": GATE_RAW, "missing": NO_GATE,
        "sign": "the state was multiplied by exp(-g_t), which grows it: the gate is exp(g_t) <= 1"}),
    Switch("delta", "recurrence", {
        "missing": NO_DELTA, "beta_on_v": BETA_ON_V_ONLY,
        "sign": "the correction has the wrong sign: u_t = beta_t (v_t - S^T k_t), the target minus the prediction"}),
    Switch("read", "recurrence", {"before_write": READ_BEFORE_WRITE}),
    Switch("query_scale", "scaling", {
        "missing": NO_QUERY_SCALE,
        "d_v": "the queries were scaled by 1/sqrt(d_v): scale them by 1/sqrt(d_k), the width of the dot products"}),
    Switch("beta", "recurrence", {"missing": NO_BETA}),
]
INITIAL = Switch("initial_state", "recurrence", {
    "ignored": "the initial state was ignored: start from initial_state when it is given (zeros only when it is None)"})
STATE_NOT_DECAYED = ("the state carried to the next chunk was not decayed: S_end = exp(gamma_C) S0 + (K * exp(gamma_C "
                     "- gamma))^T V_new")
NO_STATE_READ = ("the chunk's outputs left out what they read of the state it started from: O = (Q * exp(gamma)) S0 "
                 "+ ((Q K^T) * Gamma) V_new")
DIAGONAL_IN_A = ("the diagonal of beta_i (k_i . k_i) entered the triangular system: A is strictly lower "
                 "(solve_triangular(..., unitriangular=True) takes the diagonal as 1)")
NO_INTRA_DECAY = ("the decays inside the chunk were left out of Q K^T: multiply it by Gamma[i, j] = exp(gamma_i - "
                  "gamma_j), as A is")
CHUNK = Switch("chunk", "recurrence", {
    "state_not_decayed": STATE_NOT_DECAYED,
    "no_state_read": NO_STATE_READ,
    "diagonal_in_a": DIAGONAL_IN_A,
    "no_intra_decay": NO_INTRA_DECAY,
    "gamma_not_cumulative": "gamma was taken as g itself: it is the cumulative sum of g over the chunk up to each "
                            "token (g.cumsum(dim=-1))",
    "gamma_global": "gamma was summed from the sequence's start: it restarts at each chunk (the cumulative sum of the "
                    "chunk's own g), the decay before it being already in the state the chunk starts from",
    "decay_transposed": "Gamma was built as exp(gamma_j - gamma_i): Gamma[i, j] = exp(gamma_i - gamma_j) for j <= i "
                        "(the decay from token j to token i)",
    "w_without_decay": "W was solved from diag(beta) K without exp(gamma): W = (I + A)^-1 diag(beta exp(gamma)) K",
    # (the decay on the wrong one of the UT transform's two solves: each way round is a mistake of its own)
    "u_with_decay": "U was solved from diag(beta exp(gamma)) V: the decay weights the keys' solve W, never the "
                    "values': U = (I + A)^-1 diag(beta) V",
    "no_state_correction": "V_new left out the state's prediction: V_new = U - W S0",
    "state_read_undecayed": "the chunk read the state it started from without the decay: (Q * exp(gamma)) S0",
    "written_undecayed": "the chunk's writes reached the next state without their decay: "
                         "(K * exp(gamma_C - gamma))^T V_new"})
CHUNKED = [CHUNK, RECURRENT[4], RECURRENT[5], RECURRENT[1].only("sign", "missing")]
LAYER = [
    Switch("norm", "layer", {
        "missing": "the queries and keys were not L2-normalised: F.normalize(..., dim=-1) over each head's features",
        "keys_only": "the queries were not L2-normalised (the keys were): normalise both per head",
        "heads": "the queries and keys were L2-normalised over the head axis, dim 1 of (b, num_heads, T, head_dim), "
                 "which is F.normalize's default dim: normalise over each head's features, F.normalize(..., dim=-1)",
        "tokens": "the queries and keys were L2-normalised over the token axis (dim 1 of (b, T, num_heads, "
                  "head_dim), F.normalize's default dim): normalise over each head's features, "
                  "F.normalize(..., dim=-1)"}),
    Switch("beta_act", "layer", {
        "missing": "beta = W_beta(x) without the sigmoid: beta = sigmoid(W_beta(x)) in (0, 1)"}),
    Switch("gate_act", "layer", {
        "sigmoid": "g = sigmoid(W_gate(x)): g is a log decay, logsigmoid(W_gate(x)) <= 0",
        "missing": "g = W_gate(x) without logsigmoid: g = logsigmoid(W_gate(x)) <= 0"}),
    Switch("cache", "KV cache", {
        "ignored": "each cached step started from an empty state: start from self.state (the state the last step "
                   "left), and keep the new one"}),
]


def layer_switches(num_heads: int, chunked_form: bool, cached: bool) -> list[Switch]:
    found = [*LAYER[:3], *(CHUNKED if chunked_form else RECURRENT), A.PROJECTIONS["out_proj"]]
    if cached:
        found.append(LAYER[3])
    if num_heads > 1:
        found += list(A.HEADS.values())
    return found


# ---------------------------------------------------------------- probes

def probe_case(d_k: int = 3, d_v: int = 4):
    """Inputs of the probe's own (b = 2, h = 1, T = 2): in batch row 0 the keys are 0 (nothing is written) and the
    initial state is not, with gates exp(g) = 0.9 then 0.8; in batch row 1, from an empty state and with no
    forgetting, the same unit key (= the query) and value are written twice with beta = 0.5.
    returns q, k, v, g, beta, initial_state."""
    rng = np.random.default_rng(61)
    q = np.zeros((2, 1, 2, d_k), np.float32)
    k = np.zeros((2, 1, 2, d_k), np.float32)
    v = np.zeros((2, 1, 2, d_v), np.float32)
    q[0, 0] = rng.normal(size=(2, d_k))
    v[0, 0] = rng.normal(size=(2, d_v))
    unit = np.zeros(d_k, np.float32)
    unit[0] = 1
    q[1, 0] = k[1, 0] = unit
    v[1, 0] = rng.normal(size=d_v)
    g = np.log(np.array([[[0.9, 0.8]], [[1.0, 1.0]]], np.float32))
    beta = np.array([[[0.3, 0.6]], [[0.5, 0.5]]], np.float32)
    state = np.zeros((2, 1, d_k, d_v), np.float32)
    state[0, 0] = rng.normal(size=(d_k, d_v))
    return q, k, v, g, beta, state


def recurrence_findings(out, q, k, v, g, beta, state, *, what="your outputs") -> list[Finding]:
    """What the learner's outputs on ``probe_case`` show: the factors the initial state was read with at each token
    (batch row 0: nothing written), and the size of what was read after one and two writes of the same key and value
    (batch row 1; read only where row 0 shows the gates and the scale right, which it assumes)."""
    out = np.asarray(out, np.float64)
    if out.shape != np.shape(v):
        return []
    d_k = np.shape(k)[-1]
    # batch row 0: o_t = c_t q_t^T S0 / sqrt(d_k); c_t must be exp(g_0 + ... + g_t)
    base = np.einsum("tk,kv->tv", np.asarray(q[0, 0], np.float64), np.asarray(state[0, 0], np.float64)) / np.sqrt(d_k)
    factors = np.array([np.dot(out[0, 0, t], base[t]) / np.dot(base[t], base[t]) for t in range(2)])
    if not np.allclose(out[0, 0], factors[:, None] * base, rtol=1e-3, atol=1e-5):
        return []  # not the initial state read at any factor: the search says why
    g0 = np.asarray(g[0, 0], np.float64)
    alpha = np.exp(g0)
    right = np.array([alpha[0], alpha[0] * alpha[1]])
    shown = ", ".join(f"{f:.4g}" for f in factors)
    shows = (f"with zero keys (nothing written), {what} read the initial state times {shown} at tokens 0 and 1; the "
             f"gates exp(g) = {alpha[0]:.2g}, {alpha[1]:.2g} decay it by {right[0]:.4g}, then {right[1]:.4g}")
    scale = 1.0
    if np.allclose(factors, 0, atol=1e-6):
        return [Finding(shows + ".", ("the output left out what it reads of the state it started from",),
                        "recurrence", "probe", weight=3)]
    ratio = factors[1] / factors[0] if abs(factors[0]) > 1e-9 else np.inf
    if abs(ratio / alpha[1] - 1) < 1e-3:  # the decays are right; the size may not be
        scale = factors[0] / alpha[0]
        if abs(scale - 1) > 1e-3:
            names = {np.sqrt(d_k): (NO_QUERY_SCALE,),
                     1 / np.sqrt(d_k): ("the queries were scaled by 1/sqrt(d_k) twice",)}
            named = next((c for key, c in names.items() if abs(scale / key - 1) < 1e-3), None)
            return [Finding(f"with zero keys (nothing written), {what} read the initial state decayed as the gates "
                            f"say, but {scale:.4g} times too large.", named or (
                                "the read o_t = S^T q_t (q scaled by 1/sqrt(d_k)) is scaled by something else",),
                            "scaling", "probe", weight=3)]
    else:
        causes = {1.0: (NO_GATE,), g0[1]: (GATE_RAW,), alpha[0] * alpha[1]: (
            "the earlier tokens' decay was applied again: each token's (or chunk's) decay counts from the state it "
            "starts from (in the chunked form, gamma restarts at each chunk)",), alpha[1] / alpha[0]: (
            "the state carried from token to token (or chunk to chunk) lost its earlier decay: each token's gate "
            "multiplies the state as it is",), 1 / alpha[1]: (
            "the state was multiplied by exp(-g_t), which grows it: the gate is exp(g_t) <= 1",)}
        named = next((c for key, c in causes.items() if abs(ratio - key) < 1e-3 * max(1, abs(key))), None)
        return [Finding(shows + ".", named or ("the gates were not applied as S <- exp(g_t) S before each token's "
                                               "update",), "recurrence", "probe", weight=3)]
    # batch row 1: q = k unit, g = 0, beta = 0.5 twice: o_0 = beta v / sqrt(d_k), o_1 = beta (2 - beta) v / sqrt(d_k)
    value = np.asarray(v[1, 0, 0], np.float64) / np.sqrt(d_k)
    sizes = np.array([np.dot(out[1, 0, t], value) / np.dot(value, value) for t in range(2)])
    if not np.allclose(out[1, 0], sizes[:, None] * value, rtol=1e-3, atol=1e-5):
        return []
    b0 = float(beta[1, 0, 0])
    right = np.array([b0, b0 * (2 - b0)])
    if np.allclose(sizes, right, rtol=1e-3):
        return []
    shown = ", ".join(f"{x:.4g}" for x in sizes)
    shows = (f"writing the same unit key and value twice from an empty state (no forgetting, beta = {b0}), {what} "
             f"read {shown} times the value (over sqrt(d_k)) after each write; the delta rule reads {right[0]:.4g}, "
             f"then {right[1]:.4g} (the second write adds only what the state did not predict)")
    causes = {(b0, 2 * b0): (NO_DELTA,), (0.0, b0): (READ_BEFORE_WRITE,), (1.0, 1.0): (NO_BETA,),
              (b0, b0): (BETA_ON_V_ONLY,), (-b0, -b0 * (2 + b0)): (
                  "the correction has the wrong sign: u_t = beta_t (v_t - S^T k_t), the target minus the prediction",)}
    named = next((c for key, c in causes.items() if np.allclose(sizes, key, rtol=1e-3, atol=1e-6)), None)
    return [Finding(shows + ".", named or ("the write is not u_t = beta_t (v_t - S^T k_t), S <- S + k_t u_t^T, read "
                                           "after it",), "recurrence", "probe", weight=3)]


def state_findings(state, b: int, h: int, d_k: int, d_v: int, *, what="your final state") -> list[Finding]:
    """A state of the wrong size: the recurrence keeps d_k x d_v numbers per head, whatever the length."""
    shape = np.shape(state)
    if shape == (b, h, d_k, d_v):
        return []
    if shape == (b, h, d_v, d_k) and d_k != d_v:
        return [Finding(f"{what} has shape {shape}: (b, h, d_v, d_k), the transpose of (b, h, d_k, d_v).",
                        ("the state was kept as S^T: S is d_k x d_v (keys index its rows), S <- S + k_t u_t^T",),
                        "recurrence", "probe", weight=1)]
    return []
