"""Stage 5: self-attention as a module, for all tokens at once.

SelfAttention_v1 stores its projections as raw ``nn.Parameter`` matrices
(d_in, d_out) and multiplies by them. SelfAttention_v2 uses ``nn.Linear``,
which stores the transposed matrix (d_out, d_in), can add a bias and starts
from a better initialisation. Both compute the same function: scaled
dot-product attention over one sequence, the scores divided by sqrt(d_out)
(the keys' width), for any num_tokens >= 1. The tests build both classes with
keyword arguments: keep the constructors' parameter names.
"""
import torch
import torch.nn as nn


class SelfAttention_v1(nn.Module):
    """Scaled dot-product self-attention with raw parameter matrices.

    Parameters: W_query, W_key, W_value, each an nn.Parameter of shape (d_in, d_out), and no others.
    forward(x): x (num_tokens, d_in) -> context vectors (num_tokens, d_out)
    """

    def __init__(self, d_in, d_out):
        super().__init__()
        # TODO: Create W_query, W_key, W_value: trainable (d_in, d_out) matrices drawn with torch.rand, in this order.
        raise NotImplementedError("s05_self_attention: SelfAttention_v1.__init__: see its TODO")

    def forward(self, x):
        # TODO: Project, score every query against every key, scale, softmax, mix the values.
        raise NotImplementedError("s05_self_attention: SelfAttention_v1.forward: see its TODO")


class SelfAttention_v2(nn.Module):
    """Scaled dot-product self-attention with nn.Linear projections.

    Submodules: W_query, W_key, W_value, each nn.Linear(d_in, d_out, bias=qkv_bias);
    their .weight has shape (d_out, d_in), with a bias only when qkv_bias is True. No other parameters.
    forward(x): x (num_tokens, d_in) -> context vectors (num_tokens, d_out)
    """

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        # TODO: Create W_query, W_key, W_value as nn.Linear layers with bias=qkv_bias.
        raise NotImplementedError("s05_self_attention: SelfAttention_v2.__init__: see its TODO")

    def forward(self, x):
        # TODO: Compute what v1 computes, letting the layers do the projections.
        raise NotImplementedError("s05_self_attention: SelfAttention_v2.forward: see its TODO")


def transfer_weights_v2_to_v1(sa_v2, sa_v1):
    """Copy sa_v2's projections into sa_v1 so that both give the same outputs.

    nn.Linear computes x @ weight.T, so v1's matrix is the transpose of v2's weight.
    Modifies sa_v1 in place and returns it.
    """
    # TODO: Copy each transposed Linear weight into the matching v1 parameter.
    raise NotImplementedError("s05_self_attention: transfer_weights_v2_to_v1: see its TODO")
