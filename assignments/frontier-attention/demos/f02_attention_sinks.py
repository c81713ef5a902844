"""Demo of stage f02: a streaming cache that keeps its sink tokens, and how much attention the learned sinks take."""
import torch
from f02_attention_sinks import SinkAttention, sink_window_mask, softmax_with_sinks

positions = torch.arange(8)
print("sink_window_mask(window=3, num_sink_tokens=2), 1 = takes part:")
print(sink_window_mask(positions, positions, window=3, num_sink_tokens=2).int())

scores = torch.tensor([[[[2.0, 1.0, 0.5]], [[2.0, 1.0, 0.5]]]])  # (b, num_heads, n_q, n_k): 2 heads, 1 query
weights = softmax_with_sinks(scores, torch.tensor([-10.0, 2.0]))
print("weights with sink logits -10 and 2:", weights.squeeze().tolist())
print("share left to the sink:", (1 - weights.sum(-1)).squeeze().tolist())

torch.manual_seed(0)
attn = SinkAttention(d_in=8, d_out=8, context_length=64, num_heads=2, window=4, num_sink_tokens=2).eval()
x = torch.randn(1, 64, 8)
with torch.no_grad():
    full = attn(x)
    steps = [attn(x[:, i:i + 1], use_cache=True) for i in range(64)]
print("64 tokens one by one equal the full forward:", torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5))
print("the cache holds positions", attn.cache_positions.tolist(), "- cache_k", tuple(attn.cache_k.shape))
