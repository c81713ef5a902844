#!/usr/bin/env bash
# The GPU check of the kernels assignment (issue 35): its CUDA cases and speed checks, then the kernels benchmark.
#
#   bash benchmarks/kernels_gpu_check.sh                # on a GPU machine (not run on one yet: budget about 8 minutes)
#   bash benchmarks/kernels_gpu_check.sh --device cpu   # the same steps on the CPU, small, in Triton's interpreter
#
# Needs python3 (or $PYTHON) with torch (a CUDA build brings triton), triton, numpy, pytest and pytest-timeout. Steps,
# each with a time limit (a step that fails does not stop the next ones):
#   1. reference  pytest tests/test_k0*.py -m "gpu or speed" on solutions/: every CUDA case (float32 and bfloat16 at a
#                 real model's sizes) must pass, and every speed check (the reference against itself: about 1x its
#                 own throughput, so 0.25x, 0.5x and 0.8x all pass unless the timing is off); on the CPU: the CUDA
#                 cases' dry run (--gpu-cases-on cpu), the speed checks not run
#   2. stubs      -m gpu on exercises/: every CUDA case must fail
#   3. bench      benchmarks/bench_kernels.py: the reference kernels, SDPA and naive attention, T 1k..16k, causal and
#                 not, forward and forward+backward: the table for benchmarks/README.md, with the card's name
# Writes into $OUT (default ./kernels-gpu-check): reference.xml, stubs.xml, one .log per step, kernels.md and
# kernels.json (the benchmark), summary.md (the card, each step's counts, the table). Exits 0 when every step did what
# it must.
set -uo pipefail

DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 || shift ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "kernels_gpu_check.sh: unknown argument '$1' (usage: kernels_gpu_check.sh [--device cuda|cpu])" >&2; exit 2 ;;
  esac
done
if [ "$DEVICE" != cuda ] && [ "$DEVICE" != cpu ]; then
  echo "kernels_gpu_check.sh: --device must be cuda or cpu, not '$DEVICE'" >&2
  exit 2
fi
PYTHON="${PYTHON:-python3}"
OUT="$(mkdir -p "${OUT:-kernels-gpu-check}" && cd "${OUT:-kernels-gpu-check}" && pwd)" || exit 2
cd "$(dirname "$0")/.." || exit 2
rm -f "$OUT"/{reference,stubs,bench}.log "$OUT"/{reference,stubs}.xml "$OUT"/kernels.{md,json} "$OUT"/summary.md

export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
SUITE=(-m pytest tests/test_k01_fused_softmax.py tests/test_k02_tiled_scores.py tests/test_k03_flash_forward.py
       tests/test_k04_flash_backward.py tests/test_k05_flash_decoding.py tests/test_k06_paged_decoding.py
       -p pytest_timeout -p no:cacheprovider -q -rfEs -o timeout=600)
BENCH=(benchmarks/bench_kernels.py --device cuda --out "$OUT/kernels.md")
if [ "$DEVICE" = cpu ]; then
  SUITE+=(--gpu-cases-on=cpu)
  BENCH=(benchmarks/bench_kernels.py --device cpu --quick --warmup 0 --repeat 1 --out "$OUT/kernels.md")
fi

step() {  # name, seconds, command...: the command and its output into $OUT/name.log, then its exit and time
  local name=$1 limit=$2 start=$SECONDS status
  shift 2
  echo "== $name (at most $limit s): $*" | tee "$OUT/$name.log"
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  status=$?
  echo "== exit $status after $((SECONDS - start)) s" >>"$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
  return $status
}

if [ "$DEVICE" = cuda ] && ! "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "kernels_gpu_check.sh: $PYTHON's torch sees no CUDA device; nothing run (try --device cpu)"
  exit 1
fi
step reference 300 "$PYTHON" "${SUITE[@]}" -m "gpu or speed" --impl=solutions --junitxml="$OUT/reference.xml"
step stubs 150 "$PYTHON" "${SUITE[@]}" -m gpu --impl=exercises --junitxml="$OUT/stubs.xml"
step bench 400 "$PYTHON" "${BENCH[@]}"
"$PYTHON" - "$OUT" "$DEVICE" <<'PY'
"""summary.md: the card, what each step gave, the benchmark's table; exit 1 when a step did not do what it must."""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
try:
    import torch
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter, dry runs)"
except Exception as exc:  # noqa: BLE001
    card = f"unknown ({exc})"


def outcomes(name):
    path = out / f"{name}.xml"
    if not path.is_file():
        return None
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
        found[f"{case.get('classname')}::{case.get('name')}"] = kind
    return found


problems, lines = [], [f"# Kernels GPU check on {card}", ""]
reference, stubs = outcomes("reference"), outcomes("stubs")
for name, got, must in (("reference", reference, "passed"), ("stubs", stubs, "failure")):
    if got is None:
        problems.append(f"step {name} wrote no results")
        continue
    counts = {kind: sum(v == kind for v in got.values()) for kind in sorted(set(got.values()))}
    lines.append(f"- {name}: {len(got)} checks, {counts}")
    wrong = [t for t, kind in got.items() if kind != must and not (kind == "skipped" and device == "cpu")]
    problems += [f"{name}: {t} gave {got[t]}, not {must}" for t in wrong]
table = out / "kernels.md"
lines += ["", table.read_text() if table.is_file() else "(no benchmark table)"]
if not table.is_file():
    problems.append("the benchmark wrote no table")
lines += ["", "PASS" if not problems else "FAIL:\n" + "\n".join(f"- {p}" for p in problems)]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(1 if problems else 0)
PY
