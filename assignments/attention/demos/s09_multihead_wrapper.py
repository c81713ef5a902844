"""Demo of stage s09: several heads, side by side, on a small example."""
import torch
from s01_attention_scores import inputs
from s09_multihead_wrapper import MultiHeadAttentionWrapper

batch = torch.stack((inputs, inputs))
torch.manual_seed(123)
mha = MultiHeadAttentionWrapper(3, 2, context_length=6, dropout=0.0, num_heads=2)
out = mha(batch)
print(out.shape)
print(out)
