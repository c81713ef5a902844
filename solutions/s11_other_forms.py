"""Stage 11: two other published forms of multi-head attention.

* Combined QKV (the nanoGPT style): one nn.Linear produces queries, keys and
  values side by side; one matrix product instead of three.
* Per-head modules: a ModuleList of small single heads of width head_dim,
  concatenated and then mixed by out_proj.

Both compute exactly what MultiHeadAttention computes once its weights are
mapped across; the two mapping functions below do that, and they show where
every head's weights live inside the big projections. As in MultiHeadAttention,
head_dim = d_out // num_heads, each head's scores are scaled by 1/sqrt(head_dim)
and causally masked, and dropout acts on the attention weights, after the softmax,
in training mode only. Every size comes from the constructor's arguments (the tests
pass them by name): the output has width d_out even when d_in differs. b and
num_tokens (<= context_length) may be 1. The checks also run the modules on CUDA,
moved there with .to(device): a tensor created inside forward (torch.ones,
torch.full ...) must be on x's device.
"""
import torch
import torch.nn as nn


class MultiHeadAttentionCombinedQKV(nn.Module):
    """Causal multi-head attention with one fused query/key/value projection.

    Submodules: W_qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias), its output laid
    out as [queries | keys | values], each part split into heads as MultiHeadAttention
    splits its projections (head h: features h*head_dim .. (h+1)*head_dim - 1);
    out_proj = nn.Linear(d_out, d_out); dropout = nn.Dropout(dropout). No other parameters.
    Buffer: mask (1, 1, context_length, context_length), 1 above the diagonal, shaped to
    broadcast over batch and heads.
    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, d_out)
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        # Create W_qkv (one projection three times as wide), out_proj, dropout and a (1, 1, T, T) mask buffer.
        ### BEGIN SOLUTION
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)
        self.register_buffer("mask", mask.view(1, 1, context_length, context_length))
        ### END SOLUTION

    def forward(self, x):
        # Project once, split into q, k, v, then attend per head as MultiHeadAttention does.
        ### BEGIN SOLUTION
        b, num_tokens, d_in = x.shape
        qkv = self.W_qkv(x)  # (b, num_tokens, 3 * d_out)
        queries, keys, values = qkv.split(self.d_out, dim=2)  # each (b, num_tokens, d_out)

        # (b, num_tokens, d_out) -> (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_tokens)
        # The (1, 1, T, T) buffer broadcasts over batch and heads; cut it to this batch's length.
        mask_bool = self.mask.bool()[:, :, :num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, num_tokens, num_heads, head_dim)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)
        ### END SOLUTION


class Head(nn.Module):
    """One causal attention head of width head_dim.

    Submodules: W_query, W_key, W_value = nn.Linear(d_in, head_dim, bias=qkv_bias);
    dropout = nn.Dropout(dropout). Buffer: mask (context_length, context_length), 1 above
    the diagonal. No other parameters. All sizes come from the constructor (no global variables).
    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, head_dim), the scores scaled
    by 1/sqrt(head_dim)
    """

    def __init__(self, d_in, head_dim, context_length, dropout, qkv_bias=False):
        super().__init__()
        # Create this head's projections, dropout and mask buffer, sized from the arguments only.
        ### BEGIN SOLUTION
        self.W_query = nn.Linear(d_in, head_dim, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, head_dim, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )
        ### END SOLUTION

    def forward(self, x):
        # Compute scaled, causally masked attention for this head alone, as CausalAttention does.
        ### BEGIN SOLUTION
        b, num_tokens, d_in = x.shape
        queries = self.W_query(x)  # (b, num_tokens, head_dim)
        keys = self.W_key(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)  # (b, num_tokens, num_tokens)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values  # (b, num_tokens, head_dim)
        ### END SOLUTION


class MultiHeadAttentionPerHead(nn.Module):
    """Causal multi-head attention built from num_heads Head modules and out_proj.

    Submodules: heads = nn.ModuleList of num_heads Head(d_in, d_out // num_heads, ...),
    each built with this module's context_length, dropout and qkv_bias (the heads apply
    the dropout); out_proj = nn.Linear(d_out, d_out). No other parameters.
    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, d_out); head h's output fills
    features h*head_dim .. (h+1)*head_dim - 1 of out_proj's input.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        # Build self.heads (num_heads Head modules of width d_out // num_heads) and out_proj.
        ### BEGIN SOLUTION
        head_dim = d_out // num_heads
        self.heads = nn.ModuleList(
            [Head(d_in, head_dim, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )
        self.out_proj = nn.Linear(d_out, d_out)
        ### END SOLUTION

    def forward(self, x):
        # Concatenate the heads along the features, then mix them with out_proj.
        ### BEGIN SOLUTION
        return self.out_proj(torch.cat([head(x) for head in self.heads], dim=-1))
        ### END SOLUTION


def combined_qkv_state_dict(mha_state_dict):
    """Map a MultiHeadAttention state_dict onto MultiHeadAttentionCombinedQKV's names.

    W_qkv.weight is W_query.weight, W_key.weight and W_value.weight stacked along
    the output dimension (rows), in that order; likewise the biases if present.
    out_proj is copied. Buffers (mask) are not mapped. Returns a new dict of tensors
    whose keys are exactly W_qkv.weight, out_proj.weight, out_proj.bias and, when the
    given projections have biases, W_qkv.bias.
    """
    # Stack the three projections' rows (and biases); keep out_proj as it is.
    ### BEGIN SOLUTION
    sd = mha_state_dict
    mapped = {
        "W_qkv.weight": torch.cat([sd["W_query.weight"], sd["W_key.weight"], sd["W_value.weight"]], dim=0),
        "out_proj.weight": sd["out_proj.weight"],
        "out_proj.bias": sd["out_proj.bias"],
    }
    if "W_query.bias" in sd:
        mapped["W_qkv.bias"] = torch.cat([sd["W_query.bias"], sd["W_key.bias"], sd["W_value.bias"]], dim=0)
    return mapped
    ### END SOLUTION


def per_head_state_dict(mha_state_dict, num_heads):
    """Map a MultiHeadAttention state_dict onto MultiHeadAttentionPerHead's names.

    Head h owns rows h*head_dim .. (h+1)*head_dim - 1 of each projection's weight
    (and bias): heads.{h}.W_query.weight = W_query.weight[h*head_dim:(h+1)*head_dim].
    out_proj is copied. Buffers (mask) are not mapped. Returns a new dict of tensors
    whose keys are exactly heads.{h}.W_query.weight, heads.{h}.W_key.weight and
    heads.{h}.W_value.weight for every head h (and their .bias when the given
    projections have biases), out_proj.weight and out_proj.bias.
    """
    # Slice each projection's rows into num_heads equal blocks, one per head.
    ### BEGIN SOLUTION
    sd = mha_state_dict
    head_dim = sd["W_query.weight"].shape[0] // num_heads
    mapped = {"out_proj.weight": sd["out_proj.weight"], "out_proj.bias": sd["out_proj.bias"]}
    for h in range(num_heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        for name in ("W_query", "W_key", "W_value"):
            for kind in ("weight", "bias"):
                if f"{name}.{kind}" in sd:
                    mapped[f"heads.{h}.{name}.{kind}"] = sd[f"{name}.{kind}"][rows]
    return mapped
    ### END SOLUTION
