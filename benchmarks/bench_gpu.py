"""The reference MultiHeadAttention against PyTorch's fused F.scaled_dot_product_attention.

    python benchmarks/bench_gpu.py                       # GPT-2 size on CUDA (fp32 and bf16)
    python benchmarks/bench_gpu.py --device cpu --small  # the same logic on a small case on the CPU

Both sides use the same module and weights (W_query, W_key, W_value, out_proj of
solutions/s10_multihead_attention.MultiHeadAttention); the fused side only replaces the
scores-mask-softmax-weighted-sum in the middle by F.scaled_dot_product_attention(is_causal=True).
The outputs are compared before timing. Each figure is the median of --repeat timed calls after
--warmup untimed ones, in inference mode (dropout off); on CUDA with CUDA events.

Without CUDA (and --device cuda, the default) it says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
GPT2 = {"batch": 8, "tokens": 1024, "d_model": 768, "heads": 12}
SMALL = {"batch": 2, "tokens": 128, "d_model": 768, "heads": 12}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |difference| relative to the output's max |value|


def load_reference():
    """solutions/s10_multihead_attention.py, loaded from its file (solutions/ is not a package)."""
    path = KIT / "solutions" / "s10_multihead_attention.py"
    spec = importlib.util.spec_from_file_location("s10_multihead_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiHeadAttention


def fused_forward(mha, x):
    """The reference module's forward with its attention core replaced by F.scaled_dot_product_attention."""
    import torch.nn.functional as F

    b, t, _ = x.shape
    h, hd = mha.num_heads, mha.head_dim

    def heads(y):
        return y.view(b, t, h, hd).transpose(1, 2)

    q, k, v = heads(mha.W_query(x)), heads(mha.W_key(x)), heads(mha.W_value(x))
    context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return mha.out_proj(context.transpose(1, 2).reshape(b, t, mha.d_out))


def median_ms(fn, device, warmup: int, repeat: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def bench(size: dict, dtype_name: str, device, warmup: int, repeat: int) -> dict:
    import torch

    MultiHeadAttention = load_reference()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(123)
    b, t, d, h = size["batch"], size["tokens"], size["d_model"], size["heads"]
    mha = MultiHeadAttention(d, d, context_length=t, dropout=0.0, num_heads=h).to(device=device, dtype=dtype).eval()
    x = torch.randn(b, t, d, device=device, dtype=dtype)
    with torch.inference_mode():
        ref, fused = mha(x), fused_forward(mha, x)
        error = ((ref.float() - fused.float()).abs().max() / ref.float().abs().max()).item()
        if error > TOLERANCE[dtype_name]:
            raise SystemExit(f"the two sides disagree in {dtype_name}: relative max difference {error:.2e}")
        ref_ms = median_ms(lambda: mha(x), device, warmup, repeat)
        fused_ms = median_ms(lambda: fused_forward(mha, x), device, warmup, repeat)
    return {"dtype": dtype_name, "reference_ms": ref_ms, "fused_ms": fused_ms, "error": error}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--small", action="store_true",
                        help=f"a small case ({SMALL}) instead of GPT-2 size ({GPT2}), e.g. to check the logic on a CPU")
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"],
                        help="repeatable; default both")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)

    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): "
              "nothing to time. Run it on a machine with an NVIDIA GPU, or try --device cpu --small.")
        return 0
    size = SMALL if args.small else GPT2
    dtypes = args.dtype or ["float32", "bfloat16"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print("MultiHeadAttention (reference) vs F.scaled_dot_product_attention(is_causal=True)")
    print(f"b={size['batch']} T={size['tokens']} d={size['d_model']} heads={size['heads']} on {where}, "
          f"torch {torch.__version__}; median of {args.repeat} after {args.warmup} warm-up calls")
    print()
    print(f"{'dtype':<10}{'reference ms':>14}{'SDPA ms':>12}{'ratio':>8}{'max rel diff':>15}")
    for name in dtypes:
        r = bench(size, name, device, args.warmup, args.repeat)
        print(f"{name:<10}{r['reference_ms']:>14.2f}{r['fused_ms']:>12.2f}"
              f"{r['reference_ms'] / r['fused_ms']:>7.2f}x{r['error']:>15.1e}")
    print()
    print("ratio = reference time / SDPA time: how many times faster the fused kernel runs the same layer.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
