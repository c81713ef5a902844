"""Demo of stage s07: dropout on the attention weights, on a small example."""
import torch
from s07_dropout import attention_dropout, dropout_by_hand

torch.manual_seed(123)
ones = torch.ones(6, 6)
print("training mode:\n", attention_dropout(ones, 0.5, training=True))
print("eval mode:\n", attention_dropout(ones, 0.5, training=False))
print("by hand:\n", dropout_by_hand(ones, 0.5))
