"""Demo of stage k05: one query against 30 cached keys, split in 3, combined by their log-sum-exps."""
import torch
import torch.nn.functional as F
from k05_flash_decoding import flash_decode, split_partials

torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
partial_o, partial_lse = split_partials(q, k, v, num_splits=3)
print("each split's lse:", [round(x, 3) for x in partial_lse[0, 0].tolist()])
print("combined equals SDPA:", torch.allclose(flash_decode(q, k, v, num_splits=3),
                                              F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0], atol=1e-5))
