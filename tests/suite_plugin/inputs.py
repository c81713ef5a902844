"""The tests' inputs: the stored fixtures of a stage (public and hidden .npz files) and the generator of its
randomized cases."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from suite_runtime.stage_names import stage_of

from . import ROOT

FIXTURES = ROOT / "fixtures"

class Fixture:
    """The named arrays of one .npz file: ``fx.inputs`` or ``fx["case0/x"]``."""

    def __init__(self, arrays):
        self._arrays = arrays

    def __getitem__(self, name):
        return self._arrays[name]

    def __getattr__(self, name):
        try:
            return self._arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def sub(self, prefix):
        """The arrays whose names start with prefix, prefix removed (e.g. a state_dict)."""
        return {k[len(prefix):]: v for k, v in self._arrays.items() if k.startswith(prefix)}

    def init(self, prefix=""):
        """Constructor arguments stored under prefix + 'init/', as Python scalars."""
        return {k: v.item() for k, v in self.sub(prefix + "init/").items()}


ARRAYS = pytest.StashKey[dict]()  # path -> ((mtime_ns, size), arrays): each file is read once per run


def load_fixture(config, visibility, stage):
    path = FIXTURES / visibility / f"{stage}.npz"
    if not path.is_file():
        pytest.fail(f"fixture file {path} is missing (regenerate with `attnkit fixtures`)", pytrace=False)
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    cache = config.stash.setdefault(ARRAYS, {})
    if path not in cache or cache[path][0] != version:
        with np.load(path, allow_pickle=False) as data:
            cache[path] = (version, {k: data[k] for k in data.files})
    return Fixture({k: v.copy() for k, v in cache[path][1].items()})  # a test may change its arrays


@pytest.fixture(scope="module")
def public_fx(request):
    """The public fixture of the stage this test file covers (the book's running example)."""
    return load_fixture(request.config, "public", stage_of(request.node.nodeid))


@pytest.fixture(scope="module")
def hidden_fx(request):
    """The hidden (instructor-only) fixture of this test file's stage."""
    return load_fixture(request.config, "hidden", stage_of(request.node.nodeid))


@pytest.fixture
def rng(request):
    """A NumPy generator for randomized cases: fresh each run (--seed), distinct per test."""
    return np.random.default_rng([request.config.getoption("seed"), zlib.crc32(request.node.nodeid.encode())])
