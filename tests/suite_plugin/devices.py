"""Where a test runs: every batched multi-head test on the CPU, and again as its CUDA case."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

# ---------------------------------------------------------------- devices
#
# A test that takes ``device`` runs twice: as its CPU twin, and as its CUDA case (marked `gpu`). The CUDA
# case runs on CUDA, and is skipped where there is none, unless `--gpu-cases-on` sends it to the CPU: through
# the same code (its dtypes, helpers and checks, the peak-memory read), either at its small "dry run" size
# (`cpu`: seconds, how CI proves the CUDA cases' logic) or at its CUDA size (`cpu-full-size`: minutes, the
# CUDA sizes' tolerances without a GPU). A test whose CUDA case has sizes of its own takes ``target`` too.

NO_CUDA = "CUDA case: no CUDA device on this machine (its CPU twin ran; run on a GPU to check this one)"


@dataclass(frozen=True)
class Target:
    """Which case of a device-parametrised test runs, where, at which size."""

    cuda: bool  # the CUDA case (its dtypes and checks), wherever it runs
    device: str  # where its tensors go: "cpu" or "cuda"
    size: str  # its entry in the test module's SIZES: "cpu", "cuda" or "dry run"


def target_of(param, config) -> Target:
    if param == "cpu":
        return Target(cuda=False, device="cpu", size="cpu")
    on = config.getoption("gpu_cases_on", "cuda")  # (the kit's root conftest defines the option)
    return Target(cuda=True, device="cuda" if on == "cuda" else "cpu", size="dry run" if on == "cpu" else "cuda")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Every batched multi-head test runs on the CPU, and again as its CUDA case (see above)."""
    return target_of(request.param, request.config).device


@pytest.fixture
def target(request, device):
    """The case this run of a test with CUDA-sized cases is: ``SIZES[target.size]``, on ``target.device``."""
    return target_of(request.node.callspec.params["device"], request.config)


def pytest_itemcollected(item):
    """A CUDA case bound for CUDA is skipped, by a mark (see _skipped_by_marks), where there is none."""
    if (item.get_closest_marker("gpu") and target_of("cuda", item.config).device == "cuda"
            and not torch.cuda.is_available()):
        item.add_marker(pytest.mark.skipif(True, reason=NO_CUDA))
