"""Stage m04: grouped-query attention (GQA).

During generation the KV cache of stage m03 grows by num_heads keys and values per token and layer;
for long texts it outgrows the weights. Grouped-query attention keeps num_heads query heads but gives
keys and values only num_kv_groups heads: the query heads form num_kv_groups groups of group_size =
num_heads // num_kv_groups consecutive heads, and the heads of a group share one key head and one value
head. W_key and W_value shrink to num_kv_groups * head_dim outputs, and so does the cache: group_size
times smaller than multi-head attention's. Llama 3 8B, for one, has 32 query heads and 8 key/value heads.

The two ends of the range are familiar: num_kv_groups == num_heads is chapter 3's multi-head attention
(section 3.6.2), and num_kv_groups == 1 is multi-query attention (every query head shares one key/value
head).

To attend, each key/value head is repeated for the query heads of its group, consecutively: query head h
uses key/value head h // group_size (torch.repeat_interleave, as Llama and Hugging Face's repeat_kv do).
The cache keeps the num_kv_groups heads; they are expanded after it, so the memory saving stays.

API
    GroupedQueryAttention(d_in, d_out, context_length, num_heads, num_kv_groups, dropout=0.0, qkv_bias=False)
        head_dim = d_out // num_heads. Submodules W_query = nn.Linear(d_in, d_out, bias=qkv_bias);
        W_key, W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=qkv_bias); out_proj =
        nn.Linear(d_out, d_out); dropout = nn.Dropout(dropout); buffer mask (context_length,
        context_length), True above the diagonal (the future).
    forward(x, use_cache=False): x (b, num_new, d_in) -> (b, num_new, d_out), causal; the KV cache API of
        stage m03: with use_cache, x holds the new tokens only, their keys and values are appended to
        cache_k and cache_v, and the new queries attend to every cached position.
    cache_k, cache_v: (b, num_kv_groups, tokens_so_far, head_dim), or None while the cache is empty.
    reset_cache(): empties the cache.

Tested: the full forward and every cached step against the reference for any num_heads and num_kv_groups that
divides it (multi-head and multi-query attention included); query head h uses kv head h // group_size; the cache
holds the num_kv_groups heads, not expanded ones; W_key and W_value are num_heads / num_kv_groups times smaller
than multi-head attention's; float32, and bfloat16 (a long prompt, then tokens).
"""
import torch
import torch.nn as nn


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, num_kv_groups, dropout=0.0, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.d_out = d_out
        self.num_heads = num_heads
        self.num_kv_groups = num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups  # query heads per key/value head
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        # TODO: Keys and values get num_kv_groups heads of head_dim features each (not num_heads):
        #       W_key and W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=qkv_bias).
        raise NotImplementedError("m04_grouped_query: GroupedQueryAttention.__init__: see its TODO")
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1))
        self.register_buffer("cache_k", None, persistent=False)  # as in stage m03
        self.register_buffer("cache_v", None, persistent=False)

    def split_heads(self, t, num_heads):
        """(b, n, num_heads * head_dim) -> (b, num_heads, n, head_dim), as in chapter 3 (section 3.6.2)."""
        b, n, _ = t.shape
        return t.view(b, n, num_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, t):
        """(b, num_heads, n, head_dim) -> (b, n, d_out), the inverse of split_heads."""
        b, _, n, _ = t.shape
        return t.transpose(1, 2).contiguous().view(b, n, self.d_out)

    def project_kv(self, x):
        """The keys and values of x (b, n, d_in), each (b, num_kv_groups, n, head_dim)."""
        # TODO: Project x with W_key and W_value and split each result into num_kv_groups heads; return both.
        raise NotImplementedError("m04_grouped_query: GroupedQueryAttention.project_kv: see its TODO")

    def update_cache(self, keys, values):
        """Stage m03's cache: append the new keys and values, return everything cached."""
        if self.cache_k is None:
            self.cache_k, self.cache_v = keys, values
        else:
            self.cache_k = torch.cat([self.cache_k, keys], dim=2)
            self.cache_v = torch.cat([self.cache_v, values], dim=2)
        return self.cache_k, self.cache_v

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None

    def forward(self, x, use_cache=False):
        num_new = x.shape[1]
        queries = self.split_heads(self.W_query(x), self.num_heads)  # (b, num_heads, num_new, head_dim)
        keys, values = self.project_kv(x)  # (b, num_kv_groups, num_new, head_dim)
        if use_cache:
            # The cache holds the num_kv_groups heads: group_size times smaller than multi-head attention's.
            keys, values = self.update_cache(keys, values)  # (b, num_kv_groups, num_keys, head_dim)

        # TODO: Give every query head its group's key and value head: repeat each of the num_kv_groups heads
        #       group_size times in a row along the head axis, so that query head h meets kv head h // group_size
        #       (heads 0..group_size-1 share kv head 0, and so on). keys, values: (b, num_heads, num_keys, head_dim).
        raise NotImplementedError("m04_grouped_query: GroupedQueryAttention.forward: see its TODO")

        # From here on it is stage m03's attention: the new queries sit at positions start .. num_keys - 1.
        num_keys = keys.shape[2]
        start = num_keys - num_new
        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, num_new, num_keys)
        future = self.mask[start:start + num_new, :num_keys]  # (num_new, num_keys), True = a later position
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = attn_weights @ values  # (b, num_heads, num_new, head_dim)
        return self.out_proj(self.merge_heads(context_vec))
