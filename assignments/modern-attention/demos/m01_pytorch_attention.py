"""Demo of stage m01: pyTorch's own attention, on a small example."""
import torch
from m01_pytorch_attention import MultiHeadAttention, sdpa_attention, torch_mha_forward

torch.manual_seed(123)
mha = MultiHeadAttention(d_in=4, d_out=4, context_length=6, dropout=0.0, num_heads=2).eval()
x = torch.rand(2, 6, 4)
with torch.no_grad():
    by_hand = mha(x)
    print("SDPA, is_causal:", torch.allclose(sdpa_attention(mha, x), by_hand, atol=1e-6))
    print("SDPA, attn_mask:", torch.allclose(sdpa_attention(mha, x, use_mask=True), by_hand, atol=1e-6))
    print("nn.MultiheadAttention:", torch.allclose(torch_mha_forward(mha, x), by_hand, atol=1e-6))
    print(sdpa_attention(mha, x)[0])
