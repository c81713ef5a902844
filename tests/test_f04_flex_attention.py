"""Stage f04: FlexAttention (torch.nn.attention.flex_attention), eager on the CPU.

Spec: mask_mods causal(b, h, q_idx, kv_idx) (q_idx >= kv_idx), sliding_window(window) (causal and
q_idx - kv_idx < window), document_causal(document_ids) (same document and causal); score_mods alibi(slopes)
(score - slopes[h] * (q_idx - kv_idx)) with alibi_slopes(num_heads) (2^(-8 (h+1) / n) for n a power of 2, the ALiBi
paper's interleaving rule otherwise) and soft_cap(cap) (cap * tanh(score / cap)), applied to the scaled score;
attend(q, k, v, score_mod=None, mask_mod=None) runs flex_attention with a block mask made from mask_mod. Each
model's attention (causal_attention, sliding_window_attention, alibi_attention, gemma2_attention, packed_attention)
equals a dense computation of the same scores, mask and softmax.

The eager path computes the full score matrix in float32 as the dense reference does: float32 rounding only.
"""
import warnings

import numpy as np
import pytest

from diagnosis import BFLOAT16, ERROR_READINGS, ErrorReading, Probed, Searched, assert_close
from diagnosis import flex as F
from diagnosis.probes import ExposedWeights, weight_findings
from diagnosis.subjects import Deferred
from suite_runtime.cases import normal, pairwise_distinct

pytestmark = pytest.mark.flex_attention
STAGE = "f04_flex_attention"


@pytest.fixture(autouse=True)
def eager_flex_attention_is_meant():
    """The module's own filter of FlexAttention's "Use torch.compile(flex_attention)" warning, for the checks too:
    pytest resets warning filters around each check, and the module may be imported in one check and call
    flex_attention first in another."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


# ---------------------------------------------------------------- errors
#
# A mask_mod or score_mod that branches on a tensor's value (Python's `if`, `and`, `or`, .item()) raises inside
# FlexAttention: torch.vmap runs it on batches of indices, and its eager path traces the score_mod. These messages
# are vmap's and Dynamo's own; the reading is shown only for a call that ran some of the learner's mods, and names them.

DATA_DEPENDENT = r"data-dependent control flow|calling \.item\(\) on a Tensor|Data-dependent branching"
MODS = {  # the function a check calls -> the learner's mods it runs (``kwargs``: the call's keyword arguments)
    "causal_attention": lambda kwargs: ["causal"],
    "sliding_window_attention": lambda kwargs: ["sliding_window(window)'s mask_mod"],
    "alibi_attention": lambda kwargs: ["alibi(slopes)'s score_mod", "causal"],
    "gemma2_attention": lambda kwargs: ["soft_cap(cap)'s score_mod", "causal" if kwargs.get("window") is None
                                        else "sliding_window(window)'s mask_mod"],
    "packed_attention": lambda kwargs: ["document_causal(document_ids)'s mask_mod"],
}


def mods_branching_on_tensors(match, call):
    """The learner's mods the failing call ran, when it ran any: one of them branched on a tensor."""
    ran = [mod for function, mods in MODS.items() for args, kwargs in call.function_calls(function)
           for mod in mods(kwargs)]
    if not ran:
        return None
    ran = " and ".join(dict.fromkeys(ran))
    return (f"a mask_mod or score_mod branched on a tensor's value (this check ran {ran}): "
            "FlexAttention calls them on tensors of indices (torch.vmap) and traces them, so write them as tensor "
            "expressions: combine conditions with & and |, choose with torch.where, and never use Python's `and`, "
            "`or` or `if` on a tensor, nor .item()")


COMPILED = r"\A(?:InductorError|BackendCompilerFailed)\b"  # torch.compile's own errors: it ran


