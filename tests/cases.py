"""Randomized cases for the hidden suites: fresh sizes, inputs and weights at every run.

Expected values come from the reference solutions, run in the trusted process at
test time, so memorised or hard-coded outputs earn nothing here.
"""
import numpy as np


def normal(rng, *shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


def draw_weights(rng, reference_stage, cls, init):
    """Random weights for every parameter the reference ``cls(**init)`` has, by documented name.

    Each tensor is uniform in +-1/sqrt(fan_in), like PyTorch's own initialisation.
    """
    shapes = reference_stage.inspect(cls, init)["parameters"]
    weights = {}
    for name, shape in shapes.items():
        fan_in = shape[-1] if len(shape) > 1 else shapes.get(name.replace(".bias", ".weight"), [1, 1])[-1]
        bound = 1 / np.sqrt(fan_in)
        weights[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return weights


def module_case(rng, reference_stage, cls, *, heads=False, head_dim=False, batch=(1, 4), tokens=(1, 9)):
    """Random constructor arguments (d_in != d_out, num_tokens <= context_length), input and weights."""
    b = int(rng.integers(*batch, endpoint=True))
    num_tokens = int(rng.integers(*tokens, endpoint=True))
    context_length = num_tokens + int(rng.integers(0, 4))
    d_in = int(rng.integers(2, 9))
    init = dict(d_in=d_in, context_length=context_length, dropout=0.0, qkv_bias=bool(rng.integers(2)))
    if heads:
        init["num_heads"] = int(rng.integers(1, 5))
        per_head = int(rng.integers(1, 4))
        init["d_out"] = init["num_heads"] * per_head if head_dim else per_head
    else:
        init["d_out"] = int(rng.integers(1, 7))
    if init["d_out"] == d_in:  # keep d_in != d_out so that a swapped shape cannot pass
        init["d_in"] = d_in = d_in + 1
    x = normal(rng, b, num_tokens, d_in)
    return init, x, draw_weights(rng, reference_stage, cls, init)
