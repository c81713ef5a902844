"""Stage m01: chapter 3's attention computed by PyTorch.

Spec: MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False) is chapter 3's
(given). sdpa_attention(mha, x, use_mask=False) equals mha(x) with F.scaled_dot_product_attention doing the
attention (causal through is_causal=True, or with use_mask through a boolean attn_mask, True = takes part;
dropout mha.dropout.p in training mode only). torch_mha_forward(mha, x) equals mha(x) computed by
to_torch_mha(mha), an nn.MultiheadAttention(d_out, num_heads, batch_first=True) holding mha's weights
(d_in == d_out), run with its boolean attn_mask (True = NOT allowed). use_mask=True builds attn_mask from mha.mask,
whatever it holds. Dropout mha.dropout.p acts in training mode only, nothing in eval mode.
"""
import numpy as np
import pytest

from diagnosis import BFLOAT16, Attention, AttentionModule, Said, assert_close, check_dropout
from diagnosis.attention import CAUSAL, OUT_BIAS, ROLES, WINDOW, forward
from diagnosis.dropout import eval_dropout_findings
from suite_runtime.cases import distinct_sizes, draw_weights, exposing_case, normal

pytestmark = pytest.mark.pytorch_attention
STAGE = "m01_pytorch_attention"
CLS = "MultiHeadAttention"
SDPA, TORCH_MHA = "sdpa_attention", "torch_mha_forward"
FLOAT32 = dict(rtol=1e-4, atol=1e-5)  # float32, summation order differs between the fused kernel and the by-hand path
TOLERANCE = {"float32": FLOAT32, "bfloat16": BFLOAT16}


def run(stage, function, init, weights, x, *, use_mask=None, measure=False, **options):
    """function(model, x[, use_mask]) on a MultiHeadAttention(**init) holding ``weights``."""
    step = {"function": function, "args": [x], "model": True,
            "kwargs": {} if use_mask is None else {"use_mask": use_mask}, "measure": measure}
    [result] = stage.session(CLS, init, weights, steps=[step], **options)
    return result


def describe(function, use_mask=None):
    return f"{function}(mha, x{'' if use_mask is None else f', use_mask={use_mask}'})"


# ---------------------------------------------------------------- what the diagnoser runs again

SDPA_INVERTED = ("the boolean mask is inverted: F.scaled_dot_product_attention takes attn_mask True where a token "
                 "takes part, so pass the allowed positions, ~mask (the causal buffer marks the future)")
SCALED_TWICE = ("the scores were scaled twice: F.scaled_dot_product_attention divides by sqrt(head_dim) itself, so "
                "give it the queries as they are")
TORCH_INVERTED = ("nn.MultiheadAttention's boolean attn_mask is True where a key is NOT allowed, the opposite of "
                  "F.scaled_dot_product_attention's: give it the future, mha.mask.bool()[:num_tokens, :num_tokens], "
                  "not ~mask")
IN_PROJ = ("in_proj_weight (and in_proj_bias) stack W_query, W_key and W_value in this order: "
           "torch.cat([W_query.weight, W_key.weight, W_value.weight])")


def sdpa_switches(switches):
    """SDPA's words for the mask's convention and its own scaling; the arguments given in another order."""
    found = []
    for s in switches:
        if s.name == "causal":
            s = s.plus({"inverted": SDPA_INVERTED, "inverted_nan": SDPA_INVERTED})
        elif s.name == "scale":
            s = s.plus({"twice": SCALED_TWICE})
        found.append(s)
    return [*found, ROLES.without("queries_keys")]  # (queries and keys swapped: the transposed scores' switch)


def torch_mha_switches(switches):
    """What a learner chooses around nn.MultiheadAttention, which computes the heads, the scale and the softmax
    itself: the mask given (its convention), the weights copied into in_proj (their order, the biases)."""
    mask = CAUSAL.only("none").plus({
        "inverted": TORCH_INVERTED, "inverted_nan": TORCH_INVERTED,
        "none": "no attn_mask was given: tokens see the future (nn.MultiheadAttention is not causal by itself)"})
    roles = ROLES.plus({k: f"{IN_PROJ} ({w.split(' (')[0].replace('were projected with', 'got')})"
                        for k, w in ROLES.wrong.items()})
    bias = [s.plus({"ignored": "in_proj_bias was left at its initial zeros: copy the biases of W_query, W_key and "
                               "W_value into it"}) for s in switches if s.name == "bias"]
    # (the output without out_proj's bias: a copy left out and a module built with bias=False give the same numbers)
    return [mask, roles, *bias, OUT_BIAS.plus({"missing": (
        "your output lacks out_proj.bias: it was not copied into nn.MultiheadAttention's out_proj, or the module was "
        "built with bias=False, which removes out_proj's bias along with in_proj's (build it with bias=True, and "
        "zero in_proj_bias when qkv_bias=False)")})]


