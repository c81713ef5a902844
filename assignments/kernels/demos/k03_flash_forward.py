"""Demo of stage k03: FlashAttention-2's forward, its output and its log-sum-exp per row."""
import torch
import torch.nn.functional as F
from k03_flash_forward import flash_attention_forward

torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 20, 6), torch.randn(1, 2, 20, 6), torch.randn(1, 2, 20, 6)
o, lse = flash_attention_forward(q, k, v, is_causal=True)
print("o:", tuple(o.shape), "lse:", tuple(lse.shape))
print("equals F.scaled_dot_product_attention:",
      torch.allclose(o, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
scores = (q @ k.transpose(-1, -2) / 6 ** 0.5).masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), -torch.inf)
print("lse equals torch.logsumexp:", torch.allclose(lse, torch.logsumexp(scores, dim=-1), atol=1e-5))
