"""What two stages of modern-attention buy: a KV cache when generating, tiles instead of a score matrix.

    python benchmarks/bench_modern.py                      # CUDA when there is one, else the CPU
    python benchmarks/bench_modern.py --device cpu --quick # small sizes, to check the logic
    python benchmarks/bench_modern.py --device cuda --llama # a Llama layer's sizes (benchmarks/gpu_check.sh)
    python benchmarks/bench_modern.py --impl PATH          # a learner's folder instead of solutions/

(a) Generating --new tokens one at a time after a --prompt: m03_kv_cache's MultiHeadAttentionWithCache
    with its cache (each step projects one token and attends to the cached keys and values) against
    recomputing the full causal forward of the whole sequence so far at every step, each both with
    the module's own attention and through F.scaled_dot_product_attention (the same weights). The
    tokens are drawn in advance: the attention layer alone has no vocabulary to sample from.
(b) m07_tiled_attention's tiled_attention against F.scaled_dot_product_attention and against naive
    attention (the whole score matrix, softmax, values), causal, at a few sequence lengths: the time, the
    largest tensor each way creates, and the most memory it holds at once beyond its inputs (its peak).

Every way is checked to give the reference way's output before it is timed. The ways of one table
take turns (one run of each, --repeat rounds after --warmup untimed ones), so that a machine busy
with other work slows them alike; each figure is the median of its runs, in inference mode (on CUDA,
synchronized before and after each run). Ratios come from one run of this script.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT / "tests"))  # adapters: load_stage_module, Allocations, peak_memory

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |difference| relative to the output's max |value|
DECODING = {"batch": 1, "d_model": 512, "heads": 8, "prompt": 128, "new": 128}
LENGTHS = (256, 1024, 2048)
HEADS = {"batch": 1, "heads": 8, "head_dim": 64}
SIZES = {
    "default": {"decoding": DECODING, "lengths": LENGTHS, "heads": HEADS},
    "quick": {"decoding": dict(DECODING, prompt=16, new=16), "lengths": (64, 128), "heads": HEADS},
    # A Llama layer (d_model 4096, 32 heads of 128) decoding after a 4096-token prompt, and its attention at
    # T 4096 and 16384. Naive attention at 16384 holds three 16 GiB score matrices at once in bfloat16.
    "llama": {"decoding": dict(batch=1, d_model=4096, heads=32, prompt=4096, new=128), "lengths": (4096, 16384),
              "heads": {"batch": 1, "heads": 32, "head_dim": 128}},
}


def load(folder, stage):
    from suite_runtime.adapters import load_stage_module

    return load_stage_module(Path(folder), stage)


def median_ms(ways, device, warmup, repeat):
    """{name: median milliseconds of fn()} for ways {name: fn}, the ways taking turns round after round."""
    import torch

    def run(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1000

    times = {name: [] for name in ways}
    for round_ in range(warmup + repeat):
        for name, fn in ways.items():
            ms = run(fn)
            if round_ >= warmup:
                times[name].append(ms)
    return {name: statistics.median(ms) for name, ms in times.items()}


def check_same(name, actual, expected, dtype_name):
    error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    if error > TOLERANCE[dtype_name]:
        raise SystemExit(f"{name} disagrees with the reference way: relative max difference {error:.2e}")


# ---------------------------------------------------------------- (a) decoding with a KV cache

def sdpa_step(mha, x, past):
    """mha's attention for the new tokens x through F.scaled_dot_product_attention; ``past`` = (keys, values)
    cached so far or None. Returns (output, (keys, values)) with x's keys and values appended."""
    import torch
    import torch.nn.functional as F

    b, num_new, _ = x.shape

    def heads(t):
        return t.view(b, num_new, mha.num_heads, mha.head_dim).transpose(1, 2)

    q, k, v = heads(mha.W_query(x)), heads(mha.W_key(x)), heads(mha.W_value(x))
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    # One new token sees every key; several new tokens (a prompt on an empty cache) need the causal mask.
    context = F.scaled_dot_product_attention(q, k, v, is_causal=num_new > 1 and past is None)
    return mha.out_proj(context.transpose(1, 2).reshape(b, num_new, mha.d_out)), (k, v)


def generate_cached(mha, x, prompt):
    mha.reset_cache()
    outs = [mha(x[:, :prompt], use_cache=True)[:, -1:]]
    outs += [mha(x[:, t:t + 1], use_cache=True) for t in range(prompt, x.shape[1])]
    return outs


def generate_recomputed(mha, x, prompt):
    return [mha(x[:, :t])[:, -1:] for t in range(prompt, x.shape[1] + 1)]


def generate_cached_sdpa(mha, x, prompt):
    out, past = sdpa_step(mha, x[:, :prompt], None)
    outs = [out[:, -1:]]
    for t in range(prompt, x.shape[1]):
        out, past = sdpa_step(mha, x[:, t:t + 1], past)
        outs.append(out)
    return outs


def generate_recomputed_sdpa(mha, x, prompt):
    return [sdpa_step(mha, x[:, :t], None)[0][:, -1:] for t in range(prompt, x.shape[1] + 1)]


