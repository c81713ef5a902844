"""The kernels assignment's reference kernels compile for real GPUs, without one.

Triton's interpreter (what the suite runs here) accepts programs its compiler rejects, and knows nothing of a GPU's
limits. Triton compiles for a target it is given, and ptxas (bundled with Triton) needs no GPU either: so each kernel
is compiled here exactly as its CUDA case and speed check launch it (its tile sizes, its dtypes), through Triton's
whole pipeline down to a cubin, for an H100 (sm_90) and, in float32 where tiles are largest, an A100 (sm_80); each
must fit the shared memory of one block of that card. (Found this way: 64 x 64 float32 tiles of k03 need 177 KiB,
more than an A100 has; its CUDA case uses 64 x 32.) Loading and launching them needs a GPU: benchmarks/
kernels_gpu_check.sh.
"""
import json
import os
import subprocess
import sys

import pytest

from grader.kit import KIT

pytest.importorskip("triton", reason="the kernels assignment needs Triton: pip install -e '.[kernels]'")

SHARED = {80: 166912, 90: 232448}  # bytes of shared memory one block may use: A100, H100
# name, module, kernel, pointer arguments (and their element type when not the inputs'), float arguments, constexprs
KERNELS = [
    ("softmax", "k01_fused_softmax", "softmax_kernel", {"x_ptr": None, "out_ptr": None}, (), {"BLOCK_SIZE": 1024}),
    ("weights 64x32", "k02_tiled_scores", "weights_kernel", {"Q": None, "K": None, "P": None}, ("scale",),
     {"IS_CAUSAL": True, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 128}),
    ("forward 64x32", "k03_flash_forward", "attention_kernel",
     {"Q": None, "K": None, "V": None, "Out": None, "LSE": "fp32"}, ("scale",),
     {"IS_CAUSAL": True, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_D": 128}),
    ("dkdv 16x16", "k04_flash_backward", "dkdv_kernel",
     {"Q": None, "K": None, "V": None, "DO": None, "LSE": "fp32", "DELTA": "fp32", "DK": None, "DV": None},
     ("scale",), {"IS_CAUSAL": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 128}),
    ("dq 16x16", "k04_flash_backward", "dq_kernel",
     {"Q": None, "K": None, "V": None, "DO": None, "LSE": "fp32", "DELTA": "fp32", "DQ": None},
     ("scale",), {"IS_CAUSAL": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 128}),
    ("split", "k05_flash_decoding", "split_kernel", {"Q": None, "K": None, "V": None, "PO": "fp32", "PLSE": "fp32"},
     ("scale",), {"NUM_SPLITS": 16, "BLOCK_N": 64, "BLOCK_D": 128}),
    ("combine", "k05_flash_decoding", "combine_kernel", {"PO": "fp32", "PLSE": "fp32", "Out": "fp32", "LSE": "fp32"},
     (), {"NUM_SPLITS": 16, "BLOCK_S": 16, "BLOCK_D": 128}),
    ("paged", "k06_paged_decoding", "paged_kernel", {"Q": None, "K_POOL": None, "V_POOL": None, "TABLES": "i32",
                                                     "LENS": "i32", "PO": "fp32", "PLSE": "fp32"},
     ("scale",), {"NUM_SPLITS": 8, "PAGE": 16, "BLOCK_D": 128}),
]
TARGETS = [(90, "fp32"), (90, "bf16"), (80, "fp32")]

COMPILE = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

found = []
for name, module, kernel, pointers, floats, constexprs, arch, dtype in json.loads(sys.argv[2]):
    fn = getattr(importlib.import_module(module), kernel)
    signature = {a: "constexpr" if a in constexprs else "*" + (pointers[a] or dtype) if a in pointers
                 else "fp32" if a in floats else "i32" for a in fn.arg_names}
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))
        found.append([name, arch, dtype, compiled.metadata.shared, len(compiled.asm["cubin"]), None])
    except Exception as exc:
        found.append([name, arch, dtype, None, None, f"{type(exc).__name__}: {exc}"[:500]])
print(json.dumps(found))
"""


@pytest.mark.timeout(600)  # (compiles every kernel for two GPUs: 21 s idle, minutes on a loaded machine)
def test_every_reference_kernel_compiles_for_an_h100_and_an_a100(tmp_path):
    jobs = [[*kernel, arch, dtype] for kernel in KERNELS for arch, dtype in TARGETS
            if not (kernel[0] == "combine" and dtype == "bf16")]
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1",
               HOME=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", COMPILE, str(KIT / "solutions"), json.dumps(jobs)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    failed = [r for r in results if r[5] is not None]
    assert not failed, failed
    too_big = [(name, f"sm_{arch}", dtype, shared) for name, arch, dtype, shared, _, _ in results
               if shared > SHARED[arch]]
    assert not too_big, f"more shared memory than one block of the card has: {too_big}"
    assert all(size > 0 for *_, size, _ in results)
