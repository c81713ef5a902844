"""Stage f07: keys and values shared across layers (cross-layer attention, Gemma 3n, YOCO).

A model's KV cache is per layer: every layer computes and keeps its own keys and values. Grouped-query attention
(m04) and MLA (f01) shrink each layer's share; these models make layers SHARE: a layer that does not compute keys
and values attends to those of an earlier layer, and only the layers that compute them are cached.

* Cross-Layer Attention (Brandon et al., "Reducing Transformer Key-Value Cache Size with Cross-Layer Attention",
  2024): layers in groups of share_every; the first of each group computes keys and values, the others reuse them.
* Gemma 3n: the last num_shared layers compute none; they reuse those of the last layer before them.
* YOCO ("You Only Cache Once", Sun et al., 2024) is the extreme: the second half of the model reads one set of keys
  and values, made once from the first half's output.

A layer that reuses keys and values has no W_key and W_value at all, and nothing of it is cached. Its queries
still come from its own input, so it still computes something of its own; but the keys it attends to were made
from an earlier layer's input. This is not weight sharing: applying the earlier layer's W_key to this layer's
input would be another model (and need its own cache). Here a layer is attention with a residual connection,
h <- h + attention(h), so that each layer's input differs (a transformer block also has norms and an MLP).

API
    cla_kv_sources(num_layers, share_every) -> list: layer l reads the keys and values of layer kv_sources[l]
    shared_tail_kv_sources(num_layers, num_shared) -> list (num_shared < num_layers)
        (a layer whose source is itself computes its own; a source is never a later layer, nor a reusing one)
    cache_bytes_per_token(kv_sources, num_kv_heads, head_dim, bytes_per_element=2): what the cache grows by per token
    CrossLayerKVStack(d_model, context_length, num_heads, kv_sources, num_kv_groups=None)
        layers: nn.ModuleList of SharedKVAttention: W_query = nn.Linear(d_model, d_model, bias=False), out_proj =
        nn.Linear(d_model, d_model), and (only where kv_sources[l] == l) W_key, W_value = nn.Linear(d_model,
        num_kv_groups * head_dim, bias=False): state_dict names layers.{l}.W_query.weight ...
        forward(x, use_cache=False): (b, T, d_model) -> (b, T, d_model), causal, h <- h + layers[l](h, ...) for each l.
        With use_cache, x holds the new tokens only; cache_k and cache_v are lists with one (b, num_kv_groups,
        tokens_so_far, head_dim) tensor per layer that computes keys and values, in layer order (empty when nothing
        is cached); reset_cache() empties them.

What the checks test besides: a reusing layer has no W_key or W_value parameter at all; every cached step equals the
full forward's rows, also after reset_cache(); the module runs in the dtype and on the device of its parameters (the
large case in bfloat16, on a GPU when there is one, at a tolerance of 0.1 for four residual adds in bfloat16).
"""
import torch
import torch.nn as nn


def cla_kv_sources(num_layers, share_every):
    """Cross-Layer Attention: layers in groups of share_every, each reading the keys and values of its group's
    first layer. cla_kv_sources(6, 2) = [0, 0, 2, 2, 4, 4]."""
    # TODO: Layer l's group starts at l - l % share_every.
    raise NotImplementedError("f07_cross_layer_kv: cla_kv_sources: see its TODO")


def shared_tail_kv_sources(num_layers, num_shared):
    """Gemma 3n's sharing: the last num_shared layers read the keys and values of the last layer before them, the
    others their own. shared_tail_kv_sources(6, 2) = [0, 1, 2, 3, 3, 3]."""
    # TODO: The first num_layers - num_shared layers read their own; the rest read the last of those.
    #       The first num_layers - num_shared layers read their own; the rest read the last of those.
    raise NotImplementedError("f07_cross_layer_kv: shared_tail_kv_sources: see its TODO")


