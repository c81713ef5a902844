"""Demo of stage m07: attention tile by tile: the online softmax of FlashAttention, on a small example."""
import torch
import torch.nn.functional as F
from m07_tiled_attention import tiled_attention

torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
out = tiled_attention(q, k, v, is_causal=True, block_size=4)
print(out.shape)
print("equals F.scaled_dot_product_attention:",
      torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
print("finite with scores in the thousands:", torch.isfinite(tiled_attention(q * 1e3, k, v)).all().item())
