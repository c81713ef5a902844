"""Demo of stage m06: sliding-window attention, on a small example."""
import torch
from m06_sliding_window import SlidingWindowAttention, sliding_window_mask

print(sliding_window_mask(6, 3).int())
torch.manual_seed(0)
attn = SlidingWindowAttention(d_in=4, d_out=8, context_length=12, num_heads=2, window=3).eval()
x = torch.randn(1, 10, 4)
with torch.no_grad():
    full = attn(x)
    steps = [attn(x[:, :2], use_cache=True)]
    for i in range(2, 10):
        steps.append(attn(x[:, i:i + 1], use_cache=True))
print("cache_k after 10 tokens:", tuple(attn.cache_k.shape), "(b, num_heads, window, head_dim)")
print("cached decoding equals the full forward:", torch.allclose(full, torch.cat(steps, dim=1), atol=1e-6))
