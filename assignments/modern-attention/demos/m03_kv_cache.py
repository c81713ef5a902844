"""Demo of stage m03: a KV cache for generation, on a small example."""
import torch
from m03_kv_cache import MultiHeadAttentionWithCache

torch.manual_seed(0)
attn = MultiHeadAttentionWithCache(d_in=4, d_out=8, context_length=8, num_heads=2).eval()
x = torch.randn(1, 6, 4)
with torch.no_grad():
    full = attn(x)
    steps = [attn(x[:, :3], use_cache=True)]  # the prompt
    for i in range(3, 6):  # then one token at a time
        steps.append(attn(x[:, i:i + 1], use_cache=True))
        print(f"after token {i}: cache_k {tuple(attn.cache_k.shape)} (b, num_heads, tokens_so_far, head_dim)")
print("cached decoding equals the full forward:", torch.allclose(full, torch.cat(steps, dim=1), atol=1e-6))
attn.reset_cache()
print("after reset_cache():", attn.cache_k)