def cache_bytes_per_token(kv_sources, num_kv_heads, head_dim, bytes_per_element=2):
    """The bytes the KV cache grows by per token: a key and a value of num_kv_heads heads for each layer that
    computes its own (the others keep nothing)."""
    # TODO: Count the layers whose source is themselves.
    #       Count the layers whose source is themselves.
    raise NotImplementedError("f07_cross_layer_kv: cache_bytes_per_token: see its TODO")


class SharedKVAttention(nn.Module):
    """One layer: grouped-query causal attention (stage m04) whose keys and values may come from another layer."""

    def __init__(self, d_model, num_heads, num_kv_groups, computes_kv):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.head_dim = d_model // num_heads
        self.W_query = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model)
        # TODO: Only a layer that computes keys and values has W_key and W_value = nn.Linear(d_model, num_kv_groups *
        #       head_dim, bias=False): a layer that reuses another's has none (no parameters, nothing to load).
        raise NotImplementedError("f07_cross_layer_kv: SharedKVAttention.__init__: see its TODO")

    def heads(self, t, n):
        b, num_tokens, _ = t.shape
        return t.view(b, num_tokens, n, self.head_dim).transpose(1, 2)  # (b, n, T, head_dim)

    def project_kv(self, h):
        """This layer's keys and values of its input h: (b, num_kv_groups, T, head_dim) each."""
        return self.heads(self.W_key(h), self.num_kv_groups), self.heads(self.W_value(h), self.num_kv_groups)

    def forward(self, h, keys, values):
        """Attention of h's new tokens (b, num_new, d_model) over keys and values (b, num_kv_groups, num_keys,
        head_dim), the new tokens being the last num_new of the num_keys positions."""
        queries = self.heads(self.W_query(h), self.num_heads)  # (b, num_heads, num_new, head_dim)
        group = self.num_heads // self.num_kv_groups
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        num_new, num_keys = queries.shape[2], keys.shape[2]
        future = torch.ones(num_new, num_keys, dtype=torch.bool, device=h.device).triu(num_keys - num_new + 1)
        scores = (queries @ keys.transpose(2, 3)).masked_fill(future, -torch.inf) / self.head_dim**0.5
        context_vec = (torch.softmax(scores, dim=-1) @ values).transpose(1, 2).reshape(h.shape)
        return self.out_proj(context_vec)


class CrossLayerKVStack(nn.Module):
    """Attention layers with a residual stream, sharing keys and values as kv_sources says (see the module
    docstring)."""

    def __init__(self, d_model, context_length, num_heads, kv_sources, num_kv_groups=None):
        super().__init__()
        num_kv_groups = num_heads if num_kv_groups is None else num_kv_groups
        assert d_model % num_heads == 0 and num_heads % num_kv_groups == 0
        for layer, source in enumerate(kv_sources):
            assert source <= layer and kv_sources[source] == source, (
                f"layer {layer} reads the keys and values of layer {source}, which does not compute its own")
        self.kv_sources = list(kv_sources)
        self.context_length = context_length
        self.layers = nn.ModuleList(SharedKVAttention(d_model, num_heads, num_kv_groups, source == layer)
                                    for layer, source in enumerate(kv_sources))
        self.cache_k, self.cache_v = [], []

    def reset_cache(self):
        self.cache_k, self.cache_v = [], []

    def forward(self, x, use_cache=False):
        # TODO: The residual stream h starts as x. Layer by layer: a layer that computes keys and values (kv_sources[l]
        #       == l) projects its input h (project_kv); with use_cache it appends them to its entry in cache_k and
        #       cache_v (one entry per computing layer, in layer order: the first step creates them) and attends to all
        #       it has cached. A layer that reuses attends to its source's keys and values (the cached ones included).
        #       Then h = h + layer(h, keys, values); return h.
        raise NotImplementedError("f07_cross_layer_kv: CrossLayerKVStack.forward: see its TODO")
