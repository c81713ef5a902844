"""Stage m02: padding masks and cross-attention.

Chapter 3's attention looks at one sequence of one length at a time. Two things change in practice:

* Padding. A batch holds sequences of different lengths, filled up to the longest with padding tokens.
  A key_padding_mask (b, n_kv) says which keys are real (True) and which are padding (False); no query
  may attend to a padding key, so that a real token's output is the same with or without the padding.
* Cross-attention. The queries come from one sequence x (b, n_q, d_in) and the keys and values from
  another, the context (b, n_kv, d_context): a decoder reading an encoder's output, or text reading
  image features. The score matrix is n_q x n_kv, and only W_key and W_value see the context's width.

A query can be left with nothing to attend to (a sequence that is all padding, or a causal query whose
only earlier keys are left padding). Its softmax row would be 0 / 0 = NaN, which spreads through every
later layer and into the loss. Such a row gets attention weights 0 instead: the query's context vector
is 0 and its output out_proj.bias. (Recent versions of F.scaled_dot_product_attention do the same.)

API
    allowed_keys(n_q, n_kv, key_padding_mask=None, causal=False, device=None): the boolean mask of which keys
        each query may attend to (True = takes part), broadcastable to the scores (b, num_heads, n_q, n_kv).
    masked_attention(queries, keys, values, allowed, dropout): attention over the allowed keys only; a query
        with no allowed key gets the context vector 0.
    CrossAttention(d_in, d_out, num_heads, d_context=None, dropout=0.0, qkv_bias=False)
        W_query = nn.Linear(d_in, d_out, bias=qkv_bias); W_key, W_value = nn.Linear(d_context, d_out,
        bias=qkv_bias) (d_context None: d_in); out_proj = nn.Linear(d_out, d_out); dropout = nn.Dropout(dropout).
    forward(x, context=None, key_padding_mask=None, causal=False) -> (b, n_q, d_out)
        x (b, n_q, d_in): the queries' inputs; context (b, n_kv, d_context): the keys' and values' inputs
        (None: x itself, self-attention); key_padding_mask (b, n_kv) bool, True = a real key that takes part;
        causal: query i attends to keys 0..i only (counted from the start of both sequences, as is_causal
        in F.scaled_dot_product_attention).

Tested: outputs against the reference for any sizes (n_q != n_kv, d_context != d_in), padding on the right or
on the left, causal or not; appending padding tokens (any values) changes no real token's output; a query with
no key to attend to gets out_proj.bias, never NaN; forward(x) and forward(x, context=x) are self-attention; the
module equals nn.MultiheadAttention given key_padding_mask=~mask; dropout on the attention weights in training
mode only; float32, and bfloat16 on the GPU at bf16's tolerance.
"""
import torch
import torch.nn as nn


def allowed_keys(n_q, n_kv, key_padding_mask=None, causal=False, device=None):
    """Which keys each query may attend to: a boolean mask, True = takes part, broadcastable to the scores
    (b, num_heads, n_q, n_kv). key_padding_mask: (b, n_kv) bool, True = a real key, or None."""
    # Start from every query seeing every key (n_q, n_kv). With causal keep only keys j <= i (torch.tril).
    # With a key_padding_mask, keep only real keys: the padding mask is about KEYS, so it masks columns of
    # the scores, the same columns for every head and every query: shape it (b, 1, 1, n_kv) to broadcast.
    ### BEGIN SOLUTION
    allowed = torch.ones(n_q, n_kv, dtype=torch.bool, device=device)  # (n_q, n_kv)
    if causal:
        allowed = torch.tril(allowed)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.bool()[:, None, None, :]  # (b, 1, n_q, n_kv)
    return allowed
    ### END SOLUTION


def masked_attention(queries, keys, values, allowed, dropout):
    """Scaled dot-product attention over the allowed keys only.

    queries (b, num_heads, n_q, head_dim), keys and values (b, num_heads, n_kv, head_dim), allowed: a boolean
    mask broadcastable to (b, num_heads, n_q, n_kv); dropout: an nn.Dropout for the attention weights.
    returns the context vectors (b, num_heads, n_q, head_dim); a query with no allowed key gets 0.
    """
    # Scores scaled by 1/sqrt(head_dim), -inf where not allowed, softmax over the keys. A row with no allowed
    # key is all -inf and its softmax 0/0 = NaN: give such rows attention weights 0 instead. Then dropout on
    # the weights, and the weighted sum of the values.
    ### BEGIN SOLUTION
    attn_scores = queries @ keys.transpose(2, 3) / keys.shape[-1] ** 0.5  # (b, num_heads, n_q, n_kv)
    attn_scores = attn_scores.masked_fill(~allowed, -torch.inf)
    attn_weights = torch.softmax(attn_scores, dim=-1)
    nothing_to_attend = ~allowed.any(dim=-1, keepdim=True)  # (..., n_q, 1)
    attn_weights = attn_weights.masked_fill(nothing_to_attend, 0.0)
    attn_weights = dropout(attn_weights)
    return attn_weights @ values  # (b, num_heads, n_q, head_dim)
    ### END SOLUTION


class CrossAttention(nn.Module):
    """Multi-head attention whose queries come from x and whose keys and values come from a context.

    forward(x, context=None, key_padding_mask=None, causal=False): x (b, n_q, d_in), context (b, n_kv, d_context)
    -> (b, n_q, d_out); see the module's docstring.
    """

    def __init__(self, d_in, d_out, num_heads, d_context=None, dropout=0.0, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        d_context = d_in if d_context is None else d_context
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        # Keys and values describe the context, so they are projected from its width.
        self.W_key = nn.Linear(d_context, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_context, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, t):
        """(b, n, d_out) -> (b, num_heads, n, head_dim), as in chapter 3 (section 3.6.2)."""
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, context=None, key_padding_mask=None, causal=False):
        if context is None:
            context = x  # self-attention: x attends to itself
        b, n_q, _ = x.shape
        n_kv = context.shape[1]
        queries = self.split_heads(self.W_query(x))  # (b, num_heads, n_q, head_dim)
        keys = self.split_heads(self.W_key(context))  # (b, num_heads, n_kv, head_dim)
        values = self.split_heads(self.W_value(context))  # (b, num_heads, n_kv, head_dim)
        allowed = allowed_keys(n_q, n_kv, key_padding_mask, causal, device=x.device)
        context_vec = masked_attention(queries, keys, values, allowed, self.dropout)  # (b, num_heads, n_q, head_dim)
        # Merge the heads back, as in chapter 3: (b, n_q, num_heads, head_dim) -> (b, n_q, d_out).
        context_vec = context_vec.transpose(1, 2).contiguous().view(b, n_q, self.d_out)
        return self.out_proj(context_vec)
