"""The summary of a GPU check (benchmarks/gpu_check.sh): what ran where, and whether each step did what it must.

    python benchmarks/gpu_summary.py OUT --device cuda|cpu

Reads what gpu_check.sh left in OUT (reference.xml and stubs.xml from pytest, a .log per step)
and writes OUT/summary.md and OUT/summary.json: the machine (the card's name, torch, CUDA), every CUDA case's
result on the reference solutions and on the stubs, the benchmarks' tables as they printed them, and the
problems found. Exits 1 when there is any: a case that did not pass on the reference, one that did not fail
on the stubs by their own NotImplementedError (an error or a skip is not a failure: a stub must fail as a wrong
answer does), a case run on one side only, a step that failed or ran out of time.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

STEPS = {  # step: what it runs
    "reference": "the CUDA cases on the reference solutions (pytest tests -m gpu --impl solutions)",
    "stubs": "the CUDA cases on the stubs (pytest tests -m gpu --impl exercises)",
    "bench_gpu": "benchmarks/bench_gpu.py: MultiHeadAttention vs F.scaled_dot_product_attention",
    "bench_modern": "benchmarks/bench_modern.py: KV-cache decoding, tiled attention and peak memory",
}


def machine(device: str) -> dict:
    """The card (or CPU), torch and CUDA versions, as this Python sees them."""
    found = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch
    except ImportError as exc:
        return {**found, "torch": f"not importable: {exc}"}
    found.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"{props.major}.{props.minor}", cards=torch.cuda.device_count())
    else:
        cpu = platform.processor() or platform.machine()
        found["card"] = f"none: the CPU ({cpu}, {torch.get_num_threads()} threads)"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        run = subprocess.run(query, capture_output=True, text=True, timeout=30)
        found["nvidia_smi"] = run.stdout.strip() or run.stderr.strip()
    return found


def cases(xml: Path) -> dict:
    """{test id: {"outcome": passed|failed|error|skipped, "seconds", "message"}} from pytest's JUnit XML."""
    if not xml.is_file():
        return {}
    found = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("error", "failure", "skipped"):  # an error in teardown after a failure is an error
            child = case.find(kind)
            if child is not None:
                outcome = {"failure": "failed", "error": "error"}.get(kind, kind)
                message = (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        found[test] = {"outcome": outcome, "seconds": round(float(case.get("time") or 0), 2), "message": message}
    return found


def step_status(out: Path, name: str) -> dict | None:
    """{"status", "seconds", "log"} of a step from its log (gpu_check.sh's step ends it with its exit and time);
    None if it did not run, status None if it did not finish."""
    path = out / f"{name}.log"
    if not path.is_file():
        return None
    log = path.read_text(errors="replace")
    end = re.search(r"^== exit (\d+) after (\d+) s\n?\Z", log, flags=re.M)
    return {"status": int(end[1]) if end else None, "seconds": int(end[2]) if end else None,
            "log": log[:end.start()] if end else log}


def problems_of(device: str, found: dict, steps: dict, reference: dict, stubs: dict) -> list[str]:
    problems = []
    if device == "cuda" and not found.get("cuda_available"):
        problems.append("torch sees no CUDA device here: the CUDA cases cannot run (use --device cpu for the dry run)")
    for name in STEPS:
        step = steps.get(name)
        if step is None:
            problems.append(f"step {name} did not run")
        elif step["status"] is None:
            problems.append(f"step {name} did not finish (see {name}.log)")
        elif step["status"] in (124, 137):
            problems.append(f"step {name} ran out of time ({step['seconds']} s)")
        elif name.startswith("bench") and step["status"] != 0:
            problems.append(f"step {name} exited with status {step['status']} (see {name}.log)")
        elif name.startswith("bench") and "not available" in step["log"]:
            problems.append(f"step {name} did not run on CUDA: {step['log'].strip().splitlines()[-1]}")
    if steps.get("reference") and not reference:
        problems.append("the reference run recorded no CUDA case (see reference.log)")
    for test, result in reference.items():
        if result["outcome"] != "passed":
            problems.append(f"{test} {result['outcome']} on the reference: {result['message']}")
    for test, result in stubs.items():
        stub = f"NotImplementedError: {test.split('/test_')[-1].split('.py')[0]}: "  # the stage's own stub
        if result["outcome"] != "failed":
            problems.append(f"{test} {'passed' if result['outcome'] == 'passed' else 'gave ' + result['outcome']} "
                            f"on the stubs, where it must fail: {result['message']}")
        elif stub not in result["message"]:  # (pytest shows where it was raised first: exercises/<stage>.py:LINE)
            problems.append(f"{test} failed on the stubs before reaching them: {result['message']}")
    if reference and stubs:
        problems += [f"{test} ran on the reference only" for test in sorted(set(reference) - set(stubs))]
        problems += [f"{test} ran on the stubs only" for test in sorted(set(stubs) - set(reference))]
    return problems


def count(results: dict, outcome: str) -> int:
    return sum(r["outcome"] == outcome for r in results.values())


def markdown(summary: dict) -> str:
    found, steps, rows = summary["machine"], summary["steps"], summary["cases"]
    ref = {t: r["reference"] for t, r in rows.items() if r["reference"]}
    stubs = {t: r["stubs"] for t, r in rows.items() if r["stubs"]}
    lines = [
        f"# GPU check, {summary['date']}: {'PASS' if summary['ok'] else 'FAIL'}",
        "",
        f"- mode: `--device {summary['device']}`" + (" (the CUDA cases' dry run on the CPU, small sizes)"
                                                        if summary["device"] == "cpu" else ""),
        f"- card: {found.get('card')}" + (f", {found['memory_gib']} GiB, compute capability {found['capability']}"
                                          if "memory_gib" in found else ""),
        f"- nvidia-smi: {found['nvidia_smi']}" if "nvidia_smi" in found else "- nvidia-smi: not on this machine",
        f"- torch {found.get('torch')}, CUDA {found.get('cuda')}, Python {found.get('python')}, "
        f"{found.get('platform')}",
        "- steps: " + ", ".join(f"{name} {s['seconds']} s (exit {s['status']})" if s and s["status"] is not None
                                else f"{name} {'did not finish' if s else 'not run'}" for name, s in steps.items()),
        "",
    ]
    if summary["problems"]:
        lines += ["## Problems", ""] + [f"- {p}" for p in summary["problems"]] + [""]
    lines += [
        f"## The CUDA cases: {len(rows)}",
        "",
        f"Reference solutions: {count(ref, 'passed')} of {len(ref)} passed. Stubs: {count(stubs, 'failed')} of "
        f"{len(stubs)} failed ({count(stubs, 'error')} errors, {count(stubs, 'skipped')} skipped, "
        f"{count(stubs, 'passed')} passed).",
        "",
        "| case | reference | s | stubs |",
        "|---|---|---|---|",
    ]
    for test, row in rows.items():
        r, s = row["reference"] or {}, row["stubs"] or {}
        lines.append(f"| `{test}` | {r.get('outcome', '-')} | {r.get('seconds', '')} | {s.get('outcome', '-')} |")
    for name in ("bench_gpu", "bench_modern"):
        step = steps.get(name)
        lines += ["", f"## {STEPS[name]}", ""]
        lines += ["```", step["log"].rstrip(), "```"] if step else ["not run"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder gpu_check.sh wrote into")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)

    found = machine(args.device)
    steps = {name: step_status(args.out, name) for name in STEPS}
    reference, stubs = cases(args.out / "reference.xml"), cases(args.out / "stubs.xml")
    problems = problems_of(args.device, found, steps, reference, stubs)
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": args.device,
        "ok": not problems,
        "problems": problems,
        "machine": found,
        "steps": {name: step and {k: v for k, v in step.items() if k != "log"} for name, step in steps.items()},
        "cases": {test: {"reference": reference.get(test), "stubs": stubs.get(test)}
                  for test in sorted(set(reference) | set(stubs))},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["steps"] = steps  # with the logs, for the tables
    (args.out / "summary.md").write_text(markdown(summary))
    verdict = "PASS" if not problems else f"FAIL: {len(problems)} problem(s), the first: {problems[0]}"
    print(f"GPU check ({args.device}): {verdict}\nsummary: {args.out / 'summary.md'}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
