"""The graded suite's command-line options: which implementation to test, the seed of the
randomized cases, where the CUDA cases run, and each check's time limit (tests/suite_plugin/time_limits.py).

They live in this root conftest so that pytest knows them before it reads the arguments:
``pytest --impl PATH`` must not take PATH for a test path. The fixtures and the rest
of the wiring are in tests/conftest.py.
"""
import secrets
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
GPU_CASES_ON = ("cuda", "cpu", "cpu-full-size")  # tests/conftest.py: the device fixture


def pytest_addoption(parser):
    parser.addoption(
        "--impl", default=None, metavar="PATH",
        help="the folder of stage modules (sNN_topic.py) to test (default: the ini option impl)",
    )
    parser.addoption(
        "--seed", type=int, default=None,
        help="seed of the randomized cases (default: a fresh one per run, shown in the header)",
    )
    parser.addoption(
        "--gpu-cases-on", choices=GPU_CASES_ON, default="cuda",
        help="where the CUDA cases (marked gpu) run: cuda (default; skipped without a CUDA device), cpu (a dry "
             "run: their code path at a small size, seconds) or cpu-full-size (their CUDA sizes, minutes)",
    )
    parser.addoption(
        "--speed-checks", choices=("skip", "count"), default=None,
        help="kernel speed checks that cannot run here (no GPU, or kernels in Triton's interpreter): skip them (not "
             "counted, the default) or count them as failed (default: $ATTNKIT_SPEED_CHECKS, else skip)",
    )
    parser.addini("impl", default=".", help="default for --impl, relative to this folder")
    help_limit = ("seconds of CPU time one check of a stage may use (and 5 times that of waiting, not counting the "
                  "time the machine kept it waiting for a processor); none by default")
    parser.addoption("--check-time-limit", type=float, default=None, metavar="SECONDS", help=help_limit)
    parser.addini("check_time_limit", default="", help=help_limit)


def pytest_configure(config):
    """Resolve --impl to an absolute folder and --seed to a number, once, in the options themselves."""
    choice = config.getoption("impl")
    base = Path.cwd()
    if choice is None:
        choice, base = config.getini("impl"), ROOT
    root = (base / Path(choice).expanduser()).resolve()
    if not root.is_dir():
        raise pytest.UsageError(f"--impl {choice}: {root} is not a folder of stage modules (sNN_topic.py).")
    config.option.impl = str(root)
    if config.getoption("seed") is None:
        config.option.seed = secrets.randbelow(2**31)


def pytest_report_header(config):
    return [
        f"attention-kit implementation under test: {config.getoption('impl')}",
        f"randomized cases: --seed {config.getoption('seed')} (pass it again to reproduce them)",
    ]