def subject(stage, function, init, use_mask=None, mask=None, **options):
    """``function`` (sdpa_attention or torch_mha_forward) on a MultiHeadAttention as the diagnoser runs it again:
    chapter 3's causal multi-head attention with out_proj (a query with no key gets weights 0, as the fused
    kernels give it). mask: a rule (num_tokens -> the mha.mask buffer, True = masked out) that mha.mask follows
    instead of chapter 3's, for every case the diagnoser runs."""
    def call(stage, cls, init, x, state, options):
        if mask is not None:
            state = {**state, "mask": mask(init["context_length"]).astype(np.float32)}
        return run(stage, function, init, state, x, use_mask=use_mask, **options)

    spec = Attention(num_heads=init["num_heads"], empty_rows="zero", window=None if mask is None else 2)
    adjust = sdpa_switches if function == SDPA else torch_mha_switches
    return AttentionModule(stage, CLS, init, spec, call=call, adjust=adjust, options=options,
                           square=function == TORCH_MHA)


def diagnosis(stage, function, init, x, weights, use_mask=None, rows=slice(None), **options):
    return subject(stage, function, init, use_mask, **options).evidence(x, weights, rows=rows)


def check(stage, function, init, weights, x, expected, what, use_mask=None, **options):
    assert_close(what, run(stage, function, init, weights, x, use_mask=use_mask, **options), expected, **FLOAT32,
                 diagnosis=diagnosis(stage, function, init, x, weights, use_mask, **options))


def square_case(rng, reference_stage):
    """A random MultiHeadAttention with d_in == d_out (as nn.MultiheadAttention needs), input and weights: batch,
    heads, head_dim, width and tokens pairwise distinct."""
    sizes = distinct_sizes(rng, dict(b=(1, 3), num_heads=(1, 4), head_dim=(2, 4), t=(2, 9)),
                           lambda s: {"d": s["num_heads"] * s["head_dim"]})
    init = dict(d_in=sizes["d"], d_out=sizes["d"], context_length=sizes["t"] + int(rng.integers(0, 4)), dropout=0.0,
                num_heads=sizes["num_heads"], qkv_bias=bool(rng.integers(2)))
    x = normal(rng, sizes["b"], sizes["t"], sizes["d"])
    return init, x, draw_weights(rng, reference_stage, CLS, init)


def other_case(rng, reference_stage):
    """A random MultiHeadAttention (d_in != d_out), input and weights: every size pairwise distinct."""
    sizes = distinct_sizes(rng, dict(b=(1, 3), num_heads=(1, 4), head_dim=(2, 4), t=(2, 9), d_in=(2, 9)),
                           lambda s: {"d_out": s["num_heads"] * s["head_dim"]})
    init = dict(d_in=sizes["d_in"], d_out=sizes["d_out"], context_length=sizes["t"] + int(rng.integers(0, 4)),
                dropout=0.0, num_heads=sizes["num_heads"], qkv_bias=bool(rng.integers(2)))
    x = normal(rng, sizes["b"], sizes["t"], sizes["d_in"])
    return init, x, draw_weights(rng, reference_stage, CLS, init)


# ---------------------------------------------------------------- the book's example (public)

@pytest.mark.public
@pytest.mark.parametrize("use_mask", [False, True])
def test_sdpa_on_the_book_example(stage, public_fx, use_mask):
    """The book's MultiHeadAttention(3, 2, 6, 0.0, num_heads=2) at torch.manual_seed(123): SDPA gives chapter 3's
    output, the context vectors printed in section 3.6.2."""
    check(stage, SDPA, public_fx.init("book/"), public_fx.sub("book/weights/"), public_fx.x, public_fx["book/output"],
          describe(SDPA, use_mask), use_mask)


@pytest.mark.public
def test_torch_mha_on_the_example(stage, public_fx):
    """A MultiHeadAttention with d_in == d_out and qkv_bias=True as an nn.MultiheadAttention."""
    check(stage, TORCH_MHA, public_fx.init("square/"), public_fx.sub("square/weights/"), public_fx["square/x"],
          public_fx["square/output"], describe(TORCH_MHA))


# ---------------------------------------------------------------- hidden

