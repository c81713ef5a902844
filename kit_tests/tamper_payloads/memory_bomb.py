"""Stage 6's functions first allocate until the address space runs out, then do their work."""
_simple, _efficient = causal_weights_simple, causal_weights_efficient


def _hoard():
    hoard = []
    while True:  # 256 MiB at a time until the address space runs out (reserved, not written: fast)
        hoard.append(torch.empty(1 << 26))


def causal_weights_simple(attn_weights):
    _hoard()
    return _simple(attn_weights)


def causal_weights_efficient(attn_scores, d_k):
    _hoard()
    return _efficient(attn_scores, d_k)
