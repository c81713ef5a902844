"""Stage m05: rotary position embeddings (RoPE), as Llama uses them.

Chapter 3's attention cannot tell where a token is: permute the tokens and each one's context
vector stays the same up to the permutation (chapter 2, section 2.8, adds absolute position
embeddings to the inputs for that). RoPE instead ROTATES each query and key by an angle that grows
with the token's position. A head's vector is split into pairs of features; pair i turns at
frequency inv_freq[i] = theta_base ** (-2i / head_dim), so the first pairs spin fast and the last
ones slowly. Because rotations compose, the score of query m with key n,
rot(q, m) . rot(k, n) = q . rot(k, n - m), depends on the two positions only through m - n: the
model sees relative positions, at any distance. Values are not rotated: they carry content, not
position.

Layout: the "halves" layout of Hugging Face's Llama (``rotate_half``) pairs feature i with feature
i + head_dim/2 (the original RoFormer code pairs neighbours 2i and 2i + 1 instead; both are RoPE, but
weights trained for one layout give other results in the other).

API
    rope_angles(head_dim, context_length, theta_base=10_000.0) -> (cos, sin), each (context_length, head_dim)
    apply_rope(x, cos, sin, offset=0): x (b, heads, num_tokens, head_dim) at positions offset..offset+num_tokens-1
    RoPEAttention(d_in, d_out, context_length, num_heads, num_kv_groups=None, qkv_bias=False, theta_base=10_000.0)
        W_query = nn.Linear(d_in, d_out, bias=qkv_bias); W_key, W_value = nn.Linear(d_in, num_kv_groups * head_dim,
        bias=qkv_bias); out_proj = nn.Linear(d_out, d_out). Causal grouped-query attention (num_kv_groups=None:
        one key/value head per query head) with RoPE on queries and keys, and stage m03's KV cache:
        forward(x, use_cache=False), reset_cache(), cache_k / cache_v (b, num_kv_groups, tokens_so_far, head_dim)
        holding keys already rotated at their positions, None when empty.

Tested: rope_angles against NumPy for any even head_dim, context_length and theta_base (float32; at positions
near 50_000 to 1e-2); apply_rope against NumPy at any offset, keeping x's dtype (a float64 x stays float64), every
vector's length, and scores that depend on the distance m - n alone; RoPEAttention's full forward and cached
steps against the reference (the positions of a cached step continue after the cached tokens; after
reset_cache() they start at 0 again; forward(x) without the cache starts at position 0 whatever the cache
holds); the values are not rotated; float32, and bfloat16 on the GPU.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_angles(head_dim, context_length, theta_base=10_000.0):
    """cos and sin of the rotation angles of positions 0..context_length-1, in the halves layout.

    Column i and column i + head_dim/2 hold the same angle, position * inv_freq[i], because
    ``apply_rope`` rotates feature i together with feature i + head_dim/2.
    returns: cos, sin, each (context_length, head_dim), float32
    """
    assert head_dim % 2 == 0, "head_dim must be even: RoPE rotates pairs of features"
    # TODO: One frequency per pair, inv_freq = theta_base ** (-arange(0, head_dim, 2) / head_dim); the angle
    #       of pair i at position p is p * inv_freq[i]; duplicate the angles, cat([freqs, freqs]), so both
    #       halves of the head see them.
    raise NotImplementedError("m05_rotary_embeddings: rope_angles: see its TODO")


def apply_rope(x, cos, sin, offset=0):
    """x rotated at positions offset, offset + 1, ... (one per token).

    x: (b, heads, num_tokens, head_dim); cos, sin: (context_length, head_dim) from ``rope_angles``,
    with offset + num_tokens <= context_length.   returns: the same shape and dtype as x
    """
    # TODO: Take the rows of cos and sin for this chunk's positions. Pair i is (x[i], x[i + head_dim/2]):
    #       rotating it by angle a gives (x[i] cos a - x[i + head_dim/2] sin a, x[i + head_dim/2] cos a + x[i] sin a),
    #       i.e. x * cos + rotate_half(x) * sin with rotate_half(x) = cat([-second half, first half]).
    raise NotImplementedError("m05_rotary_embeddings: apply_rope: see its TODO")


class RoPEAttention(nn.Module):
    """Causal grouped-query attention with rotary position embeddings and a KV cache (see the module docstring)."""

    def __init__(self, d_in, d_out, context_length, num_heads, num_kv_groups=None, qkv_bias=False,
                 theta_base=10_000.0):
        super().__init__()
        num_kv_groups = num_heads if num_kv_groups is None else num_kv_groups
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.d_out, self.num_heads, self.num_kv_groups = d_out, num_heads, num_kv_groups
        self.head_dim = d_out // num_heads
        self.group_size = num_heads // num_kv_groups  # query heads per key/value head
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        # True above the diagonal: the future, which no query may see. Derived from the arguments,
        # so not saved with the weights (persistent=False).
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)
        # TODO: Compute the rotation angles of every position once (rope_angles) and keep them as buffers
        #       named cos and sin (persistent=False: they follow from the arguments, like the mask).
        raise NotImplementedError("m05_rotary_embeddings: RoPEAttention.__init__: see its TODO")
        self.cache_k = self.cache_v = None

    def reset_cache(self):
        self.cache_k = self.cache_v = None

    def forward(self, x, use_cache=False):
        b, num_new, _ = x.shape
        # Project and split into heads, as in chapter 3 (fewer heads for keys and values: stage m04).
        queries = self.W_query(x).view(b, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, num_new, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_new, self.num_kv_groups, self.head_dim).transpose(1, 2)
        # queries: (b, num_heads, num_new, head_dim); keys, values: (b, num_kv_groups, num_new, head_dim)

        # TODO: The new tokens' positions start after those already cached (0 without the cache). Rotate the
        #       queries and the keys at those positions; leave the values as they are.
        raise NotImplementedError("m05_rotary_embeddings: RoPEAttention.forward: see its TODO")

        # The cache keeps keys already rotated: a key's angle depends on its own position only.
        if use_cache:
            if self.cache_k is not None:
                keys = torch.cat([self.cache_k, keys], dim=2)
                values = torch.cat([self.cache_v, values], dim=2)
            self.cache_k, self.cache_v = keys, values
        num_keys = keys.shape[2]
        # Query head h uses key/value head h // group_size (stage m04).
        keys = keys.repeat_interleave(self.group_size, dim=1)  # (b, num_heads, num_keys, head_dim)
        values = values.repeat_interleave(self.group_size, dim=1)

        # The new queries are positions num_keys - num_new .. num_keys - 1: their rows of the causal mask.
        future = self.mask[num_keys - num_new:num_keys, :num_keys]  # (num_new, num_keys)
        context_vec = F.scaled_dot_product_attention(queries, keys, values, attn_mask=~future)  # True = takes part
        context_vec = context_vec.transpose(1, 2).reshape(b, num_new, self.d_out)  # (b, num_new, d_out)
        return self.out_proj(context_vec)
