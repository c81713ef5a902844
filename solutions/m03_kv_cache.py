"""Stage m03: a KV cache for generating text token by token.

A language model writes text one token at a time: each new token is appended to the sequence and
the model runs again. Chapter 3's MultiHeadAttention (section 3.6.2) would recompute the keys and
values of every earlier token at every step, although they never change: with a causal mask, a
token's key and value depend on that token alone. A KV cache keeps them. Each step projects only
the NEW tokens (a prompt chunk, then one token at a time), appends their keys and values to the
cache, and lets the new queries attend to everything cached so far.

The new queries are not at positions 0, 1, ... but right after the cached ones: with
cache_length tokens already cached, they sit at positions cache_length, cache_length + 1, ... and
query i may see keys 0 .. cache_length + i. The causal mask is taken at those rows. Done right,
every step gives exactly the rows the full causal forward gives for the same tokens.

API
    MultiHeadAttentionWithCache(d_in, d_out, context_length, num_heads, dropout=0.0, qkv_bias=False)
        Submodules W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=qkv_bias), out_proj =
        nn.Linear(d_out, d_out), dropout = nn.Dropout(dropout); buffer mask (context_length,
        context_length), True above the diagonal (the future).
    forward(x, use_cache=False): x (b, num_new, d_in) -> (b, num_new, d_out).
        use_cache=False: chapter 3's causal forward of x alone; the cache is left as it is.
        use_cache=True: x holds the new tokens only; their keys and values are appended to cache_k and
        cache_v, and their queries attend causally to every cached position. The whole sequence
        (cached and new tokens) must fit in context_length.
    cache_k, cache_v: (b, num_heads, tokens_so_far, head_dim), or None while the cache is empty.
    reset_cache(): empties the cache, before the next sequence.

Tested: every cached step (any chunk lengths, a prompt then single tokens, up to the whole context) equals the
full causal forward's rows for its tokens; cache_k and cache_v hold exactly the keys and values of the tokens fed
so far (b, num_heads, tokens_so_far, head_dim), None on a new module and after reset_cache(); a forward without
use_cache between cached steps changes nothing in the cache; parameters sized from the constructor's arguments;
dropout on the attention weights in training mode only; float32, and bfloat16 (a long prompt, then tokens).
"""
import torch
import torch.nn as nn


class MultiHeadAttentionWithCache(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, dropout=0.0, qkv_bias=False):
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
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1))
        # Start with an empty cache: register cache_k and cache_v as buffers holding None, so that
        # model.to(device) moves them with the weights; persistent=False keeps them out of the state_dict
        # (a cache is the state of one generation, not part of the model).
        ### BEGIN SOLUTION
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        ### END SOLUTION

    def split_heads(self, t):
        """(b, n, d_out) -> (b, num_heads, n, head_dim), as in chapter 3 (section 3.6.2)."""
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, t):
        """(b, num_heads, n, head_dim) -> (b, n, d_out), the inverse of split_heads."""
        b, _, n, _ = t.shape
        # transpose makes the tensor non-contiguous; view needs contiguous memory.
        return t.transpose(1, 2).contiguous().view(b, n, self.d_out)

    def project(self, x):
        """Chapter 3's queries, keys and values of x (b, n, d_in), each (b, num_heads, n, head_dim)."""
        return self.split_heads(self.W_query(x)), self.split_heads(self.W_key(x)), self.split_heads(self.W_value(x))

    def reset_cache(self):
        # Empty the cache (cache_k and cache_v back to None): the next sequence must not see this one's tokens.
        ### BEGIN SOLUTION
        self.cache_k, self.cache_v = None, None
        ### END SOLUTION

    def forward(self, x, use_cache=False):
        queries, keys, values = self.project(x)  # the new tokens' (b, num_heads, num_new, head_dim)

        # With use_cache, append the new keys and values to self.cache_k / self.cache_v along the token
        # axis (torch.cat on dim 2; the first step just stores them), and attend to everything cached:
        # keys, values = the whole cache (b, num_heads, num_keys, head_dim). Without use_cache, attend to
        # the new tokens only (chapter 3's forward) and leave the cache alone.
        ### BEGIN SOLUTION
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys, values
            else:
                self.cache_k = torch.cat([self.cache_k, keys], dim=2)
                self.cache_v = torch.cat([self.cache_v, values], dim=2)
            keys, values = self.cache_k, self.cache_v
        ### END SOLUTION

        # Attend as in chapter 3, but the num_new queries sit at positions start .. num_keys - 1, after the
        # start = num_keys - num_new cached ones: take the causal mask's rows at those positions (and its
        # columns for all num_keys keys), so that query i sees keys 0 .. start + i. Then merge the heads and
        # apply out_proj: return self.out_proj(self.merge_heads(context_vec)).
        ### BEGIN SOLUTION
        num_new, num_keys = queries.shape[2], keys.shape[2]
        start = num_keys - num_new  # the position of the first new token
        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        future = self.mask[start:start + num_new, :num_keys]  # (num_new, num_keys), True = a later position
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values  # (b, num_heads, num_new, head_dim)
        return self.out_proj(self.merge_heads(context_vec))
        ### END SOLUTION
