"""The CUDA cases, proven without a GPU (issue 26).

The graded suite's `gpu` cases run only where there is CUDA, which CI and the development machines lack.
Here benchmarks/gpu_check.sh runs end to end on the CPU, as on a machine that has only torch, numpy, pytest
and pytest-timeout: the CUDA cases take their dry run (`--gpu-cases-on cpu`: the CUDA case's code at a
small size) on the reference and on the stubs. The dry run covers every `gpu` case; its peak-memory read
catches a full score matrix; and the references keep every tensor on their input's device (on torch's meta
device, where a tensor left on the CPU is an error, as it is beside CUDA tensors).
"""
import importlib.metadata
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from packaging.requirements import Requirement

from catalogue import BUGS
from grader.kit import EXERCISES, KIT, SOLUTIONS, SUITE
from suite_runtime.adapters import load_stage_module, peak_memory

# Whole suites or gradings run in its fixtures: seconds idle, minutes on a loaded machine (pytest's default of
# 120 s is for single tests).
pytestmark = pytest.mark.timeout(600)

# What gpu_check.sh may assume on a GPU machine: python3 with these (and what they require), nothing else. (A CUDA
# build of torch requires triton, which the kernels assignment's CUDA cases run; the CPU build here does not.)
GPU_MACHINE = ("torch", "triton", "numpy", "pytest", "pytest-timeout", "pip", "setuptools")  # (a venv: the last two)
# Installed as sitecustomize, it makes every process of a run see only those: importing a module of any other
# installed distribution (the grader, nbgrader, syrupy, tqdm ...) fails as on a machine without it.
BARE_MACHINE = """
import os, sys


class Bare:
    \"\"\"An import finder that finds nothing of the modules in ATTNKIT_ABSENT: importlib.util.find_spec says None
    and an import fails, as for a package not installed.\"\"\"

    absent = frozenset(os.environ["ATTNKIT_ABSENT"].split(","))

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in self.absent:
            return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Bare(finder) for finder in sys.meta_path]
"""


def absent_here() -> set[str]:
    """The top-level modules of the installed distributions a bare GPU machine lacks (not in GPU_MACHINE, nor
    required by one of them), less the kit's own test, solution and stub modules (the editable install maps
    those to the kit's distribution: they are found in tests/, solutions/ and exercises/ all the same, as are the
    suite's packages in tests/)."""
    allowed, todo = set(), list(GPU_MACHINE)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in allowed:
            continue
        allowed.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r.name for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})]
    ours = ({p.stem for folder in (SUITE, SOLUTIONS, EXERCISES) for p in folder.glob("*.py")}
            | {p.parent.name for p in SUITE.glob("*/__init__.py")} | {"conftest"})  # (and the suite's packages)
    return {top for top, dists in importlib.metadata.packages_distributions().items()
            if not {d.lower().replace("_", "-") for d in dists} & allowed} - ours


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The environment of a process that sees only what a bare GPU machine has (BARE_MACHINE)."""
    folder = tmp_path_factory.mktemp("bare-machine")
    (folder / "sitecustomize.py").write_text(BARE_MACHINE)
    return dict(os.environ, PYTHONPATH=str(folder), ATTNKIT_ABSENT=",".join(sorted(absent_here())))


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory, bare):
    """benchmarks/gpu_check.sh --device cpu, every process of it seeing only what a bare GPU machine has:
    {"run": the completed process, "out": its folder, "summary": its summary.json}."""
    out = tmp_path_factory.mktemp("gpu-check")
    run = subprocess.run(["bash", str(KIT / "benchmarks" / "gpu_check.sh"), "--device", "cpu"],
                         env=dict(bare, OUT=str(out), PYTHON=sys.executable), capture_output=True, text=True,
                         timeout=600)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {"run": run, "out": out, "summary": summary}


def test_the_gpu_check_passes_on_the_cpu(cpu_check):
    """Every CUDA case passes its dry run on the reference and fails on the stubs, by their NotImplementedError
    (gpu_summary.py's problems), and both benchmarks print their tables."""
    run, summary = cpu_check["run"], cpu_check["summary"]
    assert summary, f"gpu_check.sh wrote no summary.json:\n{run.stdout}\n{run.stderr}"
    assert summary["problems"] == [] and run.returncode == 0, (summary["problems"], run.stdout[-3000:])
    report = (cpu_check["out"] / "summary.md").read_text()
    assert "GPU check" in report and "PASS" in report.splitlines()[0]
    for table in ("SDPA ms", "(a) generating", "(b) causal attention", "peak MiB"):
        assert table in report, f"summary.md lacks the benchmarks' table with {table!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the GPU check would run on CUDA")