def bench_decoding(folder, size, device, dtype_name, warmup, repeat):
    import torch

    module = load(folder, "m03_kv_cache")
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(123)
    b, d, h, prompt, new = (size[k] for k in ("batch", "d_model", "heads", "prompt", "new"))
    mha = module.MultiHeadAttentionWithCache(d, d, context_length=prompt + new, num_heads=h)
    mha = mha.to(device=device, dtype=dtype).eval()
    x = torch.randn(b, prompt + new, d, device=device, dtype=dtype)
    ways = {"recompute": generate_recomputed, "recompute, SDPA": generate_recomputed_sdpa,
            "KV cache": generate_cached, "KV cache, SDPA": generate_cached_sdpa}
    with torch.inference_mode():
        expected = torch.cat(generate_recomputed(mha, x, prompt), dim=1)  # the chapter-3 forward, step by step
        for name, way in ways.items():
            check_same(name, torch.cat(way(mha, x, prompt), dim=1), expected, dtype_name)
        return median_ms({name: partial(way, mha, x, prompt) for name, way in ways.items()}, device, warmup, repeat)


# ---------------------------------------------------------------- (b) tiles against the score matrix

def naive_attention(q, k, v):
    """Chapter 3's way: the whole (n, n) score matrix per head, masked, softmaxed, times the values."""
    import torch

    n = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax(scores.masked_fill(future, -torch.inf), dim=-1) @ v


def measure(fn, device):
    """What fn() allocates: the elements of the largest tensor a torch function returns (adapters.Allocations)
    and the most bytes held at once on ``device`` beyond what was held before (adapters.peak_memory)."""
    from suite_runtime.adapters import Allocations, peak_memory

    with Allocations() as watch, peak_memory(device) as held:
        fn()
    return watch.largest, held["bytes"]


def naive_fits(n, size, dtype, device):
    """Whether naive attention's three score matrices (scores, masked, softmaxed) fit in the device's free memory."""
    import torch

    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 3 * size["batch"] * size["heads"] * n * n * dtype.itemsize < 0.9 * free


def bench_tiles(folder, lengths, size, device, dtype_name, block_size, warmup, repeat):
    import torch
    import torch.nn.functional as F

    tiled_attention = load(folder, "m07_tiled_attention").tiled_attention
    dtype = getattr(torch, dtype_name)
    ways = {"tiled": lambda q, k, v: tiled_attention(q, k, v, is_causal=True, block_size=block_size),
            "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "naive": naive_attention}
    rows = []
    for n in lengths:
        torch.manual_seed(n)
        q, k, v = (torch.randn(size["batch"], size["heads"], n, size["head_dim"], device=device, dtype=dtype)
                   for _ in range(3))
        calls = {name: partial(way, q, k, v) for name, way in ways.items()
                 if name != "naive" or naive_fits(n, size, dtype, device)}
        with torch.inference_mode():
            expected = ways["SDPA"](q, k, v)
            for name, call in calls.items():
                check_same(f"{name} attention at T={n}", call(), expected, dtype_name)
            del expected
            measured = {name: measure(call, device) for name, call in calls.items()}
            times = median_ms(calls, device, warmup, repeat)
        rows += [{"T": n, "way": name, "ms": times.get(name), "largest": measured.get(name, (None, None))[0],
                  "peak_bytes": measured.get(name, (None, None))[1]} for name in ways]
    return rows


def main(argv=None) -> int:
    try:
        return run(argv)
    except NotImplementedError as exc:  # a learner's folder with a stage still a stub
        print(f"not implemented yet: {exc}")
        return 1


def run(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--impl", default=str(KIT / "solutions"),
                        help="the folder of stage modules to time (default: the reference, solutions/)")
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true", help=f"small sizes ({SIZES['quick']}), to check the logic")
    scale.add_argument("--llama", action="store_true", help=f"a Llama layer's sizes ({SIZES['llama']}), for a GPU")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}): run with --device cpu.")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    sizes = SIZES["quick" if args.quick else "llama" if args.llama else "default"]
    decoding, lengths, heads = sizes["decoding"], sizes["lengths"], sizes["heads"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}, torch {torch.__version__}, {dtype_name}; implementation {args.impl}; "
          f"median of {args.repeat} after {args.warmup} warm-up runs")

    times = bench_decoding(args.impl, decoding, device, dtype_name, args.warmup, args.repeat)
    print(f"\n(a) generating {decoding['new']} tokens after a prompt of {decoding['prompt']}: b={decoding['batch']}, "
          f"d_model={decoding['d_model']}, {decoding['heads']} heads")
    print(f"{'way':<18}{'ms':>10}{'ms/token':>10}{'recompute / this':>18}")
    for name, ms in times.items():
        print(f"{name:<18}{ms:>10.1f}{ms / decoding['new']:>10.2f}{times['recompute'] / ms:>17.2f}x")

    rows = bench_tiles(args.impl, lengths, heads, device, dtype_name, args.block_size, args.warmup, args.repeat)
    print(f"\n(b) causal attention, b={heads['batch']}, {heads['heads']} heads of {heads['head_dim']}, "
          f"tiles of {args.block_size}")
    print(f"{'T':>6}  {'way':<6}{'ms':>11}{'/ SDPA':>9}{'largest tensor':>16}{'peak MiB':>11}")
    sdpa = {row["T"]: row["ms"] for row in rows if row["way"] == "SDPA"}
    for row in rows:
        if row["ms"] is None:
            print(f"{row['T']:>6}  {row['way']:<6}  not run: its score matrices would not fit in the free memory")
            continue
        print(f"{row['T']:>6}  {row['way']:<6}{row['ms']:>11.2f}{row['ms'] / sdpa[row['T']]:>8.2f}x"
              f"{row['largest']:>16}{row['peak_bytes'] / 2**20:>11.1f}")
    print("\n/ SDPA: how many times longer than F.scaled_dot_product_attention; largest tensor: elements of the "
          "largest a torch function returned (SDPA's is its output: its work happens inside one call, out of the "
          "watch's sight); peak: the most memory held at once beyond q, k and v (torch's allocator)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
