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
        # Create W_query, W_key, W_value: trainable (d_in, d_out) matrices drawn with torch.rand, in this order.
        ### BEGIN SOLUTION
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))
        ### END SOLUTION

    def forward(self, x):
        # Project, score every query against every key, scale, softmax, mix the values.
        ### BEGIN SOLUTION
        queries = x @ self.W_query  # (num_tokens, d_out)
        keys = x @ self.W_key
        values = x @ self.W_value
        attn_scores = queries @ keys.transpose(-2, -1)  # (num_tokens, num_tokens)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values
        ### END SOLUTION


class SelfAttention_v2(nn.Module):
    """Scaled dot-product self-attention with nn.Linear projections.

    Submodules: W_query, W_key, W_value, each nn.Linear(d_in, d_out, bias=qkv_bias);
    their .weight has shape (d_out, d_in), with a bias only when qkv_bias is True. No other parameters.
    forward(x): x (num_tokens, d_in) -> context vectors (num_tokens, d_out)
    """

    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        # Create W_query, W_key, W_value as nn.Linear layers with bias=qkv_bias.
        ### BEGIN SOLUTION
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        ### END SOLUTION

    def forward(self, x):
        # Compute what v1 computes, letting the layers do the projections.
        ### BEGIN SOLUTION
        queries = self.W_query(x)  # (num_tokens, d_out)
        keys = self.W_key(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(-2, -1)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values
        ### END SOLUTION


def transfer_weights_v2_to_v1(sa_v2, sa_v1):
    """Copy sa_v2's projections into sa_v1 so that both give the same outputs.

    nn.Linear computes x @ weight.T, so v1's matrix is the transpose of v2's weight.
    Modifies sa_v1 in place and returns it.
    """
    # Copy each transposed Linear weight into the matching v1 parameter.
    ### BEGIN SOLUTION
    with torch.no_grad():
        sa_v1.W_query.copy_(sa_v2.W_query.weight.T)
        sa_v1.W_key.copy_(sa_v2.W_key.weight.T)
        sa_v1.W_value.copy_(sa_v2.W_value.weight.T)
    return sa_v1
    ### END SOLUTION
