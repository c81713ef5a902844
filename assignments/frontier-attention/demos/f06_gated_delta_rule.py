"""Demo of stage f06: the recurrent and chunked forms agree, and the cache is a state of fixed size."""
import torch
import torch.nn.functional as F
from f06_gated_delta_rule import GatedDeltaNet, gated_delta_rule_chunked, gated_delta_rule_recurrent

torch.manual_seed(0)
b, h, t, d = 1, 2, 50, 8
q, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
k = F.normalize(torch.randn(b, h, t, d), dim=-1)  # unit keys: each write corrects, never inflates
g = F.logsigmoid(torch.randn(b, h, t) + 3)  # keep about 95 % of the state per token
beta = torch.sigmoid(torch.randn(b, h, t))
out, state = gated_delta_rule_recurrent(q, k, v, g, beta)
for chunk_size in (1, 16, 64):
    chunked, chunked_state = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=chunk_size)
    print(f"chunks of {chunk_size:2}: equal to the recurrent form:", torch.allclose(chunked, out, atol=1e-5),
          torch.allclose(chunked_state, state, atol=1e-5))

layer = GatedDeltaNet(d_in=16, d_out=16, num_heads=2).eval()
x = torch.randn(1, 300, 16)
with torch.no_grad():
    layer(x[:, :10], use_cache=True)
    print("state after 10 tokens: ", tuple(layer.state.shape))
    layer(x[:, 10:], use_cache=True, chunk_size=64)
    print("state after 300 tokens:", tuple(layer.state.shape), "(b, heads, d_k, d_v): the same size")
