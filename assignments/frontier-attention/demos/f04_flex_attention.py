"""Demo of stage f04: masks and score changes as two small functions, each checked against a dense computation."""
import warnings

import torch
from f04_flex_attention import alibi_slopes, causal_attention, gemma2_attention, packed_attention

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the CPU's eager path
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
scores = q @ k.transpose(-2, -1) / 2  # scaled by 1/sqrt(head_dim)
i = torch.arange(8)
later = i[None, :] > i[:, None]


def dense(scores, blocked):
    return torch.softmax(scores.masked_fill(blocked, -torch.inf), dim=-1) @ v


print("causal equals the dense computation:",
      torch.allclose(causal_attention(q, k, v), dense(scores, later), atol=1e-6))
capped = 1.0 * torch.tanh(scores / 1.0)
print("soft-capped at 1 equals it too:     ",
      torch.allclose(gemma2_attention(q, k, v, cap=1.0), dense(capped, later), atol=1e-6))
documents = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
other = documents[:, None] != documents[None, :]
print("three packed documents:             ",
      torch.allclose(packed_attention(q, k, v, documents), dense(scores, later | other), atol=1e-6))
print("ALiBi slopes of 8 heads:", alibi_slopes(8).tolist())
print("ALiBi slopes of 6 heads:", alibi_slopes(6).tolist())
