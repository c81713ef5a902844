"""Demo of stage m05: rotary position embeddings (RoPE), on a small example."""
import torch
from m05_rotary_embeddings import RoPEAttention, apply_rope, rope_angles

torch.manual_seed(0)
cos, sin = rope_angles(head_dim=8, context_length=64)
q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
for m in (3, 13, 53):  # a query 3 positions after its key: the same score wherever the pair sits
    score = (apply_rope(q, cos, sin, offset=m) * apply_rope(k, cos, sin, offset=m - 3)).sum()
    print(f"query at {m}, key at {m - 3}: score {score.item():.5f}")
attn = RoPEAttention(d_in=4, d_out=8, context_length=16, num_heads=2, num_kv_groups=1).eval()
x = torch.randn(1, 5, 4)
with torch.no_grad():
    full = attn(x)
    steps = torch.cat([attn(x[:, :3], use_cache=True), attn(x[:, 3:4], use_cache=True),
                       attn(x[:, 4:], use_cache=True)], dim=1)
print("cached decoding equals the full forward:", torch.allclose(full, steps, atol=1e-6))
