"""Demo of stage f01: the two forms of multi-head latent attention agree, and what the cache holds."""
import torch
from f01_latent_attention import MultiHeadLatentAttention, mha_cache_bytes_per_token, mla_cache_bytes_per_token

torch.manual_seed(0)
mla = MultiHeadLatentAttention(d_in=16, d_out=16, context_length=8, num_heads=4, kv_latent_dim=4, rope_dim=2).eval()
x = torch.randn(1, 8, 16)
with torch.no_grad():
    expanded, absorbed = mla(x), mla(x, absorbed=True)
    print("absorbed form equals expanded form:", torch.allclose(expanded, absorbed, atol=1e-5))
    steps = [mla(x[:, :5], use_cache=True, absorbed=True)]
    steps += [mla(x[:, i:i + 1], use_cache=True, absorbed=True) for i in range(5, 8)]
print("cached decoding equals the full forward:", torch.allclose(torch.cat(steps, dim=1), expanded, atol=1e-5))
print("cache_latent", tuple(mla.cache_latent.shape), "cache_k_rope", tuple(mla.cache_k_rope.shape),
      "(b, tokens, width): no head axis")
print("bytes per token, DeepSeek-V3 sizes in bfloat16:")
print(f"  MLA (latent 512 + rotary 64):  {mla_cache_bytes_per_token(512, 64, 61):>9,}")
print(f"  multi-head, 128 heads of 128:  {mha_cache_bytes_per_token(128, 128, 61):>9,}")
print(f"  grouped-query, 8 kv heads:     {mha_cache_bytes_per_token(8, 128, 61):>9,}")
