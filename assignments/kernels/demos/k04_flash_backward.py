"""Demo of stage k04: gradients through FlashAttention, the autograd.Function of stages k03 and k04."""
import torch
import torch.nn.functional as F
from k04_flash_backward import flash_attention

torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 20, 6, requires_grad=True) for _ in range(3))
flash_attention(q, k, v, is_causal=True).sum().backward()
ours = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
for name, mine, t in zip(("dq", "dk", "dv"), ours, (q, k, v)):
    print(f"{name} equals SDPA's:", torch.allclose(mine, t.grad, atol=1e-5))
