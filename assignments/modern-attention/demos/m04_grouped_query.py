"""Demo of stage m04: grouped-query attention, on a small example."""
import torch
from m04_grouped_query import GroupedQueryAttention

print("repeat:           ", torch.arange(2).repeat(2))
print("repeat_interleave:", torch.arange(2).repeat_interleave(2))
for num_kv_groups in (4, 2, 1):
    attn = GroupedQueryAttention(d_in=8, d_out=8, context_length=6, num_heads=4, num_kv_groups=num_kv_groups).eval()
    with torch.no_grad():
        out = attn(torch.randn(1, 6, 8), use_cache=True)
    params = sum(p.numel() for p in attn.parameters())
    print(f"num_kv_groups={num_kv_groups}: {params} parameters, cache_k {tuple(attn.cache_k.shape)}, "
          f"output {tuple(out.shape)}")
