"""Random inputs and weights: the hidden suites' fresh cases, and the stored fixtures' other shapes.

Randomized cases draw new sizes, inputs and weights at every run; their expected values come
from the reference solutions, run in the trusted process at test time, so memorised or
hard-coded outputs earn nothing. ``random_weights`` is also how ``attnkit fixtures`` draws the
weights it stores.
"""
import numpy as np


def normal(rng, *shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def linear_shapes(name, d_in, d_out, bias=True):
    """The parameter shapes of ``name = nn.Linear(d_in, d_out, bias)``, by their state_dict names."""
    shapes = {f"{name}.weight": (d_out, d_in)}
    if bias:
        shapes[f"{name}.bias"] = (d_out,)
    return shapes


def qkv_shapes(d_in, d_out, bias, prefix=""):
    """W_query, W_key and W_value = nn.Linear(d_in, d_out, bias), their names behind ``prefix``."""
    shapes = {}
    for projection in ("W_query", "W_key", "W_value"):
        shapes.update(linear_shapes(prefix + projection, d_in, d_out, bias))
    return shapes


def mha_shapes(d_in, d_out, bias):
    """MultiHeadAttention's parameters: the three projections (bias: qkv_bias) and out_proj."""
    return {**qkv_shapes(d_in, d_out, bias), **linear_shapes("out_proj", d_out, d_out)}


def spans(chunks):
    """The (first, end) token indices of each chunk, chunks being their lengths: (3, 1) -> (0, 3), (3, 4)."""
    ends = np.cumsum(chunks).tolist()
    return list(zip([0, *ends[:-1]], ends))


def cached_steps(x, chunks):
    """Session steps (adapters.op_session) feeding x's tokens to forward(use_cache=True) chunk by chunk: how
    a KV cache is filled by a prompt and then a token at a time."""
    return [{"method": "forward", "args": [x[:, a:e]], "kwargs": {"use_cache": True}} for a, e in spans(chunks)]


def random_weights(rng, shapes, bound=None):
    """Float32 weights of the given shapes ({state_dict name: shape}), drawn in the order given.

    Each tensor is uniform in +-1/sqrt(fan_in), PyTorch's own initialisation of nn.Linear: a
    weight's fan_in is its last size, a bias takes the fan_in of the weight beside it.
    ``bound`` draws every tensor uniform in +-bound instead.
    """
    weights = {}
    for name, shape in shapes.items():
        if bound is None:
            weight = shapes.get(name.removesuffix(".bias") + ".weight", shape)
            limit = 1 / np.sqrt(weight[-1])
        else:
            limit = bound
        weights[name] = rng.uniform(-limit, limit, size=shape).astype(np.float32)
    return weights


def draw_weights(rng, reference_stage, cls, init):
    """Random weights for every parameter the reference ``cls(**init)`` has, by documented name."""
    return random_weights(rng, reference_stage.inspect(cls, init)["parameters"])


def module_case(rng, reference_stage, cls, *, heads=False, head_dim=False, batch=(1, 4), tokens=(1, 9)):
    """Random constructor arguments, input and weights whose sizes are pairwise distinct (the number of tokens,
    d_in, d_out, and with heads num_heads and each head's width), so that a swapped dimension cannot pass;
    num_tokens <= context_length."""
    while True:
        b = int(rng.integers(*batch, endpoint=True))
        num_tokens = int(rng.integers(*tokens, endpoint=True))
        d_in = int(rng.integers(2, 9))
        init = dict(d_in=d_in, context_length=num_tokens + int(rng.integers(0, 4)), dropout=0.0,
                    qkv_bias=bool(rng.integers(2)))
        if heads:
            init["num_heads"] = int(rng.integers(2 if head_dim else 1, 5))
            per_head = int(rng.integers(1, 4))
            init["d_out"] = init["num_heads"] * per_head if head_dim else per_head
            # (without head_dim, d_out is each head's width: the wrapper's)
            sizes = [num_tokens, d_in, init["num_heads"], per_head] + ([init["d_out"]] if head_dim else [])
        else:
            init["d_out"] = int(rng.integers(1, 7))
            sizes = [num_tokens, d_in, init["d_out"]]
        if len(set(sizes)) == len(sizes):
            break
    x = normal(rng, b, num_tokens, d_in)
    return init, x, draw_weights(rng, reference_stage, cls, init)


def exposing_case(rng, num_heads, num_tokens, batch):
    """A MultiHeadAttention case whose output IS its attention weights, to test dropout by its
    properties: the inputs are one-hot tokens (d_in = num_tokens), every head's values are those
    one-hot vectors (head_dim = num_tokens) and out_proj is the identity, so output[b, i, h*T + j] is
    head h's weight of query i on key j. Queries and keys are random, so the weights differ.
    returns: init (dropout=0.0, qkv_bias=False), x (batch, T, T), MultiHeadAttention state_dict."""
    t = num_tokens
    d_out = num_heads * t
    init = dict(d_in=t, d_out=d_out, context_length=t, dropout=0.0, num_heads=num_heads, qkv_bias=False)
    x = np.broadcast_to(np.eye(t, dtype=np.float32), (batch, t, t)).copy()
    weights = {
        "W_query.weight": normal(rng, d_out, t), "W_key.weight": normal(rng, d_out, t),
        "W_value.weight": np.tile(np.eye(t, dtype=np.float32), (num_heads, 1)),
        "out_proj.weight": np.eye(d_out, dtype=np.float32), "out_proj.bias": np.zeros(d_out, np.float32),
    }
    return init, x, weights


def single_heads(weights, num_heads, prefix="heads."):
    """A MultiHeadAttention state_dict's projections as num_heads single heads (heads.{h}.W_query...):
    head h owns rows h*head_dim .. (h+1)*head_dim - 1 of each projection; out_proj is left out."""
    head_dim = weights["W_query.weight"].shape[0] // num_heads
    return {f"{prefix}{h}.{name}": value[h * head_dim:(h + 1) * head_dim]
            for h in range(num_heads) for name, value in weights.items() if name.startswith("W_")}
