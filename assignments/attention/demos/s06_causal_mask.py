"""Demo of stage s06: hiding the future, on a small example."""
import torch
from s01_attention_scores import inputs
from s06_causal_mask import causal_weights_efficient, causal_weights_simple

scores = inputs @ inputs.T
print("simple:\n", causal_weights_simple(torch.softmax(scores, dim=-1)))
print("efficient:\n", causal_weights_efficient(scores, d_k=inputs.shape[-1]))
