"""Demo of stage s08: causal attention, batched, on a small example."""
import torch
from s01_attention_scores import inputs
from s08_causal_attention import CausalAttention

batch = torch.stack((inputs, inputs))  # two copies of the sentence: (2, 6, 3)
torch.manual_seed(123)
ca = CausalAttention(3, 2, context_length=6, dropout=0.0)
out = ca(batch)
print(out.shape)
print(out)
