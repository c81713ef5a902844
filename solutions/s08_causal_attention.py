"""Stage 8: a batched causal self-attention module.

Puts stages 5-7 together for a batch of sequences: projections, scaled scores,
a causal mask kept as a buffer, softmax, dropout on the weights, values.
The mask is built once for the longest sequence (context_length) and cut to
the actual number of tokens at every call. As a registered buffer it is saved
in the state_dict and moves with ``.to(device)``, but it is not trained.
"""
import torch
import torch.nn as nn


class CausalAttention(nn.Module):
    """Single-head causal self-attention.

    Submodules: W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=qkv_bias);
    dropout = nn.Dropout(dropout). Buffer: mask (context_length, context_length),
    1 above the diagonal (future positions), 0 elsewhere. No other parameters. Every
    size comes from the constructor's arguments (the tests pass them by name), never
    from a global or the book's example.
    forward(x): x (b, num_tokens, d_in), num_tokens <= context_length -> (b, num_tokens, d_out);
    b and num_tokens may be 1. Token t's output depends on tokens 0..t only. The scores
    are scaled by 1/sqrt(d_out) (the keys' width); dropout acts on the attention weights,
    after the softmax, in training mode only.
    The checks also run it on CUDA, the module and x moved there with .to(device): a
    tensor created inside forward (torch.ones, torch.full ...) must be on x's device.
    """

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        # Create the projections (honour qkv_bias), the dropout layer and the causal mask as a registered buffer.
        ### BEGIN SOLUTION
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )
        ### END SOLUTION

    def forward(self, x):
        # Score every pair in each sequence, mask the future with -inf, take the scaled softmax,
        # apply dropout to the weights, return the weighted sum of the values.
        ### BEGIN SOLUTION
        b, num_tokens, d_in = x.shape
        queries = self.W_query(x)  # (b, num_tokens, d_out)
        keys = self.W_key(x)
        values = self.W_value(x)

        attn_scores = queries @ keys.transpose(1, 2)  # (b, num_tokens, num_tokens)
        # The buffer is sized for context_length; cut it to this batch's length.
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values  # (b, num_tokens, d_out)
        ### END SOLUTION