# Hidden cases (assignments/modern-attention/fixtures.py M01_HIDDEN); nn.MultiheadAttention only where d_in == d_out.
OTHER_SIZES = [
    *[(case, SDPA, use_mask) for case in ("case0", "case1", "case2") for use_mask in (False, True)],
    ("case1", TORCH_MHA, None), ("case2", TORCH_MHA, None),
]


@pytest.mark.parametrize("case, function, use_mask", OTHER_SIZES)
def test_other_sizes(stage, hidden_fx, case, function, use_mask, device):
    x, weights, init = hidden_fx[f"{case}/x"], hidden_fx.sub(f"{case}/weights/"), hidden_fx.init(f"{case}/")
    check(stage, function, init, weights, x, hidden_fx[f"{case}/output"],
          f"{describe(function, use_mask)} with MultiHeadAttention({init})", use_mask, device=device)


@pytest.mark.parametrize("use_mask", [False, True])
def test_is_causal_and_attn_mask_give_chapter_3(stage, reference, rng, device, use_mask):
    """Random sizes (d_in != d_out): each way to make SDPA causal gives chapter 3's output (graded on its own)."""
    ref = reference.stage(STAGE)
    for _ in range(2):
        init, x, weights = other_case(rng, ref)
        check(stage, SDPA, init, weights, x, ref.forward(CLS, init, x, weights),
              f"{describe(SDPA, use_mask)} with MultiHeadAttention({init}) on x {x.shape}", use_mask, device=device)


def skip_back(context_length):
    """A mask that hides the future and every key more than one position back (1 = masked out, as chapter 3's)."""
    positions = np.arange(context_length)
    return (positions[None, :] > positions[:, None]) | (positions[None, :] < positions[:, None] - 1)


def test_use_mask_follows_the_module_s_mask(stage, reference):
    """use_mask=True builds attn_mask from mha.mask, whatever it holds: given a mask that also hides every key
    more than one position back (1 = masked out, as chapter 3's), each token sees itself and the one before,
    which is_causal alone would not give."""
    r = np.random.default_rng(12)
    init = dict(d_in=6, d_out=8, context_length=7, dropout=0.0, num_heads=2, qkv_bias=False)  # (head_dim 4, batch 3)
    x, weights = normal(r, 3, 7, 6), draw_weights(r, reference.stage(STAGE), CLS, init)
    out = run(stage, SDPA, init, {**weights, "mask": skip_back(7).astype(np.float32)}, x, use_mask=True)
    module = subject(stage, SDPA, init, use_mask=True, mask=skip_back)
    module.adjust = lambda switches: [*sdpa_switches(switches), WINDOW.only("none").plus({
        "none": "use_mask=True did not use mha.mask (it gave plain causal attention): build attn_mask from mha.mask, "
                "True where mha.mask is 0"})]
    assert_close(describe(SDPA, True) + " with mha.mask hiding the future and keys more than one position back",
                 out, forward(module.spec, x, weights), **FLOAT32, diagnosis=module.evidence(x, weights))


def test_torch_mha_equals_chapter_3(stage, reference, rng, device):
    """Random sizes with d_in == d_out: nn.MultiheadAttention holding mha's weights gives mha(x)."""
    ref = reference.stage(STAGE)
    for _ in range(3):
        init, x, weights = square_case(rng, ref)
        check(stage, TORCH_MHA, init, weights, x, ref.forward(CLS, init, x, weights),
              f"{describe(TORCH_MHA)} with MultiHeadAttention({init}) on x {x.shape}", device=device)


@pytest.mark.parametrize("function, use_mask", [(SDPA, False), (SDPA, True), (TORCH_MHA, None)])
def test_output_of_a_token_ignores_later_tokens(stage, reference, function, use_mask):
    r = np.random.default_rng(11)
    init = dict(d_in=6, d_out=6, context_length=7, dropout=0.0, num_heads=3, qkv_bias=True)  # (head_dim 2, batch 1)
    x, weights = normal(r, 1, 7, 6), draw_weights(r, reference.stage(STAGE), CLS, init)
    changed = x.copy()
    changed[:, 5:] -= 2.0
    before = run(stage, function, init, weights, x, use_mask=use_mask)
    after = run(stage, function, init, weights, changed, use_mask=use_mask)
    assert before.shape == x.shape, f"{describe(function, use_mask)} has shape {before.shape}, expected {x.shape}"
    assert_close(f"{describe(function, use_mask)}: outputs of tokens 0-4", after[:, :5], before[:, :5], **FLOAT32,
                 labels=("tokens 5-6 as given", "tokens 5-6 changed"),
                 diagnosis=diagnosis(stage, function, init, changed, weights, use_mask, rows=slice(0, 5)))
    assert not np.allclose(after[:, 5:], before[:, 5:]), "changing tokens 5-6 must change their own outputs"


