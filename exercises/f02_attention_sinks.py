"""Stage f02: attention sinks, StreamingLLM's cache and gpt-oss's learned sink logits.

Softmax makes every query spend all of its attention somewhere: the weights of a row add up to 1. Trained
models learn to park what they do not need on the first tokens of the text, which then get large weights
whatever they say: attention sinks (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", StreamingLLM). Two consequences, one stage each half:

* A sliding window (stage m06) that drops the first tokens removes the sinks and the model breaks down.
  StreamingLLM keeps them: its cache holds the first num_sink_tokens tokens for good, plus the last
  ``window`` ones. Query i attends to key j when j <= i and (j < num_sink_tokens or i - j < window), and the
  cache never holds more than num_sink_tokens + window positions however long the text.

* gpt-oss gives the model a sink to park attention on without spending a token: a learned logit per head,
  ``sinks[h]``, that takes part in the softmax's denominator and mixes no value. The weights of a row add up to
  less than 1 (to 0 when every key is masked: no NaN), the rest is attention paid to nothing.

    weights[..., j] = exp(scores[..., j]) / (sum_k exp(scores[..., k]) + exp(sinks[h]))

computed, like any softmax, after subtracting the row's maximum, here of the scores AND the sink logit.

API
    sink_window_mask(query_positions, key_positions, window=None, num_sink_tokens=0) -> bool (n_q, n_k), True where
        key j takes part for query i (F.scaled_dot_product_attention's convention); window None: no window.
    softmax_with_sinks(scores, sinks): scores (b, num_heads, n_q, n_k), -inf where masked; sinks (num_heads,)
        -> weights of the same shape as scores.
    SinkAttention(d_in, d_out, context_length, num_heads, num_kv_groups=None, window=None, num_sink_tokens=0,
                  qkv_bias=False)
        W_query = nn.Linear(d_in, d_out), W_key and W_value = nn.Linear(d_in, num_kv_groups * head_dim) (bias
        qkv_bias; stage m04's grouped heads), out_proj = nn.Linear(d_out, d_out), sinks = nn.Parameter of
        (num_heads,) logits. forward(x, use_cache=False): x (b, num_new, d_in) -> (b, num_new, d_out), attention
        under sink_window_mask with softmax_with_sinks. With use_cache, x holds the new tokens only; cache_k and
        cache_v (b, num_kv_groups, kept, head_dim) keep at most num_sink_tokens + window positions (every one when
        window is None), cache_positions (kept,) their positions; reset_cache() empties them.

What the checks test besides: softmax_with_sinks gives weights 0 (not NaN) to a row whose every key is masked, with a
sink and without one (-inf), and does not overflow for logits in the hundreds; every cached step equals the full
forward's rows; the cache never holds more than num_sink_tokens + window positions; every size comes from the
constructor's arguments; the module runs in the dtype and on the device of its parameters (the large case in
bfloat16, on a GPU when there is one, at bfloat16's tolerance).
"""
import torch
import torch.nn as nn


def sink_window_mask(query_positions, key_positions, window=None, num_sink_tokens=0):
    """True where key j takes part for query i: j <= i (causal) and, when there is a window, j is one of the first
    num_sink_tokens tokens or among the last ``window`` (i - j < window, the query's own token included).

    query_positions (n_q,), key_positions (n_k,): integer positions in the text.   returns: bool (n_q, n_k)
    """
    # TODO: Compare a column of query positions with a row of key positions (broadcasting).
    raise NotImplementedError("f02_attention_sinks: sink_window_mask: see its TODO")


def softmax_with_sinks(scores, sinks):
    """softmax over the last axis with one more logit per head, sinks[h], that mixes no value.

    scores: (b, num_heads, n_q, n_k), -inf where a key is masked; sinks: (num_heads,)
    returns: weights, the shape of scores; each row sums to 1 - (the sink's share), 0 where every key is masked
    """
    # TODO: The sink logit joins every row of its head (view it as (num_heads, 1, 1) to broadcast). Subtract the larger
    #       of the row's max score and the sink logit before exp (no overflow; that max is finite as long as the sink
    #       logit is); divide each exp(score - max) by the sum over the row plus exp(sink - max). A sink logit of -inf
    #       (no sink) with every key masked leaves nothing finite: give that row weights 0, not 0/0.
    raise NotImplementedError("f02_attention_sinks: softmax_with_sinks: see its TODO")


class SinkAttention(nn.Module):
    """Causal grouped-query attention with learned sink logits and, with a window, StreamingLLM's cache of sink
    tokens plus the last window positions (see the module docstring)."""

    def __init__(self, d_in, d_out, context_length, num_heads, num_kv_groups=None, window=None, num_sink_tokens=0,
                 qkv_bias=False):
        super().__init__()
        num_kv_groups = num_heads if num_kv_groups is None else num_kv_groups
        assert d_out % num_heads == 0 and num_heads % num_kv_groups == 0
        assert window is None or window >= 1, "the window holds at least the query's own token"
        self.d_out, self.num_heads, self.num_kv_groups = d_out, num_heads, num_kv_groups
        self.head_dim, self.group_size = d_out // num_heads, num_heads // num_kv_groups
        self.window, self.num_sink_tokens = window, num_sink_tokens
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        # One learned logit per head, as gpt-oss's `sinks` (trained like any weight; 0 here until loaded).
        self.sinks = nn.Parameter(torch.zeros(num_heads))
        self.cache_k = self.cache_v = self.cache_positions = None

    def reset_cache(self):
        self.cache_k = self.cache_v = self.cache_positions = None

    def split_heads(self, t, heads):
        b, n, _ = t.shape
        return t.view(b, n, heads, self.head_dim).transpose(1, 2)  # (b, heads, n, head_dim)

    def forward(self, x, use_cache=False):
        b, num_new, _ = x.shape
        queries = self.split_heads(self.W_query(x), self.num_heads)  # (b, num_heads, num_new, head_dim)
        keys = self.split_heads(self.W_key(x), self.num_kv_groups)  # (b, num_kv_groups, num_new, head_dim)
        values = self.split_heads(self.W_value(x), self.num_kv_groups)
        query_positions = torch.arange(num_new, device=x.device)  # without the cache the sequence starts at 0
        key_positions = query_positions

        # TODO: With use_cache the new tokens come right after the newest cached position: shift query_positions there.
        #       Put the cached keys, values and positions in front of the new ones (attend to all of them), then keep in
        #       the cache only what a later query can still see: the first num_sink_tokens positions and the last
        #       `window` (newest position - p < window); every position when window is None.
        raise NotImplementedError("f02_attention_sinks: SinkAttention.forward: see its TODO")

        keys = keys.repeat_interleave(self.group_size, dim=1)  # (b, num_heads, num_keys, head_dim): stage m04
        values = values.repeat_interleave(self.group_size, dim=1)
        context_vec = self.attend(queries, keys, values, query_positions, key_positions)
        return self.out_proj(context_vec.transpose(1, 2).reshape(b, num_new, self.d_out))  # heads merged

    def attend(self, queries, keys, values, query_positions, key_positions):
        """queries (b, num_heads, num_new, head_dim) at query_positions (num_new,) attend to keys and values
        (b, num_heads, num_keys, head_dim) at key_positions (num_keys,).  returns (b, num_heads, num_new, head_dim)"""
        # TODO: Scores scaled by 1/sqrt(head_dim), -inf where sink_window_mask forbids, weights by softmax_with_sinks
        #       with self.sinks (the sink logit is a logit of its own: it is not scaled); mix the values.
        raise NotImplementedError("f02_attention_sinks: SinkAttention.attend: see its TODO")