def compiled(match, call):
    """torch.compile's compiler raised in a call of this stage's attention."""
    if not any(call.function_calls(function) for function in [*MODS, "attend"]):
        return None
    return ("torch.compile's compiler (Inductor) raised: call flex_attention directly, without torch.compile (its "
            "eager path gives the same numbers); graded code may not compile anyway, which writes files and starts "
            "a C++ compiler")


# (the errors' own texts say what was done: torch.vmap met a branch on a tensor, which only the mods it traces can
# hold; torch.compile's compiler ran)
ERROR_READINGS = [*ERROR_READINGS, ErrorReading(DATA_DEPENDENT, mods_branching_on_tensors, proven=True),
                  ErrorReading(COMPILED, compiled, proven=True)]  # (conftest reads a stage's readings here)


# ---------------------------------------------------------------- what a failed check is diagnosed with

def spec_of(kind, **arguments) -> F.Flex:
    """What ``{kind}_attention(q, k, v, **arguments)`` computes (diagnosis.flex)."""
    window = arguments.get("window")
    if kind == "causal":
        return F.Flex("causal")
    if kind == "sliding_window":
        return F.Flex("window", window=window)
    if kind == "alibi":
        return F.Flex("causal", "alibi")
    if kind == "gemma2":
        return F.Flex("causal" if window is None else "window", "soft_cap", window=window, cap=arguments["cap"])
    return F.Flex("documents", document_ids=tuple(np.asarray(arguments["document_ids"]).tolist()))


def diagnosis(stage, kind, q, k, v, **arguments):
    """What a failed check of ``{kind}_attention`` is diagnosed with: its mask_mod's and score_mod's switches
    (diagnosis.flex) searched on this case and on a second one of other sizes, and the learner's attention weights
    read through values that are the identity (the keys each query sees, the temperature, ALiBi's slopes, weight
    across documents)."""
    def make():
        spec = spec_of(kind, **arguments)
        function = getattr(stage, f"{kind}_attention")

        def second():
            r = np.random.default_rng(93)
            b, h, n, d = q.shape
            q2, k2, v2 = (normal(r, b, h + 1, n + 1, d + 1) for _ in range(3))
            more = dict(arguments)
            if "document_ids" in more:
                ids = np.asarray(more["document_ids"])
                more["document_ids"] = np.concatenate([ids, ids[-1:]])
            if kind == "gemma2":
                q2 = q2 * 3
            return function(q2, k2, v2, **more), lambda choices: F.attention(spec_of(kind, **more), q2, k2, v2,
                                                                           choices)

        return [Searched(lambda choices: F.attention(spec, q, k, v, choices), F.switches(spec, q.shape[1]),
                         "your output", second),
                Probed([lambda: exposed_findings(function, spec, q, k, **arguments)])]

    return [Deferred(make)]


def exposed_findings(function, spec, q, k, **arguments):
    """The learner's weights (the output for values that are the identity) read against the mask, the temperature
    of the (modified) scores, ALiBi's slopes and the documents."""
    observed = np.asarray(function(q, k, F.exposed_values(q, k), **arguments), np.float64)
    d = q.shape[-1]
    n_q, n_kv = q.shape[-2], k.shape[-2]
    mask = F.allowed(spec, n_q, n_kv)
    scale = 1 / np.sqrt(d)
    scores = F.scores(spec, q, k) / scale  # (the modified scores, in the units the scale divides)
    divisors = {"sqrt(head_dim)": np.sqrt(d), "1": 1.0, "head_dim": float(d)}
    words = {"1": F.SCALE.wrong["none"], "head_dim": F.SCALE.wrong["twice"]}
    found = weight_findings(ExposedWeights(observed, np.broadcast_to(scores, observed.shape), mask, scale, divisors,
                                           words, window=spec.window, empty_rows="zero"))
    if spec.score == "alibi":
        found += F.alibi_findings(observed, q, k, mask, F.slopes(q.shape[1]))
    if spec.mask == "documents":
        found += F.document_findings(observed, spec.document_ids)
    return found


