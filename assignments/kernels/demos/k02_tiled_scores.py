"""Demo of stage k02: attention weights tile by tile, the causal tiles above the diagonal skipped."""
import torch
from k02_tiled_scores import attention_weights

torch.manual_seed(0)
q, k = torch.randn(1, 2, 20, 6), torch.randn(1, 2, 20, 6)
weights = attention_weights(q, k, is_causal=True)
expected = torch.softmax((q @ k.transpose(-1, -2) / 6 ** 0.5).masked_fill(
    torch.ones(20, 20, dtype=torch.bool).triu(1), -torch.inf), dim=-1)
print("causal weights of 20 tokens in tiles of 16:", tuple(weights.shape))
print("equal to the masked softmax:", torch.allclose(weights, expected, atol=1e-6))
print("exactly 0 above the diagonal:", bool((weights.triu(1) == 0).all()))
