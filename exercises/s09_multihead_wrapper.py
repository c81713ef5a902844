"""Stage 9: multi-head attention by stacking single heads.

The simplest multi-head attention: num_heads independent CausalAttention
modules, each with its own weights, run one after another; their outputs are
concatenated along the feature dimension.
"""
import torch
import torch.nn as nn
from s08_causal_attention import CausalAttention


class MultiHeadAttentionWrapper(nn.Module):
    """num_heads independent CausalAttention heads, outputs concatenated.

    Submodules: heads = nn.ModuleList of num_heads CausalAttention(d_in, d_out, ...).
    forward(x): x (b, num_tokens, d_in) -> (b, num_tokens, num_heads * d_out),
    head 0's output in the first d_out columns, head 1's in the next, and so on.
    """

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        # TODO: Build self.heads: an nn.ModuleList of num_heads separate CausalAttention modules (no shared weights).
        raise NotImplementedError("s09_multihead_wrapper: MultiHeadAttentionWrapper.__init__: see its TODO")

    def forward(self, x):
        # TODO: Run every head and join the results along the last (feature) dimension.
        raise NotImplementedError("s09_multihead_wrapper: MultiHeadAttentionWrapper.forward: see its TODO")
