"""Stage f01: multi-head latent attention (MLA), as DeepSeek-V2 and DeepSeek-V3 run it.

A KV cache (stage m03) keeps, for every token and layer, a key and a value per head: 2 * num_heads *
head_dim numbers. Grouped-query attention (m04) shrinks that by sharing key/value heads. MLA goes
further: each token's keys and values for ALL heads are made from one small vector, the latent
c = kv_norm(W_kv_down(x)) of kv_latent_dim numbers, by two up-projections, W_key_up and W_value_up.
The cache holds the latent, not the keys and values: DeepSeek-V3 caches 512 + 64 numbers per token
and layer where multi-head attention with its 128 heads of 128 would cache 32768.

Position needs care. RoPE (m05) rotates keys by their position, and a rotated key is no longer a
fixed linear function of the latent. So MLA keeps position out of the latent ("decoupled RoPE"): each
head's query has head_dim content features and rope_dim rotary features, and every head shares ONE
rotary key of rope_dim features per token, W_key_rope(x) rotated at the token's position, cached
beside the latent. A score is then content . content + rope . rope, over head_dim + rope_dim
products, so it is scaled by 1 / sqrt(head_dim + rope_dim).

The absorbed form. Head h's content score of query q with a cached token is
q . (W_uk[h] c) = (W_uk[h]^T q) . c, and its output W_uv[h] (sum_j a_j c_j) is a product with the
mixed latents: W_key_up can be multiplied into the query and W_value_up applied after the mix. Then
attention runs on the latents themselves and no per-head key or value is ever made for the cached
tokens: that is how MLA decodes. Both forms give the same output.

API
    MultiHeadLatentAttention(d_in, d_out, context_length, num_heads, kv_latent_dim, rope_dim, theta_base=10_000.0)
        head_dim = d_out // num_heads. Submodules (no biases but out_proj's):
        W_query = nn.Linear(d_in, num_heads * (head_dim + rope_dim)): per head, head_dim content features
            then rope_dim rotary ones;
        W_kv_down = nn.Linear(d_in, kv_latent_dim); kv_norm = RMSNorm(kv_latent_dim): the latent;
        W_key_rope = nn.Linear(d_in, rope_dim): the rotary key, one for all heads;
        W_key_up, W_value_up = nn.Linear(kv_latent_dim, d_out): the latent to each head's content key and value
            (rows h*head_dim .. (h+1)*head_dim - 1 for head h);
        out_proj = nn.Linear(d_out, d_out).
        forward(x, use_cache=False, absorbed=False): x (b, num_new, d_in) -> (b, num_new, d_out), causal, RoPE
            in Llama's halves layout on the rotary parts; absorbed chooses the form. With use_cache, x holds the
            new tokens only, their positions continue after the cached ones.
        cache_latent (b, tokens_so_far, kv_latent_dim), cache_k_rope (b, tokens_so_far, rope_dim): the cache,
            None when empty (the rotary keys cached already rotated); reset_cache() empties it.
    mla_cache_bytes_per_token(kv_latent_dim, rope_dim, num_layers, bytes_per_element=2)
    mha_cache_bytes_per_token(num_kv_heads, head_dim, num_layers, bytes_per_element=2): a cache of keys and values
        (multi-head attention: num_kv_heads = num_heads; grouped-query: num_kv_groups)

What the checks test besides: each form on its own (absorbed=False and absorbed=True are graded separately);
decoding one token in the absorbed form makes no tensor as large as the cached tokens' per-head keys (W_key_up and
W_value_up never meet the cached latents); every size comes from the constructor's arguments (the cases use
head_dim, kv_latent_dim, rope_dim, num_heads and the token count all different); the module runs in the dtype and on
the device of its parameters: the large case runs in bfloat16 (on a GPU when there is one), compared with a float32
computation at bfloat16's tolerance, so make new tensors with x's dtype and device.
"""
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32 (as DeepSeek's and Llama's RMSNorm)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_angles(head_dim, context_length, theta_base=10_000.0):
    """Stage m05's cos and sin of every position, (context_length, head_dim) each, in the halves layout."""
    inv_freq = theta_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.arange(context_length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin, offset=0):
    """Stage m05's rotation of x (..., num_tokens, head_dim) at positions offset, offset + 1, ..."""
    num_tokens = x.shape[-2]
    cos = cos[offset:offset + num_tokens].to(x.dtype)
    sin = sin[offset:offset + num_tokens].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention with decoupled RoPE and a latent KV cache (see the module docstring)."""

    def __init__(self, d_in, d_out, context_length, num_heads, kv_latent_dim, rope_dim, theta_base=10_000.0):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        assert rope_dim % 2 == 0, "rope_dim must be even: RoPE rotates pairs of features"
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.kv_latent_dim, self.rope_dim = kv_latent_dim, rope_dim
        self.W_query = nn.Linear(d_in, num_heads * (self.head_dim + rope_dim), bias=False)
        # TODO: The keys' and values' side: the latent (a down-projection, then kv_norm), the one rotary key shared by
        #       every head, and the two up-projections from the latent to each head's content key and value.
        raise NotImplementedError("f01_latent_attention: MultiHeadLatentAttention.__init__: see its TODO")
        self.out_proj = nn.Linear(d_out, d_out)
        # True above the diagonal: the future. It and the rotation tables follow from the arguments.
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length, dtype=torch.bool), 1),
                             persistent=False)
        cos, sin = rope_angles(rope_dim, context_length, theta_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.cache_latent = self.cache_k_rope = None

    def reset_cache(self):
        self.cache_latent = self.cache_k_rope = None

    def split_heads(self, t):
        """(b, n, num_heads * width) -> (b, num_heads, n, width), as in chapter 3 (section 3.6.2)."""
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, -1).transpose(1, 2)

    def causal_mask(self, num_new, num_keys):
        """The rows of the causal mask for num_new queries that come last of num_keys positions."""
        return self.mask[num_keys - num_new:num_keys, :num_keys]  # (num_new, num_keys), True = the future

    def compress(self, x):
        """What the cache keeps of the new tokens x (b, num_new, d_in): their latents (b, num_new, kv_latent_dim)
        and their rotary keys (b, num_new, rope_dim), not yet rotated."""
        # TODO: The latent is the down-projection W_kv_down(x), normalised by kv_norm; the rotary key is W_key_rope(x).
        raise NotImplementedError("f01_latent_attention: MultiHeadLatentAttention.compress: see its TODO")

    def forward(self, x, use_cache=False, absorbed=False):
        b, num_new, _ = x.shape
        queries = self.split_heads(self.W_query(x))  # (b, num_heads, num_new, head_dim + rope_dim)
        q_content, q_rope = queries.split([self.head_dim, self.rope_dim], dim=-1)

        latent, k_rope = self.compress(x)  # (b, num_new, kv_latent_dim), (b, num_new, rope_dim)

        # TODO: Rotate q_rope and the rotary keys k_rope at the new tokens' positions: they start after the cached
        #       tokens with use_cache (at 0 without). With use_cache, append latent and k_rope to cache_latent and
        #       cache_k_rope (torch.cat along the token axis, dim 1) and go on with everything cached.
        raise NotImplementedError("f01_latent_attention: MultiHeadLatentAttention.forward: see its TODO")

        attend = self.attend_absorbed if absorbed else self.attend_expanded
        context_vec = attend(q_content, q_rope, latent, k_rope)  # (b, num_heads, num_new, head_dim)
        context_vec = context_vec.transpose(1, 2).reshape(b, num_new, self.d_out)  # merge the heads
        return self.out_proj(context_vec)

    def attend_expanded(self, q_content, q_rope, latent, k_rope):
        """The naive form: expand the latents into every head's keys and values, then attend as usual.

        q_content (b, num_heads, num_new, head_dim), q_rope (b, num_heads, num_new, rope_dim), latent
        (b, num_keys, kv_latent_dim), k_rope (b, num_keys, rope_dim), rotated.
        returns (b, num_heads, num_new, head_dim)
        """
        # TODO: Content keys and values: W_key_up and W_value_up of the latents, split into heads (b, num_heads,
        #       num_keys, head_dim). A score adds the content part q_content . keys and the rotary part q_rope . k_rope
        #       (one rotary key for every head: broadcast it over the head axis) and is scaled by
        #       1 / sqrt(head_dim + rope_dim), the number of products it sums. Causal mask at the new queries' rows
        #       (self.causal_mask), softmax, mix the values.
        raise NotImplementedError("f01_latent_attention: MultiHeadLatentAttention.attend_expanded: see its TODO")

    def attend_absorbed(self, q_content, q_rope, latent, k_rope):
        """The absorbed form: attention over the latents themselves, the same arguments and result as
        attend_expanded, without making any head's key or value for the cached tokens."""
        # TODO: Head h's content key of a token is W_uk[h] @ latent, W_uk[h] = rows h*head_dim..(h+1)*head_dim - 1 of
        #       W_key_up.weight: (head_dim, kv_latent_dim). Its score q . (W_uk[h] latent) is (W_uk[h]^T q) . latent:
        #       move the query into the latent space (b, num_heads, num_new, kv_latent_dim), score it against the
        #       latents, add the rotary part, scale, mask and softmax as in attend_expanded. Mix the LATENTS with the
        #       weights, then apply head h's W_uv[h] (W_value_up.weight's rows of head h) to get its context vectors.
        raise NotImplementedError("f01_latent_attention: MultiHeadLatentAttention.attend_absorbed: see its TODO")


def mla_cache_bytes_per_token(kv_latent_dim, rope_dim, num_layers, bytes_per_element=2):
    """The bytes MLA's cache grows by per token: each layer keeps one latent and one rotary key."""
    # TODO: Per layer and token: kv_latent_dim + rope_dim numbers, whatever the number of heads.
    raise NotImplementedError("f01_latent_attention: mla_cache_bytes_per_token: see its TODO")


def mha_cache_bytes_per_token(num_kv_heads, head_dim, num_layers, bytes_per_element=2):
    """The bytes a cache of keys and values grows by per token (m03, m04): num_kv_heads key heads and as many
    value heads per layer (num_heads for multi-head attention, num_kv_groups for grouped-query attention)."""
    # TODO: Per layer and token: a key and a value of head_dim numbers for each of the num_kv_heads heads.
    raise NotImplementedError("f01_latent_attention: mha_cache_bytes_per_token: see its TODO")
