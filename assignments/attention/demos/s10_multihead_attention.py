"""Demo of stage s10: multi-head attention with weight splits, on a small example."""
import torch
from s01_attention_scores import inputs
from s10_multihead_attention import MultiHeadAttention, batched_head_scores, per_head_scores_loop

a = torch.rand(1, 2, 3, 4)  # (batch, heads, tokens, head_dim)
print("batched equals loop:", torch.allclose(batched_head_scores(a), per_head_scores_loop(a)))
batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttention(3, 2, context_length=6, dropout=0.0, num_heads=2)
out = mha(batch)
print(out.shape)
print(out)
