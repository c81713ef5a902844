"""Demo of stage f03: sequences sharing one pool of blocks, and blocks reused after a sequence ends."""
import torch
from f03_paged_kv_cache import PagedAttention

torch.manual_seed(0)
attn = PagedAttention(d_in=8, d_out=8, num_heads=2, num_blocks=4, block_size=4).eval()  # a tight pool
a, b, c = torch.randn(1, 7, 8), torch.randn(1, 5, 8), torch.randn(1, 6, 8)
with torch.no_grad():
    attn(a, seq_ids=[0])  # a prompt of 7 tokens: 2 blocks
    attn(b, seq_ids=[1])  # 5 tokens: 2 more blocks
    print("tables:", {s: attn.block_table(s) for s in (0, 1)}, "- blocks in use:", attn.blocks_in_use())
    step = attn(torch.cat([a[:, :1], b[:, :1]]), seq_ids=[0, 1])  # one more token for each, in one forward
    print("one token each:", tuple(step.shape), "- tables:", {s: attn.block_table(s) for s in (0, 1)})
    attn.free(1)
    print("after free(1): free blocks", attn.free_blocks)
    out = attn(c, seq_ids=[2])
    print("sequence 2 reuses them:", attn.block_table(2))
    alone = PagedAttention(d_in=8, d_out=8, num_heads=2, num_blocks=2, block_size=4).eval()
    alone.load_state_dict(attn.state_dict())
    print("equal to a fresh cache:", torch.allclose(out, alone(c, seq_ids=[0]), atol=1e-6))
