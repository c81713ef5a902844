"""Demo of stage k06: decoding two sequences of different lengths from a shared pool of blocks."""
import torch
import torch.nn.functional as F
from k06_paged_decoding import paged_decode

torch.manual_seed(0)
k_pool, v_pool = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 4, 8)  # 6 blocks of 4 slots, 2 heads of 8
block_tables = torch.tensor([[4, 0, 5, 2], [3, 1, 0, 0]])  # sequence 0: 4 blocks; sequence 1: 2
seq_lens = torch.tensor([13, 6])
q = torch.randn(2, 2, 8)
out = paged_decode(q, k_pool, v_pool, block_tables, seq_lens, num_splits=2)
print("one token per sequence:", tuple(out.shape))
for r, n in enumerate(seq_lens.tolist()):
    blocks = block_tables[r, :-(-n // 4)]
    keys, values = (pool[blocks].transpose(0, 1).reshape(2, -1, 8)[:, :n] for pool in (k_pool, v_pool))
    print(f"sequence {r} ({n} tokens) equals SDPA on its gathered blocks:",
          torch.allclose(out[r], F.scaled_dot_product_attention(q[r][:, None], keys, values)[:, 0], atol=1e-5))
