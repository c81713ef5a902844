"""Stage 9: multi-head attention by stacking single heads.

The simplest multi-head attention: num_heads independent CausalAttention
modules, each with its own weights, run one after another; their outputs are
concatenated along the feature dimension.

When graded, this stage runs with the kit's CausalAttention, not yours: use
nothing of it beyond its documented constructor and forward.
"""
import torch
import torch.nn as nn
from s08_causal_attention import CausalAttention


class MultiHeadAttentionWrapper(nn.Module):
    """num_heads independent CausalAttention heads, outputs concatenated.

    Submodules: heads = nn.ModuleList of num_heads CausalAttention(d_in, d_out, ...),
    each built with the wrapper's own d_in, d_out, context_length, dropout and qkv_bias:
    the heads apply the dropout, and their parameters (heads.0.W_query.weight, ...) are
    the wrapper's only ones. num_heads may be 1. The tests build it with keyword
    arguments: keep the constructor's parameter names.
    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, num_heads * d_out),
    head 0's output in the first d_out columns, head 1's in the next, and so on.
    The checks also run it on CUDA, the module and x moved there with .to(device).
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        # Build self.heads: an nn.ModuleList of num_heads separate CausalAttention modules (no shared weights).
        ### BEGIN SOLUTION
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )
        ### END SOLUTION

    def forward(self, x):
        # Run every head and join the results along the last (feature) dimension.
        ### BEGIN SOLUTION
        return torch.cat([head(x) for head in self.heads], dim=-1)
        ### END SOLUTION
