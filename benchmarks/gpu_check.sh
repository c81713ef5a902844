#!/usr/bin/env bash
# The GPU check (issue 26): the graded suite's CUDA cases and the GPU benchmarks, in one run.
#
#   bash benchmarks/gpu_check.sh                 # on a GPU machine: 3 to 5 minutes on one H100, 8 at most
#   bash benchmarks/gpu_check.sh --device cpu    # the same steps on the CPU at small sizes (under a minute)
#
# Needs python3 (or $PYTHON) with torch (a CUDA build for the GPU run), numpy, pytest and pytest-timeout:
# nothing of the kit installed, no network. Run from anywhere; it works in the kit's folder. Steps:
#   1. reference  pytest tests -m gpu on solutions/: every CUDA case must pass (on the CPU: their dry run,
#                 --gpu-cases-on cpu)
#   2. stubs      the same cases on exercises/: every one must fail (a failure, not an error or a skip)
#   3. bench_gpu     benchmarks/bench_gpu.py: MultiHeadAttention vs SDPA at GPT-2 size, fp32 and bf16
#   4. bench_modern  benchmarks/bench_modern.py --llama: KV-cache decoding vs recomputing, tiled attention vs
#                    SDPA and naive attention at T 4096 and 16384, with each way's peak memory
# Each step has a time limit (together 8 minutes); a step that fails does not stop the next ones.
# Writes 8 files into $OUT (default ./gpu-check): summary.md (what ran where: the card, every CUDA case's
# result, the benchmarks' tables), summary.json (the same for programs), reference.xml and stubs.xml (JUnit),
# and one .log per step (its command, output, exit status and time). Exits 0 when every step did what it must.
set -uo pipefail

DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 || shift ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (usage: gpu_check.sh [--device cuda|cpu])" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
  echo "gpu_check.sh: --device must be cuda or cpu, not '$DEVICE'" >&2
  exit 2
fi
PYTHON="${PYTHON:-python3}"
OUT="$(mkdir -p "${OUT:-gpu-check}" && cd "${OUT:-gpu-check}" && pwd)" || exit 2
cd "$(dirname "$0")/.." || exit 2
rm -f "$OUT"/{reference,stubs,bench_gpu,bench_modern}.log "$OUT"/{reference,stubs}.xml "$OUT"/summary.{md,json}

# pytest loads pytest-timeout alone: whatever other plugins the machine has stay out of the run.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
SUITE=(-m pytest tests -m gpu -p pytest_timeout -p no:cacheprovider -q -rfEs)
if [ "$DEVICE" = cpu ]; then
  SUITE+=(--gpu-cases-on=cpu)
  BENCH_GPU=(benchmarks/bench_gpu.py --device cpu --small --warmup 1 --repeat 3)
  BENCH_MODERN=(benchmarks/bench_modern.py --device cpu --quick --warmup 1 --repeat 2)
else
  BENCH_GPU=(benchmarks/bench_gpu.py --device cuda)
  # --warmup 0: each way has run before it is timed (its check against the reference way, and its measure)
  BENCH_MODERN=(benchmarks/bench_modern.py --device cuda --llama --warmup 0 --repeat 3)
fi

step() {  # name, seconds, command...: the command and its output into $OUT/name.log, then its exit and time
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "== $name (at most $limit s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  status=$?
  echo "== exit $status after $((SECONDS - start)) s" >>"$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
}

if [ "$DEVICE" = cuda ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check.sh: $PYTHON's torch sees no CUDA device; nothing run (try --device cpu)"
else
  if [ "$DEVICE" = cpu ]; then  # side by side: each uses one core
    step reference 150 "$PYTHON" "${SUITE[@]}" --impl=solutions --junitxml="$OUT/reference.xml" &
    step stubs 100 "$PYTHON" "${SUITE[@]}" --impl=exercises --junitxml="$OUT/stubs.xml" &
    wait
  else  # one after the other: each has the GPU to itself
    step reference 150 "$PYTHON" "${SUITE[@]}" --impl=solutions --junitxml="$OUT/reference.xml"
    step stubs 100 "$PYTHON" "${SUITE[@]}" --impl=exercises --junitxml="$OUT/stubs.xml"
  fi
  step bench_gpu 60 "$PYTHON" "${BENCH_GPU[@]}"
  step bench_modern 170 "$PYTHON" "${BENCH_MODERN[@]}"
fi
"$PYTHON" benchmarks/gpu_summary.py "$OUT" --device "$DEVICE"
