"""Demo of stage s05: self-attention as a module, on a small example."""
import torch
from s01_attention_scores import inputs
from s05_self_attention import SelfAttention_v1, SelfAttention_v2, transfer_weights_v2_to_v1

torch.manual_seed(789)
sa_v2 = SelfAttention_v2(3, 2)
print("v2:\n", sa_v2(inputs))
sa_v1 = transfer_weights_v2_to_v1(sa_v2, SelfAttention_v1(3, 2))
print("v1 with v2's weights:\n", sa_v1(inputs))
