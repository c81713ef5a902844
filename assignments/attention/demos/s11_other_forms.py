"""Demo of stage s11: two other shapes of the same idea, on a small example."""
import torch
from s01_attention_scores import inputs
from s10_multihead_attention import MultiHeadAttention
from s11_other_forms import (
    MultiHeadAttentionCombinedQKV,
    MultiHeadAttentionPerHead,
    combined_qkv_state_dict,
    per_head_state_dict,
)

batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttention(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
fused = MultiHeadAttentionCombinedQKV(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
fused.load_state_dict(combined_qkv_state_dict(mha.state_dict()), strict=False)
per_head = MultiHeadAttentionPerHead(3, 4, context_length=6, dropout=0.0, num_heads=2).eval()
per_head.load_state_dict(per_head_state_dict(mha.state_dict(), 2), strict=False)
with torch.no_grad():
    print("fused QKV, largest difference:", (fused(batch) - mha(batch)).abs().max().item())
    print("per-head, largest difference:", (per_head(batch) - mha(batch)).abs().max().item())
