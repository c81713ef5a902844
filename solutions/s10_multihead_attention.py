"""Stage 10: multi-head attention with weight splits.

Instead of num_heads separate modules, one projection of width d_out is split
into num_heads slices of head_dim = d_out // num_heads. Reshaping (view) and
moving the head axis next to the batch axis (transpose) lets one batched
matrix product compute every head at once. An output projection then mixes
the concatenated heads.

Each function and the class are graded on their own; any size may be 1.
"""
import torch
import torch.nn as nn


def batched_head_scores(a):
    """q @ k^T for every head in one batched matrix product, with q = k = a.

    a: (b, num_heads, num_tokens, head_dim)   returns: (b, num_heads, num_tokens, num_tokens)
    """
    # Use a single @: it multiplies the last two dimensions and treats the leading ones as a batch.
    ### BEGIN SOLUTION
    return a @ a.transpose(2, 3)
    ### END SOLUTION


def per_head_scores_loop(a):
    """The same result as ``batched_head_scores``, one head at a time in a loop.

    a: (b, num_heads, num_tokens, head_dim)   returns: (b, num_heads, num_tokens, num_tokens)
    """
    # Loop over batch and head, multiply each (num_tokens, head_dim) slice by its transpose.
    ### BEGIN SOLUTION
    b, num_heads, num_tokens, _ = a.shape
    out = torch.empty(b, num_heads, num_tokens, num_tokens, dtype=a.dtype, device=a.device)
    for i in range(b):
        for h in range(num_heads):
            head = a[i, h]  # (num_tokens, head_dim)
            out[i, h] = head @ head.T
    return out
    ### END SOLUTION


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention with one projection per role, split into heads.

    Submodules: W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=qkv_bias);
    out_proj = nn.Linear(d_out, d_out) (with bias); dropout = nn.Dropout(dropout).
    Buffer: mask (context_length, context_length), 1 above the diagonal, 0 elsewhere.
    No other parameters. Every size comes from the constructor's arguments (the tests
    pass them by name), never from a global or the book's example.
    Head h uses output features h*head_dim .. (h+1)*head_dim - 1 of each projection,
    head_dim = d_out // num_heads; num_heads may be 1.
    forward(x): x (b, num_tokens, d_in), num_tokens <= context_length -> (b, num_tokens, d_out);
    b and num_tokens may be 1. Each head's scores are scaled by 1/sqrt(head_dim) (not
    d_out) and causally masked; dropout acts on the attention weights, after the softmax,
    in training mode only; head h's context vectors fill features h*head_dim ..
    (h+1)*head_dim - 1 of out_proj's input.
    The checks run it in float32 and in bfloat16, on the CPU and on CUDA, the module and
    x moved with .to(device, dtype): a tensor created inside forward (torch.ones, torch.full
    ...) must take x's device and, if floating-point, x's dtype. A bfloat16 output is
    compared with the float32 computation at rtol = atol = 3e-2.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        # Store d_out, num_heads, head_dim; create the projections, out_proj, dropout and the mask buffer.
        ### BEGIN SOLUTION
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )
        ### END SOLUTION

    def forward(self, x):
        # Project, split d_out into (num_heads, head_dim), bring heads forward, attend per
        # head with the causal mask, then merge the heads back and apply out_proj.
        ### BEGIN SOLUTION
        b, num_tokens, d_in = x.shape
        queries = self.W_query(x)  # (b, num_tokens, d_out)
        keys = self.W_key(x)
        values = self.W_value(x)

        # (b, num_tokens, d_out) -> (b, num_tokens, num_heads, head_dim) -> (b, num_heads, num_tokens, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_tokens, num_tokens)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        # Scale by the width of one head, the d_k of each head's dot products.
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = (attn_weights @ values).transpose(1, 2)  # (b, num_tokens, num_heads, head_dim)
        # transpose made the tensor non-contiguous; view needs contiguous memory.
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)
        ### END SOLUTION
