"""Demo of stage m02: padding masks and cross-attention, on a small example."""
import torch
from m02_padding_and_cross import CrossAttention

torch.manual_seed(123)
attn = CrossAttention(d_in=3, d_out=4, num_heads=2, d_context=5).eval()
x = torch.rand(2, 4, 3)  # 4 query tokens
context = torch.rand(2, 6, 5)  # 6 context tokens
real = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])  # the second context has 3 padding tokens
with torch.no_grad():
    out = attn(x, context, key_padding_mask=real)
    alone = attn(x[1:], context[1:, :3])  # the second example without its padding
    print(out.shape, "padding changes nothing:", torch.allclose(out[1:], alone, atol=1e-6))
    nothing = attn(x, context, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    print("all padding gives out_proj.bias:", torch.allclose(nothing, attn.out_proj.bias.expand_as(nothing)))
