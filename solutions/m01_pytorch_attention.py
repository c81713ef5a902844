"""Stage m01: chapter 3's attention, computed by PyTorch.

Chapter 3 (section 3.6.2) builds MultiHeadAttention by hand: project, split into heads, scores,
causal mask, softmax, mix the values, merge the heads, out_proj. PyTorch ships the middle of that
as one fused function, F.scaled_dot_product_attention ("SDPA": scores, scale 1/sqrt(head_dim), mask,
softmax, dropout and the mix of the values in one call, with kernels that never store the full score
matrix on a GPU), and the whole module as nn.MultiheadAttention. This stage computes chapter 3's
output both ways, from the weights of the module you wrote.

The two take boolean masks with OPPOSITE meanings:
* F.scaled_dot_product_attention(attn_mask=...): True = this key takes part (is attended to);
* nn.MultiheadAttention(attn_mask=..., key_padding_mask=...): True = this key is masked out.

API
    MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False): chapter 3's
        (given). Submodules W_query, W_key, W_value, out_proj, dropout; buffer mask (1 above the diagonal).
    sdpa_attention(mha, x, use_mask=False): mha(x) computed with F.scaled_dot_product_attention from
        mha's weights: causal through is_causal=True, or (use_mask) through a boolean attn_mask made
        from mha.mask. Dropout mha.dropout.p in training mode only.
    to_torch_mha(mha) -> nn.MultiheadAttention(d_out, num_heads, batch_first=True) holding mha's weights
        (needs d_in == d_out: nn.MultiheadAttention projects queries from embed_dim features).
    torch_mha_forward(mha, x): mha(x) computed by that nn.MultiheadAttention, causally.

Tested: each function on its own against chapter 3's output (float32, and bfloat16 on the GPU at bf16's
tolerance), for any num_heads, d_in and d_out (nn.MultiheadAttention: d_in == d_out); a token's output never
depends on later tokens; with use_mask=True, attn_mask follows whatever mha.mask holds (not merely is_causal);
dropout mha.dropout.p in training mode only, nothing at all in eval mode; sdpa_attention computes the attention
in F.scaled_dot_product_attention (no softmax of its own), torch_mha_forward in nn.MultiheadAttention.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def split_heads(t, num_heads):
    """(b, num_tokens, d_out) -> (b, num_heads, num_tokens, head_dim), head h owning features
    h*head_dim .. (h+1)*head_dim - 1 (chapter 3, section 3.6.2)."""
    b, num_tokens, d_out = t.shape
    return t.view(b, num_tokens, num_heads, d_out // num_heads).transpose(1, 2)


def merge_heads(t):
    """(b, num_heads, num_tokens, head_dim) -> (b, num_tokens, num_heads * head_dim), the inverse of split_heads."""
    b, num_heads, num_tokens, head_dim = t.shape
    # transpose makes the tensor non-contiguous; view needs contiguous memory.
    return t.transpose(1, 2).contiguous().view(b, num_tokens, num_heads * head_dim)


class MultiHeadAttention(nn.Module):
    """Chapter 3's causal multi-head attention (section 3.6.2), as you wrote it there.

    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, d_out)
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def project_heads(self, x):
        """Queries, keys and values of x (b, num_tokens, d_in), each (b, num_heads, num_tokens, head_dim)."""
        return tuple(split_heads(W(x), self.num_heads) for W in (self.W_query, self.W_key, self.W_value))

    def forward(self, x):
        num_tokens = x.shape[1]
        queries, keys, values = self.project_heads(x)  # (b, num_heads, num_tokens, head_dim) each

        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_tokens)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values  # (b, num_heads, num_tokens, head_dim)
        return self.out_proj(merge_heads(context_vec))


