"""Stage m06: sliding-window attention, as Mistral and Gemma use it in some of their layers.

Causal attention lets token i look at every earlier token: its cost and its KV cache grow with the
whole sequence. A sliding window lets it look at the last ``window`` tokens only, itself included:
key j takes part for query i when j <= i and i - j < window. Information from further back still
arrives, passed on from layer to layer, and the KV cache needs only the last ``window`` positions:
a new token can never attend to anything older, so older keys and values are dropped.

API
    sliding_window_mask(num_tokens, window) -> bool (num_tokens, num_tokens), True where key j takes
        part for query i (the convention of F.scaled_dot_product_attention's boolean attn_mask)
    SlidingWindowAttention(d_in, d_out, context_length, num_heads, window, qkv_bias=False)
        W_query, W_key, W_value = nn.Linear(d_in, d_out, bias=qkv_bias); out_proj = nn.Linear(d_out, d_out);
        buffer band = sliding_window_mask(context_length, window) (True = takes part; chapter 3's mask
        buffer marks the opposite, the future).
        forward(x, use_cache=False): x (b, num_tokens, d_in) -> (b, num_tokens, d_out); with use_cache, x holds
        the new tokens only and cache_k / cache_v (b, num_heads, cached, head_dim; None when empty) keep the
        keys and values of the last ``window`` positions at most; reset_cache() empties them.

Tested: sliding_window_mask exactly (window 1: the token itself; window >= num_tokens: the causal mask); the
buffer band; the full forward against the reference; every cached step (a prompt shorter than the window, single
tokens, a chunk longer than the window) equals the full forward's tokens, while cache_k holds the last
min(window, tokens so far) positions (or window - 1 once a step's new token brings its own) and never more than
window; after reset_cache() cache_k is None; float32, and bfloat16 on the GPU.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def sliding_window_mask(num_tokens, window):
    """True where key j takes part for query i: j <= i (causal) and i - j < window (the query's own
    token counts as one of the window's).   returns: bool (num_tokens, num_tokens)
    """
    # TODO: Compare a column of query positions i with a row of key positions j (broadcasting).
    raise NotImplementedError("m06_sliding_window: sliding_window_mask: see its TODO")


class SlidingWindowAttention(nn.Module):
    """Causal multi-head attention over the last ``window`` tokens, with a bounded KV cache (see the module
    docstring)."""

    def __init__(self, d_in, d_out, context_length, num_heads, window, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert window >= 1, "the window holds at least the query's own token"
        self.d_out, self.num_heads, self.window = d_out, num_heads, window
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        # The band of the whole context; it follows from the arguments, so it is not saved with the weights.
        self.register_buffer("band", sliding_window_mask(context_length, window), persistent=False)
        self.cache_k = self.cache_v = None

    def reset_cache(self):
        self.cache_k = self.cache_v = None

    def forward(self, x, use_cache=False):
        b, num_new, _ = x.shape
        # Project and split into heads, as in chapter 3.
        queries = self.W_query(x).view(b, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        # (b, num_heads, num_new, head_dim) each

        # Without the cache the new tokens are the whole sequence: the band's top-left corner.
        allowed = self.band[:num_new, :num_new]  # (num_new, num_new)

        # TODO: With the cache, put the cached keys/values (the positions right before the new ones) in front,
        #       then keep only the last `window` positions in the cache: no later query can reach older ones.
        #       The new queries are the last num_new of the num_cached + num_new positions: the band is the same
        #       along every diagonal, so their rows are rows num_cached.. of the buffer's top-left corner.
        raise NotImplementedError("m06_sliding_window: SlidingWindowAttention.forward: see its TODO")

        context_vec = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed)  # True = takes part
        context_vec = context_vec.transpose(1, 2).reshape(b, num_new, self.d_out)  # (b, num_new, d_out)
        return self.out_proj(context_vec)