def expected_of(kind, q, k, v, **arguments):
    """The dense reference of each model's attention."""
    return F.attention(spec_of(kind, **arguments), q, k, v)


def check_kind(stage, kind, q, k, v, what="", device="cpu", dtype="float32", **arguments):
    """``{kind}_attention(q, k, v, **arguments)`` of the learner's module against the dense reference."""
    if device == "cpu" and dtype == "float32":
        out = getattr(stage, f"{kind}_attention")(q, k, v, **arguments)
    else:  # (the adapter's plain call runs on the CPU in float32: a session places its arrays)
        [out] = stage.session(steps=[{"function": f"{kind}_attention", "args": [q, k, v], "kwargs": arguments}],
                              device=device, dtype=dtype)
    shown = ", ".join(f"{name}={value.tolist() if hasattr(value, 'tolist') else value}"
                      for name, value in arguments.items())
    assert_close(f"{what}{kind}_attention(q, k, v{', ' + shown if shown else ''})", out,
                 expected_of(kind, q, k, v, **arguments), **TOLERANCE[dtype],
                 diagnosis=diagnosis(stage, kind, q, k, v, **arguments) if dtype == "float32" else ())


def check_slopes(stage, num_heads):
    """alibi_slopes(num_heads) against ALiBi's rule, its switch searched."""
    assert_close(f"alibi_slopes({num_heads})", stage.alibi_slopes(num_heads), F.slopes(num_heads), rtol=1e-6, atol=0,
                 diagnosis=[Searched(lambda choices: F.slopes(num_heads, choices), [F.slope_switch(num_heads)],
                                     "your slopes")])


# ---------------------------------------------------------------- public: the stored example

def qkv(fx, prefix=""):
    return fx[f"{prefix}q"], fx[f"{prefix}k"], fx[f"{prefix}v"]


@pytest.mark.public
def test_causal_on_the_example(stage, public_fx):
    """4 heads of 8 features over 10 tokens: causal_attention."""
    check_kind(stage, "causal", *qkv(public_fx))


@pytest.mark.public
def test_sliding_window_on_the_example(stage, public_fx):
    check_kind(stage, "sliding_window", *qkv(public_fx), window=3)


@pytest.mark.public
def test_alibi_on_the_example(stage, public_fx):
    """alibi_slopes(4) = 1/4, 1/16, 1/64, 1/256, and the causal attention they bias."""
    check_slopes(stage, 4)
    check_kind(stage, "alibi", *qkv(public_fx))


@pytest.mark.public
def test_gemma2_soft_capping_on_the_example(stage, public_fx):
    """Scores scaled up so that many pass the cap of 2: soft-capping with a sliding window of 4."""
    q, k, v = qkv(public_fx)
    check_kind(stage, "gemma2", q * 4, k, v, cap=2.0, window=4)


@pytest.mark.public
def test_packed_documents_on_the_example(stage, public_fx):
    """Four documents of 3, 2, 4 and 1 tokens packed into one sequence of 10."""
    check_kind(stage, "packed", *qkv(public_fx), document_ids=public_fx.document_ids)


# ---------------------------------------------------------------- hidden

def test_stored_cases(stage, hidden_fx):
    """6 heads (not a power of 2) for ALiBi, soft-capping without a window, three documents."""
    q, k, v = qkv(hidden_fx)
    check_kind(stage, "alibi", q, k, v)
    check_kind(stage, "gemma2", q * 3, k, v, cap=1.5)
    check_kind(stage, "packed", q, k, v, document_ids=hidden_fx.document_ids)


def test_alibi_slopes(stage, rng):
    """Powers of 2 and the paper's rule for the others (6 heads: 1/4, 1/16, 1/64, 1/256, then 1/2, 1/8)."""
    for num_heads in (1, 2, 8, 6, 12, int(rng.integers(3, 40))):
        check_slopes(stage, num_heads)


