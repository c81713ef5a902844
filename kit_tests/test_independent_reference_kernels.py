"""The kernels assignment's references (Triton kernels, run here in Triton's interpreter on the CPU) against code the
kit did not write: torch.softmax (k01, k02), F.scaled_dot_product_attention (SDPA: outputs of k02-k06, gradients of
k04 through autograd), torch's FlexAttention (its eager path on the CPU, with a causal mask_mod: outputs and
log-sum-exps of k03) and torch's autograd through softmax (gradients of k04). FlexAttention's backward does not run on
the CPU (torch 2.13 refuses it), so the gradients meet it only where a GPU runs this file.

Paged decoding (k06) reads frontier-attention's f03 layout: here its pools and block tables are filled by f03's own
PagedAttention (identity projections, so that its output is plain attention over the tokens given) and k06 must give
f03's output for each sequence's last token; both are the kit's, so SDPA over the blocks gathered by torch's
indexing is the outside check. No published Triton FlashAttention runs here: the Triton tutorial's current version
needs a GPU's tensor descriptors, which the interpreter does not model, and FlagGems (Apache 2.0, on the package
index), whose Triton attention would be one, refuses to import without a GPU ("No device were detected", tried with
5.0.2). The kit copies no published code into itself, so none is adapted here: on a GPU, such a kernel is the next
outside check to add.

Tolerances: float32 on both sides, the kernels' sums in another order than torch's (rtol 1e-4, atol 1e-5; gradients
summed over 40 rows: atol 3e-5).

    pip install -e '.[kernels]'
    pytest kit_tests/test_independent_reference_kernels.py
"""
import math

import pytest
import torch
import torch.nn.functional as F

from grader.kit import SOLUTIONS
from suite_runtime.adapters import load_stage_module

pytest.importorskip("triton", reason="the kernels assignment needs Triton: pip install -e '.[kernels]'")

CLOSE = dict(rtol=1e-4, atol=1e-5)
GRADIENTS = dict(rtol=1e-4, atol=3e-5)


def stage(name):
    return load_stage_module(SOLUTIONS, name)


def qkv(seed, b=1, h=2, t=37, d=12):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=generator) for _ in range(3)]


def masked_scores(q, k, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    return s


def flex(q, k, v, causal, **kwargs):
    """torch's FlexAttention, eagerly (no compile on the CPU here), causal through a mask_mod."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if causal:
        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        mask = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (flex_attention warns that it is not compiled)
        return flex_attention(q, k, v, block_mask=mask, **kwargs)


def test_softmax_against_torch():
    softmax = stage("k01_fused_softmax").softmax
    generator = torch.Generator().manual_seed(1)
    for shape, scale, block in (((5, 70), 3.0, 16), ((2, 3, 9), 1.0, 4), ((4, 200), 1e3, 64)):
        x = torch.randn(*shape, generator=generator) * scale
        torch.testing.assert_close(softmax(x, block_size=block), torch.softmax(x, dim=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_weights_against_torch(causal):
    q, k, _ = qkv(2)
    weights = stage("k02_tiled_scores").attention_weights(q, k, causal, block_m=32, block_n=16)
    torch.testing.assert_close(weights, torch.softmax(masked_scores(q, k, causal), dim=-1), **CLOSE)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_against_sdpa_and_flex_attention(causal):
    q, k, v = qkv(3)
    o, lse = stage("k03_flash_forward").flash_attention_forward(q, k, v, causal, block_m=16, block_n=32)
    torch.testing.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=causal), **CLOSE)
    flex_o, flex_lse = flex(q, k, v, causal, return_lse=True)
    torch.testing.assert_close(o, flex_o, **CLOSE)
    torch.testing.assert_close(lse, flex_lse, **CLOSE)  # FlexAttention's lse: natural log, as the stage's
    torch.testing.assert_close(lse, torch.logsumexp(masked_scores(q, k, causal), dim=-1), **CLOSE)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_against_sdpa_and_autograd(causal):
    """flash_attention's gradients through its autograd.Function, against SDPA's backward and torch's autograd
    through softmax(masked scores) v (and FlexAttention's backward on a GPU)."""
    module = stage("k04_flash_backward")
    q, k, v = qkv(4, t=40)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))

    def gradients(attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves).backward(do)
        return [t.grad for t in leaves]

    ours = gradients(lambda *t: module.flash_attention(*t, causal))
    others = [lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal),
              lambda q, k, v: torch.softmax(masked_scores(q, k, causal), dim=-1) @ v]
    if torch.cuda.is_available():  # (FlexAttention's backward: GPU only)
        others.append(lambda *t: flex(*[x.cuda() for x in t], causal).cpu())
    for other in others:
        for mine, theirs in zip(ours, gradients(other)):
            torch.testing.assert_close(mine, theirs, **GRADIENTS)