@pytest.mark.parametrize("function, use_mask", [(SDPA, False), (SDPA, True)])
def test_the_fused_function_does_the_attention(stage, public_fx, function, use_mask):
    """sdpa_attention must call F.scaled_dot_product_attention and no softmax of its own."""
    measured = run(stage, function, public_fx.init("book/"), public_fx.sub("book/weights/"), public_fx.x,
                   use_mask=use_mask, measure=True)
    called = measured["functions"]
    assert "scaled_dot_product_attention" in called and "softmax" not in called, (
        f"{describe(function, use_mask)} should let torch.nn.functional.scaled_dot_product_attention compute the "
        f"attention (scores, scale, mask, softmax, values) in one call; the torch functions it called: {called}"
    )


def test_torch_mha_uses_nn_multihead_attention(stage, public_fx):
    measured = run(stage, TORCH_MHA, public_fx.init("square/"), public_fx.sub("square/weights/"),
                   public_fx["square/x"], measure=True)
    called = measured["functions"]
    assert {"multi_head_attention_forward", "_native_multi_head_attention"} & set(called), (
        "torch_mha_forward should run the nn.MultiheadAttention that to_torch_mha builds (its forward calls "
        f"F.multi_head_attention_forward); the torch functions it called: {called}"
    )


@pytest.mark.parametrize("function, num_heads", [(SDPA, 2), (TORCH_MHA, 1)])
def test_dropout_acts_in_training_mode_only(stage, function, num_heads):
    """One-hot values and an identity out_proj make the output the attention weights (cases.exposing_case):
    with dropout=0.5 about half are dropped and the rest doubled in training mode, none in eval mode.
    (num_heads=1 for nn.MultiheadAttention: that case has d_in == d_out only with one head.)"""
    init, x, weights = exposing_case(np.random.default_rng(13), num_heads=num_heads, num_tokens=8, batch=32)
    plain = forward(Attention(num_heads=num_heads), x, weights)
    # Dropout can only be judged on a function that is right without it: otherwise this check would blame
    # dropout for another mistake of the stage (which its own checks name).
    if not np.allclose(run(stage, function, init, weights, x), plain, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{describe(function)} with dropout=0 does not compute the expected output on this "
                             "test's case, so its dropout cannot be checked yet: fix this stage's other failures "
                             "first.")
    init = dict(init, dropout=0.5)
    for seed in (1, 2):
        assert_close(f"{describe(function)} in eval mode with dropout=0.5 (seed {seed})",
                     run(stage, function, init, weights, x, seed=seed), plain, **FLOAT32,
                     diagnosis=[Said(lambda out: eval_dropout_findings(out, plain, 0.5))])
    trained = run(stage, function, init, weights, x, train=True, seed=0)
    check_dropout(trained, plain, 0.5, f"{describe(function)} in training mode with dropout=0.5",
                  second=lambda rate: (run(stage, function, dict(init, dropout=rate), weights, x, train=True, seed=0),
                                       plain))


SIZES = {  # the CPU twin keeps the test quick; the CUDA case runs a Llama-sized attention (d_model 4096, 32 heads)
    "cpu": dict(b=2, t=32, d=64, num_heads=4),
    "cuda": dict(b=1, t=4096, d=4096, num_heads=32),
    # the dry run (--gpu-cases-on cpu): the CUDA case, small, on the CPU
    "dry run": dict(b=1, t=64, d=256, num_heads=32),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("function", [SDPA, TORCH_MHA])
def test_llama_sized(stage, reference, target, dtype, function):
    """bfloat16 is compared with the float32 reference (its SDPA path) at bf16 tolerance."""
    size, device = SIZES[target.size], target.device
    r = np.random.default_rng(14)
    init = dict(d_in=size["d"], d_out=size["d"], context_length=size["t"], dropout=0.0,
                num_heads=size["num_heads"], qkv_bias=True)
    x = normal(r, size["b"], size["t"], size["d"])
    weights = draw_weights(r, reference.stage(STAGE), CLS, init)
    expected = run(reference.stage(STAGE), SDPA, init, weights, x, device=device)
    assert_close(f"{describe(function)} ({device}, {dtype}, MultiHeadAttention({init}))",
                 run(stage, function, init, weights, x, device=device, dtype=dtype), expected, **TOLERANCE[dtype],
                 # (the evidence is computed in NumPy: at the CPU twin's size only)
                 diagnosis=[] if target.cuda else diagnosis(stage, function, init, x, weights, device=device))