def test_attend_without_mods(stage, rng):
    """attend(q, k, v) with no score_mod and no mask_mod is plain softmax attention, here of 3 queries over 7 keys."""
    q, k, v = normal(rng, 1, 2, 3, 4), normal(rng, 1, 2, 7, 4), normal(rng, 1, 2, 7, 5)
    spec = F.Flex(mask=None)
    assert_close("attend(q, k, v) (no score_mod, no mask_mod: every key takes part)", stage.attend(q, k, v),
                 F.attention(spec, q, k, v), **FLOAT32,
                 diagnosis=[Searched(lambda choices: F.attention(spec, q, k, v, choices), F.switches(spec, 2)),
                            Probed([lambda: exposed_findings(stage.attend, spec, q, k)])])


def test_random_cases(stage, rng):
    """Three of the models' attentions, drawn at random, on a random shape, window, cap and documents (each costs
    FlexAttention a new trace: three keep the stage quick)."""
    sizes = pairwise_distinct(rng, lambda r: dict(b=int(r.integers(1, 3)), h=int(r.integers(2, 7)),
                                                  n=int(r.integers(3, 20)), d=int(r.integers(2, 9))))
    b, h, n, d = sizes["b"], sizes["h"], sizes["n"], sizes["d"]
    q, k, v = normal(rng, b, h, n, d), normal(rng, b, h, n, d), normal(rng, b, h, n, d)
    ids = np.sort(rng.integers(0, 4, size=n))
    kinds = [("causal", {}), ("sliding_window", {"window": int(rng.integers(1, n + 1))}), ("alibi", {}),
             ("gemma2", {"cap": float(rng.uniform(0.5, 3)), "window": int(rng.integers(1, n + 1))}),
             ("packed", {"document_ids": ids})]
    for chosen in rng.choice(len(kinds), size=3, replace=False):
        kind, arguments = kinds[chosen]
        check_kind(stage, kind, q * (3 if kind == "gemma2" else 1), k, v, what=f"q {q.shape}: ", **arguments)


SIZES = {  # the CPU twin keeps the test quick; the CUDA case is a local layer of Gemma 2 9B (16 heads of 256,
    # soft cap 50, a window of 4096) over 8192 tokens. In float32 only: for the cap to act, scores must reach 50,
    # and bfloat16 rounds a score of 50 by up to 0.2, which moves its weight by 20%: no tolerance could tell a
    # right soft-cap from a wrong one there.
    "cpu": dict(b=1, h=4, t=96, d=32, window=24),
    "cuda": dict(b=1, h=16, t=8192, d=256, window=4096),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, h=16, t=128, d=64, window=48),
}


def test_gemma2_sized_local_layer(stage, target):
    """Soft-capped sliding-window attention at Gemma 2's sizes, against the test's own float32 computation on the
    device (scores large enough for the cap of 50 to act)."""
    import torch

    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(401)
    q, k, v = (normal(r, size["b"], size["h"], size["t"], size["d"]) for _ in range(3))
    q *= 3 * np.sqrt(size["d"])  # scores of std ~3 sqrt(d): the largest pass the cap of 50
    tq, tk, tv = (torch.from_numpy(a).to(device) for a in (q, k, v))
    i = torch.arange(size["t"], device=device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < size["window"])
    s = 50.0 * torch.tanh(tq @ tk.transpose(-2, -1) / size["d"] ** 0.5 / 50.0)
    expected = (torch.softmax(s.masked_fill(~allowed, -torch.inf), dim=-1) @ tv).cpu().numpy()
    del s, allowed
    [out] = stage.session(steps=[{"function": "gemma2_attention", "args": [q, k, v],
                                  "kwargs": {"cap": 50.0, "window": size["window"]}}], device=device)
    assert_close(f"{device}: gemma2_attention(cap=50, window={size['window']})", out, expected, **FLOAT32)