def test_decoding_against_sdpa():
    module = stage("k05_flash_decoding")
    generator = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 3, 10, generator=generator), *qkv(7, b=2, h=3, t=45, d=10)[:2]
    for splits in (1, 4, 7, 64):  # 64: most splits hold no key
        out = module.flash_decode(q, k, v, num_splits=splits, block_n=8)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0], **CLOSE)
    _, lse = module.combine_splits(*module.split_partials(q, k, v, 4, 8))
    torch.testing.assert_close(lse, torch.logsumexp((k @ q[..., None])[..., 0] / math.sqrt(10), dim=-1), **CLOSE)


def test_paged_decoding_against_sdpa_over_the_gathered_blocks():
    module = stage("k06_paged_decoding")
    generator = torch.Generator().manual_seed(8)
    heads, d, page, lens = 2, 8, 4, [13, 1, 8, 30]
    held = [-(-n // page) for n in lens]
    k_pool, v_pool = (torch.randn(sum(held) + 3, heads, page, d, generator=generator) * 9 for _ in range(2))
    order = torch.randperm(sum(held) + 3, generator=generator)
    tables = torch.zeros(len(lens), max(held), dtype=torch.int64)
    at = 0
    for row, blocks in enumerate(held):
        tables[row, :blocks] = order[at:at + blocks]
        at += blocks
    q = torch.randn(len(lens), heads, d, generator=generator)
    out = module.paged_decode(q, k_pool, v_pool, tables, torch.tensor(lens), num_splits=3)
    for r, n in enumerate(lens):
        keys, values = (pool[tables[r, :held[r]]].transpose(0, 1).reshape(heads, -1, d)[:, :n]
                        for pool in (k_pool, v_pool))
        torch.testing.assert_close(out[r], F.scaled_dot_product_attention(q[r][:, None], keys, values)[:, 0], **CLOSE)


def test_paged_decoding_reads_frontier_attention_s_paged_cache():
    """f03's PagedAttention with identity projections fills its pool and block tables (three sequences, one freed
    and its blocks reused); k06 on that pool gives f03's output for each sequence's last token."""
    f03 = stage("f03_paged_kv_cache").PagedAttention
    d, heads, page = 8, 2, 4
    cache = f03(d_in=d, d_out=d, num_heads=heads, num_blocks=12, block_size=page).eval()
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value", "out_proj"):
            getattr(cache, name).weight.copy_(torch.eye(d))
        cache.out_proj.bias.zero_()
        generator = torch.Generator().manual_seed(9)
        tokens = {s: torch.randn(1, n, d, generator=generator) for s, n in ((0, 9), (1, 6), (2, 11))}
        cache(tokens[0], seq_ids=[0])
        cache(tokens[1], seq_ids=[1])
        cache.free(1)
        last = {s: cache(tokens[s], seq_ids=[s])[0, -1] for s in (2,)}  # sequence 2 in sequence 1's blocks
        last[0] = cache(tokens[0][:, -1:], seq_ids=[0])[0, -1]  # one more token of sequence 0
    seqs = [0, 2]
    tables = torch.zeros(2, max(len(cache.block_table(s)) for s in seqs), dtype=torch.int64)
    for row, s in enumerate(seqs):
        tables[row, :len(cache.block_table(s))] = torch.tensor(cache.block_table(s))
    lens = torch.tensor([cache.seq_lens[s] for s in seqs])
    q = torch.stack([tokens[0][0, -1], tokens[2][0, -1]]).view(2, heads, d // heads)
    out = stage("k06_paged_decoding").paged_decode(q, cache.k_pool, cache.v_pool, tables, lens, num_splits=2)
    torch.testing.assert_close(out.reshape(2, d), torch.stack([last[0], last[2]]), **CLOSE)
