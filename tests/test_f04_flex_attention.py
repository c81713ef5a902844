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
from functools import partial

import numpy as np
import pytest

from diagnosis import BFLOAT16, ERROR_READINGS, ErrorReading, assert_close
from suite_runtime.cases import normal

pytestmark = pytest.mark.flex_attention
STAGE = "f04_flex_attention"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32 against a float64 NumPy reference: rounding only
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}

# What typical mistakes are called in the feedback (the catalogue of mistakes looks for these words).
STRICT = "the diagonal was masked: a query sees its own token too, q_idx >= kv_idx (not >)"
ANTI_CAUSAL = "the mask is reversed: queries see later keys instead of earlier ones; q_idx >= kv_idx"
NO_MASK = "the mask_mod was not applied: pass a block mask made from it to flex_attention (block_mask=...)"
WINDOW_OFF = "the window is off by one: q_idx - kv_idx < window (window tokens, the query's own included)"
WINDOW_SYMMETRIC = "the window is not causal: also require q_idx >= kv_idx (a window of past tokens only)"
ALIBI_SIGN = ("the ALiBi bias has the wrong sign: subtract slope[h] * (q_idx - kv_idx), a penalty that grows with "
              "the distance")
ALIBI_FROM_ZERO = "the ALiBi slopes start one step early: slope[h] = 2^(-8 (h + 1) / num_heads), the first 2^(-8/n)"
ALIBI_GEOMETRIC = ("for a head count that is not a power of 2 the slopes follow the ALiBi paper's rule: those of the "
                   "largest power of 2 below it, then every other slope of twice that, not one geometric sequence")
CAP_NO_DIVIDE = "soft-capping is cap * tanh(score / cap): the score was not divided by cap inside tanh"
CAP_NO_MULTIPLY = "soft-capping is cap * tanh(score / cap): tanh's result was not multiplied back by cap"
DOC_NOT_CAUSAL = "tokens of a document see its later tokens: the document mask must be causal too (q_idx >= kv_idx)"
DOC_IGNORED = "the documents were ignored: a token sees only its own document's tokens (document_ids must match)"


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


ERROR_READINGS = [*ERROR_READINGS, ErrorReading(DATA_DEPENDENT, mods_branching_on_tensors),  # (conftest reads them)
                  ErrorReading(COMPILED, compiled)]


# ---------------------------------------------------------------- NumPy references (float64)

def np_slopes(num_heads, rule="paper", start=1):
    def geometric(n):
        return [2.0 ** (-8.0 * (h + start) / n) for h in range(n)]

    if rule == "geometric":
        return np.array(geometric(num_heads))
    n = 2 ** int(np.floor(np.log2(num_heads)))
    return np.array(geometric(n) + geometric(2 * n)[0::2][:num_heads - n])