def test_without_cuda_the_gpu_check_says_so(tmp_path):
    """The GPU check's CUDA mode (its default) on a machine whose torch sees no CUDA: it runs nothing and fails,
    saying why, in its summary too; a wrong argument is refused."""
    script, env = str(KIT / "benchmarks" / "gpu_check.sh"), dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    run = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "sees no CUDA device; nothing run" in run.stdout, run.stdout + run.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["problems"][0].startswith("torch sees no CUDA device") and not summary["ok"]
    assert "step reference did not run" in summary["problems"] and summary["cases"] == {}
    refused = subprocess.run(["bash", script, "--device", "gpu"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "--device must be cuda or cpu" in refused.stderr


def test_the_dry_run_covers_every_cuda_case(cpu_check, tmp_path):
    """The `gpu` cases, counted where they cannot run (each skipped, saying why), are exactly those the dry run ran."""
    junit = tmp_path / "cuda.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", str(SUITE), "-m", "gpu", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={junit}"], cwd=KIT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    skipped = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        reason = case.find("skipped")
        skipped[f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"] = (
            reason.get("message") if reason is not None else "ran")
    assert len(skipped) >= 72, f"only {len(skipped)} gpu cases: did some lose the device fixture?"  # 72 when written
    assert all(reason.startswith("CUDA case: no CUDA device on this machine") for reason in skipped.values())
    cases = cpu_check["summary"]["cases"]
    assert set(cases) == set(skipped)
    assert all(case["reference"]["outcome"] == "passed" for case in cases.values())


def test_the_gpu_check_ran_as_on_a_bare_gpu_machine(bare):
    """The check above ran where only torch, numpy, pytest and pytest-timeout (and what they require) could be
    imported: the kit's other dependencies could not (whatever torch imports when present, such as tqdm,
    it did without)."""
    absent = set(bare["ATTNKIT_ABSENT"].split(","))
    assert {"grader", "nbgrader", "syrupy", "playwright", "transformers", "tqdm", "matplotlib"} <= absent
    assert not {"torch", "numpy", "pytest", "_pytest", "pytest_timeout", "pluggy", "suite_runtime",
                "diagnosis"} & absent
    found = {"grader": False, "nbgrader": False, "tqdm": False, "pytest_timeout": True, "torch": True}
    run = subprocess.run([sys.executable, "-c", "import importlib.util, sys; print([importlib.util.find_spec(m) "
                          "is not None for m in sys.argv[1:]])", *found], env=bare, capture_output=True, text=True)
    assert run.stdout.strip() == str(list(found.values())), run.stdout + run.stderr


def test_the_dry_run_reads_the_peak_memory(tmp_path):
    """m07's CUDA case bounds the memory tiled_attention holds at once; in its dry run the CPU allocator's peak
    is read instead of CUDA's: the full score matrix fails it, though its values are right (the reference,
    tiled, passes it in the GPU check's dry run)."""
    folder = next(b for b in BUGS if b.name == "tiled_full_score_matrix").build(tmp_path / "full_matrix")
    run = subprocess.run([sys.executable, "-m", "pytest", str(SUITE / "test_m07_tiled_attention.py"), "-q",
                          "-p", "no:cacheprovider", "-m", "gpu", "--gpu-cases-on=cpu", f"--impl={folder}"],
                         cwd=KIT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-3000:]
    assert "beyond its inputs, expected at most 1.0 MiB" in run.stdout, run.stdout[-3000:]
    assert "the full score matrix was materialised" in run.stdout


def test_peak_memory_counts_what_the_block_holds_at_once(monkeypatch):
    """On the CPU, from torch's profiler: what the block allocated and held at once, not what it found held;
    on CUDA (torch.cuda's counters stood in for here), the allocator's peak less what was held at the start."""
    held_before = torch.ones(2**20)  # 4 MiB held before: not counted
    with peak_memory("cpu") as peak:
        big = torch.empty(2**20 + 2**18)  # 5 MiB ...
        del big  # ... released, then 1 MiB
        small = torch.zeros(2**18)
    assert 5 * 2**20 <= peak["bytes"] < 5 * 2**20 + 2**16, peak
    del held_before, small

    calls = []
    fake = {"synchronize": lambda device: calls.append(("synchronize", device)),
            "reset_peak_memory_stats": lambda device: calls.append(("reset", device)),
            "memory_allocated": lambda device: 300, "max_memory_allocated": lambda device: 1300}
    for name, function in fake.items():
        monkeypatch.setattr(torch.cuda, name, function)
    with peak_memory("cuda") as peak:
        assert peak["bytes"] is None
    assert peak["bytes"] == 1000 and calls == [("synchronize", "cuda"), ("reset", "cuda")]


def meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, device="meta", dtype=dtype)


def moved(model, train=False):
    """A model moved to the meta device as the adapters move one to the case's device (Module.to)."""
    return model.train(train).to("meta")


def decode(model, x):
    """A prompt of 6 tokens, then 2 one by one, through the module's cache."""
    return [model(x[:, :6], use_cache=True), model(x[:, 6:7], use_cache=True), model(x[:, 7:], use_cache=True)]


def paged(model, x):
    """Two sequences' prompts of 6 tokens in blocks of 4, then a token of each."""
    return [model(x[:, :6], seq_ids=[0, 1]), model(x[:, 6:7], seq_ids=[0, 1])]


# What the CUDA cases run of each stage (with dropout on, masks, caches) on x (2, 8, 16): models are moved with
# .to(), inputs made on the device; whatever the code makes on its own must land there too.
ON_DEVICE = {
    "s08_causal_attention": lambda m, x: moved(m.CausalAttention(16, 16, 8, 0.5), True)(x),
    "s09_multihead_wrapper": lambda m, x: moved(m.MultiHeadAttentionWrapper(16, 8, 8, 0.5, 2), True)(x),
    "s10_multihead_attention": lambda m, x: moved(m.MultiHeadAttention(16, 16, 8, 0.5, 4), True)(x),
    "s11_other_forms": lambda m, x: [moved(m.MultiHeadAttentionCombinedQKV(16, 16, 8, 0.5, 4), True)(x),
                                     moved(m.MultiHeadAttentionPerHead(16, 16, 8, 0.5, 4), True)(x)],
    "m01_pytorch_attention": lambda m, x: [
        m.sdpa_attention(moved(m.MultiHeadAttention(16, 16, 8, 0.5, 4), True), x, use_mask=True),
        m.torch_mha_forward(moved(m.MultiHeadAttention(16, 16, 8, 0.0, 4)), x)],
    "m02_padding_and_cross": lambda m, x: moved(m.CrossAttention(16, 16, 4, d_context=12, dropout=0.5), True)(
        x, context=meta(2, 5, 12), key_padding_mask=meta(2, 5, dtype=torch.bool)),
    "m03_kv_cache": lambda m, x: decode(moved(m.MultiHeadAttentionWithCache(16, 16, 8, 4, dropout=0.5), True), x),
    "m04_grouped_query": lambda m, x: decode(moved(m.GroupedQueryAttention(16, 16, 8, 4, 2)), x),
    "m05_rotary_embeddings": lambda m, x: decode(moved(m.RoPEAttention(16, 16, 8, 4, num_kv_groups=2)), x),
    "m06_sliding_window": lambda m, x: decode(moved(m.SlidingWindowAttention(16, 16, 8, 4, window=3)), x),
    "m07_tiled_attention": lambda m, x: m.tiled_attention(*(meta(2, 2, 8, 4),) * 3, is_causal=True, block_size=3),
    "f01_latent_attention": lambda m, x: [*decode(moved(m.MultiHeadLatentAttention(16, 16, 8, 4, 6, 4)), x),
                                          moved(m.MultiHeadLatentAttention(16, 16, 8, 4, 6, 4))(x, absorbed=True)],
    # (the cache keeps the positions it may still see: a boolean index, whose size the meta device cannot know)
    "f02_attention_sinks": lambda m, x: moved(m.SinkAttention(16, 16, 8, 4, num_kv_groups=2, window=3,
                                                              num_sink_tokens=1))(x),
    "f03_paged_kv_cache": lambda m, x: paged(moved(m.PagedAttention(16, 16, 4, num_blocks=8, block_size=4)), x),
    # (f04: flex_attention refuses the meta device; its CUDA case is the check)
    "f05_sparse_indexer": lambda m, x: moved(m.SparseAttention(16, 16, 8, 4, index_heads=2, index_dim=4, top_k=3))(x),
    "f06_gated_delta_rule": lambda m, x: decode(moved(m.GatedDeltaNet(16, 16, 4)), x),
    "f07_cross_layer_kv": lambda m, x: decode(moved(m.CrossLayerKVStack(16, 8, 4, [0, 1, 1], num_kv_groups=2)), x),
}


@pytest.mark.parametrize("stage", sorted(ON_DEVICE))
def test_the_references_keep_every_tensor_on_the_input_s_device(stage):
    """A tensor made on the CPU (torch.arange(n) without device=) meets CUDA tensors only on a GPU; on torch's
    meta device it is an error too, without a GPU: the references of every stage with CUDA cases run there."""
    outputs = ON_DEVICE[stage](load_stage_module(SOLUTIONS, stage), meta(2, 8, 16))
    for out in outputs if isinstance(outputs, list) else [outputs]:
        assert out.device.type == "meta" and out.shape[0] == 2
