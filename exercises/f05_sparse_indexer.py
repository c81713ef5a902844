"""Stage f05: sparse attention with a lightning indexer, as DeepSeek Sparse Attention (DeepSeek-V3.2) runs it.

Causal attention costs each query time in proportion to the number of tokens before it: quadratic in the
length of the text. DeepSeek-V3.2 makes each query attend to a fixed number of keys, top_k (2048 in the
model), chosen per query by a small and cheap scorer, the lightning indexer. The indexer has its own
projections: index_heads short query vectors per token (index_dim features each), ONE index key per token
shared by those heads, and a weight per head and token. The index score of query t for key s is

    I[t, s] = sum_j w[t, j] * ReLU(q_idx[t, j] . k_idx[s] / sqrt(index_dim)) / sqrt(index_heads)

(the two constant scales are those of DeepSeek's code; they change no ranking). Each query keeps the top_k
keys with the highest index scores among those it may see (s <= t; all of them while it has no more than
top_k), and the attention itself is the usual one, restricted to those keys. The indexer still looks at every
key, but with few heads, small vectors and (in DeepSeek's kernels) FP8, so it costs a fraction of the attention
it saves. With top_k >= the sequence's length nothing is dropped: it is causal attention.

API
    lightning_index_scores(index_queries, index_keys, head_weights): index_queries (b, n_q, index_heads, index_dim),
        index_keys (b, n_k, index_dim), head_weights (b, n_q, index_heads) -> I (b, n_q, n_k), no mask
    SparseAttention(d_in, d_out, context_length, num_heads, index_heads, index_dim, top_k, qkv_bias=False)
        Chapter 3's W_query, W_key, W_value (bias qkv_bias) and out_proj; the indexer's W_index_query =
        nn.Linear(d_in, index_heads * index_dim), W_index_key = nn.Linear(d_in, index_dim), W_index_weights =
        nn.Linear(d_in, index_heads), no biases.
        index_scores(x) -> (b, T, T): I for every query and key of x, -inf where s > t
        select(x) -> bool (b, T, T): True where key s is among query t's top_k
        forward(x) -> (b, T, d_out): causal multi-head attention over the selected keys only

What the checks test besides: a selection is checked where it is well defined (each query's top_k-th and next index
scores clearly apart); in bfloat16 (the large case, on a GPU when there is one) near-equal index scores may swap, so
there select(x) is judged by its own scores up to bfloat16's rounding and forward(x) against attention over the
learner's own selection; the module runs in the dtype and on the device of its parameters.
"""
import torch
import torch.nn as nn


def lightning_index_scores(index_queries, index_keys, head_weights):
    """I[b, t, s] = sum_j head_weights[b, t, j] * ReLU(index_queries[b, t, j] . index_keys[b, s] / sqrt(index_dim))
    / sqrt(index_heads).   returns (b, n_q, n_k)"""
    # TODO: Every head's dot products with every key (an einsum, or one matmul of (b, n_q * index_heads, index_dim)
    #       by (b, index_dim, n_k)), scaled, ReLU, then the weighted sum over the heads, scaled by 1/sqrt(index_heads).
    raise NotImplementedError("f05_sparse_indexer: lightning_index_scores: see its TODO")


class SparseAttention(nn.Module):
    """Causal multi-head attention where each query attends to the top_k keys its lightning indexer scores
    highest (see the module docstring)."""

    def __init__(self, d_in, d_out, context_length, num_heads, index_heads, index_dim, top_k, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.index_heads, self.index_dim, self.top_k = index_heads, index_dim, top_k
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        # The lightning indexer: index_heads query vectors per token, one key per token, a weight per head.
        self.W_index_query = nn.Linear(d_in, index_heads * index_dim, bias=False)
        self.W_index_key = nn.Linear(d_in, index_dim, bias=False)
        self.W_index_weights = nn.Linear(d_in, index_heads, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)  # True above the diagonal: the future

    def index_scores(self, x):
        """The lightning indexer's scores of x (b, T, d_in): (b, T, T), -inf where the key comes after the query."""
        # TODO: Project x with the three index projections (view the queries as (b, T, index_heads, index_dim)), score
        #       them with lightning_index_scores and mask the future (self.mask cut to T) with -inf.
        raise NotImplementedError("f05_sparse_indexer: SparseAttention.index_scores: see its TODO")

    def select(self, x):
        """Which keys each query attends to: bool (b, T, T), True at the top_k highest index scores of each query
        among the keys it may see (every one of them while it sees no more than top_k)."""
        # TODO: torch.topk along the keys (k = min(top_k, T)) gives each row's best key indices; mark them True in a
        #       boolean tensor (scatter_). A query with fewer than top_k keys before it gets some of its -inf (future)
        #       keys among its "top": keep only the selected keys that are not in the future.
        raise NotImplementedError("f05_sparse_indexer: SparseAttention.select: see its TODO")

    def forward(self, x):
        b, num_tokens, _ = x.shape
        queries, keys, values = (W(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
                                 for W in (self.W_query, self.W_key, self.W_value))  # (b, num_heads, T, head_dim)
        # TODO: Chapter 3's attention, but every key that select(x) did not choose for a query is masked out (-inf) for
        #       that query, in every head; a selection is causal already. Then merge the heads and apply out_proj.
        raise NotImplementedError("f05_sparse_indexer: SparseAttention.forward: see its TODO")
