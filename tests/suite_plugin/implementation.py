"""The implementation under test and the reference, as the tests reach them: through one backend each
(``suite_runtime.adapters``), the reference's answers remembered across a grading worker's submissions."""
from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from diagnosis import Call
from diagnosis.residual import note
from suite_runtime.adapters import Implementation, LocalBackend
from suite_runtime.stage_names import register_markers, stage_of

from . import ROOT, SUITE


class BackendSpec:
    """The hook through which a grader runs the implementation somewhere else."""

    @pytest.hookspec(firstresult=True)
    def pytest_attnkit_backend(self, config, root):
        """A backend for the stage modules in folder ``root`` (``adapters.LocalBackend``'s ``run``), as a
        context manager that is closed once the session's tests are done; None: run them in this process."""


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(BackendSpec)


def pytest_configure(config):
    register_markers(config, SUITE)  # each stage's marker, from the stage test files here

@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The implementation under test (see --impl)."""
    root = Path(pytestconfig.getoption("impl"))
    backend = pytestconfig.hook.pytest_attnkit_backend(config=pytestconfig, root=root)
    if backend is None:
        yield Implementation(Witness(LocalBackend(root), root))
        return
    with backend:
        yield Implementation(Witness(backend, root))


class Witness:
    """The implementation's backend, remembering the last operation that raised and its exception: the
    evidence that a reading of the error is checked against before a failure report shows it; and noting the
    arrays each operation was given, which the residual probe of a failing check reads (diagnosis.residual)."""

    def __init__(self, backend, root=None):
        self.backend = backend
        self.root = root  # the folder of the stage modules under test (where a function's own names are read)
        self.failed = None  # (the exception, diagnosis.Call)

    def run(self, op, module, **kwargs):
        __tracebackhide__ = True  # (a student's traceback goes from the test to their code)
        try:
            result = self.backend.run(op, module, **kwargs)
        except Exception as exc:
            self.failed = (exc, Call(op, kwargs))
            raise
        # (the arrays it was given, for the residual probe of a check that then fails: diagnosis.residual)
        note(op, kwargs, lambda: parameter_names(module, kwargs.get("func"), self.root))
        return result

    def call_that_raised(self, exc):
        """The operation that raised ``exc``, or None when ``exc`` came from elsewhere (forgotten once asked)."""
        failed, self.failed = self.failed, None
        return failed[1] if failed is not None and failed[0] is exc else None


def parameter_names(module, func, root=None) -> list[str] | None:
    """The parameter names of ``func`` in stage ``module``: the stub's (as documented), else the reference's, else
    those of the module under test, read from the source (never imported here)."""
    for folder in ("exercises", "solutions"):  # (the kit's own files: read once)
        names = _kit_names(str(ROOT / folder / f"{module}.py"), func)
        if names is not None:
            return names
    # (a grading worker's submissions follow one another in one folder: read afresh)
    return _names_in(Path(root) / f"{module}.py", func) if root is not None else None


@lru_cache(maxsize=256)
def _kit_names(path, func):
    return _names_in(Path(path), func)


def _names_in(path: Path, func) -> list[str] | None:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == func:
            return [a.arg for a in node.args.posonlyargs + node.args.args]
    return None


class _MemoBackend:
    """The reference's LocalBackend, remembering deterministic results across sessions.

    A grading worker runs the suite once per submission in one process: the reference's
    answers to the same operation on the same arguments do not change, so they are computed
    once. Only results that cannot depend on torch's global random state are kept: those of
    seeded calls, of ``inspect``, of eval-mode forwards with every weight given, and of any
    call that left the global random state untouched. Every caller gets its own copy.
    """

    LIMIT = 50_000  # entries; the cache starts over beyond this

    def __init__(self, root):
        self.root = Path(root)
        self.local = LocalBackend(root)
        self.cache = {}

    def run(self, op, module, **kwargs):
        try:
            key = _digest((op, module, kwargs))
        except TypeError:
            key = None
        if key is not None and key in self.cache:
            return _copy(self.cache[key])
        state = torch.get_rng_state() if key is not None else None
        result = self.local.run(op, module, **kwargs)
        if key is not None and _deterministic(op, kwargs, state):
            if len(self.cache) >= self.LIMIT:
                self.cache.clear()
            self.cache[key] = _copy(result)
        return result


def _deterministic(op, kwargs, state_before):
    if kwargs.get("seed") is not None or op == "inspect":
        return True
    if op in ("forward", "heads_forward") and kwargs.get("weights") is not None and not kwargs.get("train"):
        return True
    return torch.equal(state_before, torch.get_rng_state())


def _digest(value) -> bytes:
    h = hashlib.blake2b(digest_size=20)

    def feed(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            h.update(f"{type(v).__name__}:{v!r};".encode())
        elif isinstance(v, (np.ndarray, np.generic)):
            a = np.ascontiguousarray(v)
            h.update(f"{type(v).__name__}:{a.dtype.str}:{a.shape}:".encode())
            h.update(a.tobytes())
        elif isinstance(v, (list, tuple)):
            h.update(f"{type(v).__name__}:{len(v)}[".encode())
            for x in v:
                feed(x)
            h.update(b"]")
        elif isinstance(v, dict):
            h.update(f"dict:{len(v)}{{".encode())
            for k, x in v.items():
                feed(k)
                feed(x)
            h.update(b"}")
        else:
            raise TypeError(type(v))

    feed(value)
    return h.digest()


def _copy(value):
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value  # numbers, strings, NumPy scalars (immutable)


REFERENCE = pytest.StashKey[Implementation]()  # kept for the whole run: a grading worker grades many


@pytest.fixture(scope="session")
def reference(pytestconfig):
    """The reference solutions, for hidden tests that compute expectations at test time."""
    if REFERENCE not in pytestconfig.stash:
        solutions = ROOT / "solutions"
        if not solutions.is_dir():
            pytest.fail("this test needs the reference solutions (instructor side only)", pytrace=False)
        pytestconfig.stash[REFERENCE] = Implementation(_MemoBackend(solutions))
    return pytestconfig.stash[REFERENCE]


@pytest.fixture(scope="module")
def stage(impl, request):
    """The stage module this test file covers (test_s08_causal_attention.py: s08_causal_attention)."""
    return impl.stage(stage_of(request.node.nodeid))
