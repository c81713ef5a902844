"""The kernels assignment's reference FlashAttention-2 (solutions/k03, k04) against PyTorch's SDPA and naive attention.

    python benchmarks/bench_kernels.py                           # CUDA: T 1k..16k, causal and not, fwd and bwd
    python benchmarks/bench_kernels.py --device cpu --quick      # the same logic at tiny sizes, Triton's interpreter

Three ways of computing attention on the same bfloat16 inputs (b=1, 16 heads of 128; --heads, --dim):

    triton   the reference kernels of stages k03 (forward) and k04 (backward, through its autograd.Function)
    sdpa     F.scaled_dot_product_attention (on a GPU, PyTorch's FlashAttention or memory-efficient kernels)
    naive    softmax(q k^T / sqrt(d)) v in three torch calls (the T x T matrix held; at 16k tokens 8 GiB of scores)

The outputs are compared before timing (max |difference| relative to the largest value, below 3e-2 in bfloat16).
Each figure is the median of Triton's triton.testing.do_bench (its own warm-up and repetitions, CUDA events) on a GPU;
on the CPU, of --repeat perf_counter timings after --warmup untimed calls (meaningless as speed: the interpreter). A
way that runs out of memory is shown as "OOM". Writes a Markdown table (with the card's name) to stdout, and to
--out as well; exits 0 unless a way's output is wrong.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
TOKENS = (1024, 2048, 4096, 8192, 16384)
QUICK = (32, 48)
TOLERANCE = 3e-2  # max |difference| / max |value| in bfloat16


def load(stage: str):
    """A reference stage module, from solutions/ (on sys.path: k04 imports k03 by name)."""
    sys.path.insert(0, str(KIT / "solutions"))
    spec = importlib.util.spec_from_file_location(stage, KIT / "solutions" / f"{stage}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[stage] = module
    spec.loader.exec_module(module)
    return module


def naive(q, k, v, causal):
    import torch

    s = (q @ k.transpose(-1, -2)).float() / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    return (torch.softmax(s, dim=-1).to(q.dtype) @ v)


def median_ms(fn, device: str, warmup: int, repeat: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(args) -> tuple[list[dict], list[str]]:
    import torch
    import torch.nn.functional as F

    load("k03_flash_forward")  # (k04 imports it by name)
    backward = load("k04_flash_backward")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # (the interpreter's tl.dot: float32 only)
    ways = {
        "triton": lambda q, k, v, c: backward.flash_attention(q, k, v, c),
        "sdpa": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
        "naive": naive,
    }
    rows, problems = [], []
    for tokens in (QUICK if args.quick else TOKENS):
        for causal in (False, True):
            gen = torch.Generator(device="cpu").manual_seed(tokens)
            q, k, v, do = (torch.randn(1, args.heads, tokens, args.dim, generator=gen).to(device, dtype)
                           for _ in range(4))
            reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            row = {"tokens": tokens, "causal": causal}
            for name, way in ways.items():
                try:
                    out = way(q, k, v, causal)
                    error = float((out.float() - reference).abs().max() / reference.abs().max())
                    if error > TOLERANCE:
                        problems.append(f"{name} at T={tokens}, causal={causal}: relative error {error:.3g}")
                    row[f"{name} fwd"] = median_ms(lambda w=way, a=(q, k, v, causal): w(*a), args.device,
                                                   args.warmup, args.repeat)
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                    def step(w=way, leaves=leaves, causal=causal, do=do):
                        torch.autograd.grad(w(*leaves, causal), leaves, do)

                    row[f"{name} fwd+bwd"] = median_ms(step, args.device, args.warmup, args.repeat)
                except torch.OutOfMemoryError:
                    row[f"{name} fwd"] = row.setdefault(f"{name} fwd", "OOM")
                    row[f"{name} fwd+bwd"] = "OOM"
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows, problems


def table(rows: list[dict], card: str, args) -> str:
    columns = [c for c in rows[0] if c not in ("tokens", "causal")]
    lines = [f"Attention kernels on {card} ({'bfloat16' if args.device == 'cuda' else 'float32'}, b=1, "
             f"{args.heads} heads of {args.dim}), milliseconds (medians):", "",
             "| T | causal | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append(f"| {row['tokens']} | {'yes' if row['causal'] else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the CPU: Triton's interpreter)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (and .json beside it)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels.py: no CUDA device; nothing measured (try --device cpu --quick)")
        return 0
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # (before the solutions import triton)
        args.heads, args.dim = min(args.heads, 2), min(args.dim, 16)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU (Triton's interpreter)"
    rows, problems = measure(args)
    text = table(rows, card, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps({"card": card, "rows": rows, "problems": problems}))
    for problem in problems:
        print("WRONG:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
