"""Demo of stage f05: which keys each query keeps, and sparse attention equal to causal attention at full top_k."""
import torch
from f05_sparse_indexer import SparseAttention

torch.manual_seed(0)
attn = SparseAttention(d_in=8, d_out=8, context_length=10, num_heads=2, index_heads=4, index_dim=4, top_k=3).eval()
x = torch.randn(1, 10, 8)
with torch.no_grad():
    print("keys kept by each query (1 = attended), top_k = 3:")
    print(attn.select(x)[0].int())
    sparse = attn(x)
    attn.top_k = 10  # every key: causal attention
    dense = attn(x)
    print("rows 0-2 (fewer than 3 keys before them) are the same in both:", torch.allclose(sparse[:, :3], dense[:, :3]))
    print("later rows differ:", not torch.allclose(sparse[:, 3:], dense[:, 3:]))
