"""Demo of stage f07: which layer reads whose keys and values, and what that saves in the cache."""
import torch
from f07_cross_layer_kv import CrossLayerKVStack, cache_bytes_per_token, cla_kv_sources, shared_tail_kv_sources

print("Cross-Layer Attention, 8 layers in pairs:  ", cla_kv_sources(8, 2))
print("Gemma 3n style, the last 3 of 8 layers share:", shared_tail_kv_sources(8, 3))
gemma3n = shared_tail_kv_sources(35, 15)
unshared, shared = cache_bytes_per_token(list(range(35)), 2, 256), cache_bytes_per_token(gemma3n, 2, 256)
print(f"bytes per token, 35 layers, 2 kv heads of 256, bfloat16: {unshared:,} unshared, {shared:,} shared")

torch.manual_seed(0)
stack = CrossLayerKVStack(d_model=16, context_length=12, num_heads=4, kv_sources=cla_kv_sources(4, 2)).eval()
print("layers with W_key:", [layer for layer, module in enumerate(stack.layers) if hasattr(module, "W_key")])
x = torch.randn(1, 12, 16)
with torch.no_grad():
    full = stack(x)
    steps = [stack(x[:, :8], use_cache=True)] + [stack(x[:, i:i + 1], use_cache=True) for i in range(8, 12)]
print("cached decoding equals the full forward:", torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5))
print("cache_k holds", len(stack.cache_k), "tensors for 4 layers:", [tuple(k.shape) for k in stack.cache_k])
