"""[attnkit-tamper] exec_matrix -- family (e), memory held outside the stage's process.

The whole of an m07 module: ``tiled_attention`` computes the full score matrix in a fresh ``python -I``
process (NumPy; no memory ceiling there, since RLIMIT_AS is a byte count and a fresh interpreter holds
little), handing the tensors over through a pipe. Expected: the fresh process cannot be started (the
learner's filter denies fork and exec), so every check that calls it fails with that message.
"""
import subprocess
import sys

import numpy as np
import torch

_PROGRAM = """
import sys, numpy as np
q, k, v = (np.load(sys.stdin.buffer) for _ in range(3))
causal = bool(int(sys.argv[1]))
s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
if causal:
    t = s.shape[-1]
    s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
w = np.exp(s - s.max(-1, keepdims=True))
np.save(sys.stdout.buffer, (w / w.sum(-1, keepdims=True)) @ v)
"""


def tiled_attention(q, k, v, is_causal=False, block_size=64):
    import io

    data = io.BytesIO()
    for tensor in (q, k, v):
        np.save(data, tensor.detach().double().numpy())
    done = subprocess.run([sys.executable, "-I", "-c", _PROGRAM, str(int(is_causal))], input=data.getvalue(),
                          capture_output=True, check=True)
    return torch.from_numpy(np.load(io.BytesIO(done.stdout))).to(q.dtype)