def np_attention(q, k, v, allowed=None, bias=None, cap=None, cap_form="right"):
    """softmax(mod(q k^T / sqrt(d)) + bias, masked) v; rows with no key give 0 (as flex_attention does)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if cap is not None:
        s = {"right": cap * np.tanh(s / cap), "no_divide": cap * np.tanh(s), "no_multiply": np.tanh(s / cap)}[cap_form]
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = np.where(allowed, s, -np.inf)
    empty = np.isneginf(s).all(axis=-1, keepdims=True)
    s = np.where(empty, 0, s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    w = np.where(empty, 0, e / e.sum(axis=-1, keepdims=True))
    return w @ v


def grid(n_q, n_kv):
    return np.arange(n_q)[:, None], np.arange(n_kv)[None, :]


def np_causal(n_q, n_kv, form="right"):
    i, j = grid(n_q, n_kv)
    return {"right": j <= i, "strict": j < i, "anti": j >= i}[form]


def np_window(n, window, form="right"):
    i, j = grid(n, n)
    return {"right": (j <= i) & (i - j < window), "off": (j <= i) & (i - j <= window),
            "symmetric": np.abs(i - j) < window}[form]


def np_documents(ids, form="right"):
    ids = np.asarray(ids)
    i, j = grid(len(ids), len(ids))
    same = ids[:, None] == ids[None, :]
    return {"right": same & (j <= i), "not_causal": same, "ignored": j <= i}[form]


def np_alibi_bias(num_heads, n, sign=1, **slopes):
    i, j = grid(n, n)
    return -sign * np_slopes(num_heads, **slopes)[:, None, None] * (i - j)  # (num_heads, n, n)


def causal_mistakes(q, k, v):
    n_q, n_kv = q.shape[-2], k.shape[-2]
    return {STRICT: np_attention(q, k, v, np_causal(n_q, n_kv, "strict")),
            ANTI_CAUSAL: np_attention(q, k, v, np_causal(n_q, n_kv, "anti")), NO_MASK: np_attention(q, k, v)}


def window_mistakes(q, k, v, window, cap=None):
    n = q.shape[-2]
    return {WINDOW_OFF: np_attention(q, k, v, np_window(n, window, "off"), cap=cap),
            WINDOW_SYMMETRIC: np_attention(q, k, v, np_window(n, window, "symmetric"), cap=cap),
            NO_MASK: np_attention(q, k, v, cap=cap)}


def alibi_mistakes(q, k, v):
    h, n = q.shape[1], q.shape[-2]
    run = partial(np_attention, q, k, v, np_causal(n, n))
    found = {ALIBI_SIGN: run(bias=np_alibi_bias(h, n, sign=-1)),
             ALIBI_FROM_ZERO: run(bias=np_alibi_bias(h, n, start=0))}
    if h & (h - 1):  # not a power of 2
        found[ALIBI_GEOMETRIC] = run(bias=np_alibi_bias(h, n, rule="geometric"))
    return found


def cap_mistakes(q, k, v, cap, window=None):
    n = q.shape[-2]
    allowed = np_causal(n, n) if window is None else np_window(n, window)
    found = {CAP_NO_DIVIDE: np_attention(q, k, v, allowed, cap=cap, cap_form="no_divide"),
             CAP_NO_MULTIPLY: np_attention(q, k, v, allowed, cap=cap, cap_form="no_multiply"),
             NO_MASK: np_attention(q, k, v, cap=cap)}
    return found if window is None else found | window_mistakes(q, k, v, window, cap)


def document_mistakes(q, k, v, ids):
    return {DOC_NOT_CAUSAL: np_attention(q, k, v, np_documents(ids, "not_causal")),
            DOC_IGNORED: np_attention(q, k, v, np_documents(ids, "ignored"))}


def expected_of(kind, q, k, v, **arguments):
    """The dense reference of each model's attention."""
    n_q, n_kv = q.shape[-2], k.shape[-2]
    if kind == "causal":
        return np_attention(q, k, v, np_causal(n_q, n_kv))
    if kind == "sliding_window":
        return np_attention(q, k, v, np_window(n_q, arguments["window"]))
    if kind == "alibi":
        return np_attention(q, k, v, np_causal(n_q, n_kv), bias=np_alibi_bias(q.shape[1], n_q))
    if kind == "gemma2":
        window = arguments.get("window")
        allowed = np_causal(n_q, n_kv) if window is None else np_window(n_q, window)
        return np_attention(q, k, v, allowed, cap=arguments["cap"])
    return np_attention(q, k, v, np_documents(arguments["document_ids"]))


def mistakes_of(kind, q, k, v, **arguments):
    return {"causal": lambda: causal_mistakes(q, k, v),
            "sliding_window": lambda: window_mistakes(q, k, v, arguments.get("window")),
            "alibi": lambda: alibi_mistakes(q, k, v),
            "gemma2": lambda: cap_mistakes(q, k, v, arguments.get("cap"), arguments.get("window")),
            "packed": lambda: document_mistakes(q, k, v, arguments.get("document_ids"))}[kind]


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
                 mistakes=mistakes_of(kind, q, k, v, **arguments) if dtype == "float32" else None)


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
    slopes = stage.alibi_slopes(4)
    assert_close("alibi_slopes(4)", slopes, [2**-2, 2**-4, 2**-6, 2**-8], rtol=1e-6, atol=0,
                 mistakes={ALIBI_FROM_ZERO: np_slopes(4, start=0)})
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
        assert_close(f"alibi_slopes({num_heads})", stage.alibi_slopes(num_heads), np_slopes(num_heads), rtol=1e-6,
                     atol=0, mistakes={ALIBI_FROM_ZERO: np_slopes(num_heads, start=0),
                                       **({ALIBI_GEOMETRIC: np_slopes(num_heads, rule="geometric")}
                                          if num_heads & (num_heads - 1) else {})})


def test_attend_without_mods(stage, rng):
    """attend(q, k, v) with no score_mod and no mask_mod is plain softmax attention, here of 3 queries over 7 keys."""
    q, k, v = normal(rng, 1, 2, 3, 4), normal(rng, 1, 2, 7, 4), normal(rng, 1, 2, 7, 4)
    assert_close("attend(q, k, v) (no score_mod, no mask_mod)", stage.attend(q, k, v), np_attention(q, k, v),
                 **FLOAT32, hint="Without a mask_mod, pass block_mask=None: every key takes part.")


def test_random_cases(stage, rng):
    """Three of the models' attentions, drawn at random, on a random shape, window, cap and documents (each costs
    FlexAttention a new trace: three keep the stage quick)."""
    b, h, n, d = int(rng.integers(1, 3)), int(rng.integers(1, 7)), int(rng.integers(2, 20)), int(rng.integers(1, 9))
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
    "cpu": dict(b=1, h=4, t=96, d=32, window=32),
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