def sdpa_attention(mha, x, use_mask=False):
    """mha(x), with F.scaled_dot_product_attention doing the attention between the projections.

    mha: a MultiHeadAttention; x: (b, num_tokens, d_in) -> (b, num_tokens, d_out).
    use_mask=False: causal through is_causal=True; use_mask=True: through attn_mask, built from mha.mask.
    """
    queries, keys, values = mha.project_heads(x)  # (b, num_heads, num_tokens, head_dim) each
    # Call F.scaled_dot_product_attention(queries, keys, values, ...): it scales by 1/sqrt(head_dim) itself.
    # Causal with is_causal=True, or (use_mask) with attn_mask = a boolean (num_tokens, num_tokens) mask
    # made from mha.mask; SDPA's attn_mask is True where a key TAKES PART, while mha.mask marks the future.
    # Dropout: dropout_p = mha.dropout.p in training mode (mha.training), 0 in eval mode (SDPA cannot tell).
    # Then merge the heads of the result (b, num_heads, num_tokens, head_dim) and apply mha.out_proj.
    ### BEGIN SOLUTION
    num_tokens = x.shape[1]
    dropout_p = mha.dropout.p if mha.training else 0.0
    if use_mask:
        allowed = ~mha.mask.bool()[:num_tokens, :num_tokens]  # (num_tokens, num_tokens), True = takes part
        context_vec = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, dropout_p=dropout_p)
    else:
        context_vec = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, dropout_p=dropout_p)
    return mha.out_proj(merge_heads(context_vec))
    ### END SOLUTION


def to_torch_mha(mha):
    """An nn.MultiheadAttention(embed_dim=d_out, num_heads, batch_first=True) with mha's weights, on
    mha's device and dtype, in mha's train/eval mode."""
    d_in, d_out = mha.W_query.in_features, mha.d_out
    assert d_in == d_out, (
        f"nn.MultiheadAttention projects queries from embed_dim features: it needs d_in == d_out, not {d_in} != {d_out}"
    )
    # Build nn.MultiheadAttention(d_out, mha.num_heads, dropout=mha.dropout.p, batch_first=True, ...) on the
    # device and dtype of mha's weights and copy the weights in under torch.no_grad(): in_proj_weight
    # (3 * d_out, d_out) stacks the query, key and value weights in that order, in_proj_bias their biases (zeros
    # when qkv_bias=False: its `bias` argument covers in_proj and out_proj together, and out_proj has a bias);
    # out_proj is an nn.Linear(d_out, d_out) like mha's. Return it in mha's train/eval mode.
    ### BEGIN SOLUTION
    like = mha.out_proj.weight  # the device and dtype to build on
    torch_mha = nn.MultiheadAttention(d_out, mha.num_heads, dropout=mha.dropout.p, bias=True, batch_first=True,
                                      device=like.device, dtype=like.dtype)
    projections = (mha.W_query, mha.W_key, mha.W_value)
    with torch.no_grad():
        torch_mha.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
        if mha.W_query.bias is None:
            torch_mha.in_proj_bias.zero_()
        else:
            torch_mha.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
        torch_mha.out_proj.weight.copy_(mha.out_proj.weight)
        torch_mha.out_proj.bias.copy_(mha.out_proj.bias)
    return torch_mha.train(mha.training)
    ### END SOLUTION


def torch_mha_forward(mha, x):
    """mha(x) computed by to_torch_mha(mha): x (b, num_tokens, d_out) -> (b, num_tokens, d_out)."""
    # Run to_torch_mha(mha)(query, key, value, attn_mask=..., need_weights=False) on x and return its output
    # (the first of the pair it returns). Its boolean attn_mask is True where a key is NOT allowed: the
    # opposite of SDPA's, the same as mha.mask.
    ### BEGIN SOLUTION
    torch_mha = to_torch_mha(mha)
    num_tokens = x.shape[1]
    future = mha.mask.bool()[:num_tokens, :num_tokens]  # (num_tokens, num_tokens), True = masked out
    out, _ = torch_mha(x, x, x, attn_mask=future, need_weights=False)
    return out
    ### END SOLUTION
