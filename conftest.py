"""The test suites' command-line options.

They live in this root conftest so that pytest knows them before it reads the
arguments: `pytest --impl exercises` must not take "exercises" for a test path.
Fixtures and the rest of the wiring are in tests/conftest.py.
"""
import secrets
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_addoption(parser):
    parser.addoption(
        "--impl", default=None,
        help="implementation to test: 'solutions', 'exercises' or a PATH laid out like exercises/",
    )
    parser.addoption(
        "--isolate", action="store_true",
        help="run the implementation in a sandboxed child process (what grading does; instructor side)",
    )
    parser.addoption(
        "--time-limit", type=float, default=None, metavar="SECONDS",
        help="with --isolate: CPU seconds the learner's code may use in one test (default 10)",
    )
    parser.addoption(
        "--time-budget", type=float, default=None, metavar="SECONDS",
        help="with --isolate: CPU seconds for the whole run (default: 12 x --time-limit)",
    )
    parser.addoption(
        "--seed", type=int, default=None,
        help="seed of the randomized hidden cases (default: a fresh one per run, shown in the header)",
    )
    parser.addini("impl", default="solutions", help="default for --impl, relative to this folder")


def pytest_configure(config):
    """Resolve the implementation folder once: config.impl_root."""
    choice = config.getoption("--impl")
    base = Path.cwd()
    if choice is None:
        choice, base = config.getini("impl"), ROOT
    root = ROOT / choice if choice in ("solutions", "exercises") else base / Path(choice).expanduser()
    if not root.resolve().is_dir():
        raise pytest.UsageError(f"--impl {choice}: {root.resolve()} is not a folder of stage modules (sNN_*.py).")
    config.impl_root = root.resolve()
    seed = config.getoption("--seed")
    config.case_seed = seed if seed is not None else secrets.randbelow(2**31)


def pytest_report_header(config):
    return [
        f"attention-kit implementation under test: {config.impl_root}",
        f"randomized cases: --seed {config.case_seed} (pass it again to reproduce them)",
    ]
