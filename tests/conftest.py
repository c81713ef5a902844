"""pytest wiring: which implementation the tests reach, fixtures, devices, the stage summary.

    pytest                      # the reference solutions (the kit's default)
    pytest --impl exercises     # the stubs: everything fails, the summary says where to start
    pytest --impl PATH          # a folder laid out like exercises/ (same module file names)
    pytest -m causal_attention  # one stage
"""
from __future__ import annotations

import hashlib
import re
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters import Implementation, LocalBackend
from checks import explain_error

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # the kit, or a student's release folder
FIXTURES = ROOT / "fixtures"
STAGE_FILE = re.compile(r"test_(s\d\d_\w+)\.py$")


def pytest_ignore_collect(collection_path, config):
    """Do not even import the kit's own test files when the run cannot select their tests.

    They hold only ``kit`` tests (instructor side, some importing nbgrader): a student's run on
    another implementation, or a positive marker selection such as ``-m public``, never runs them,
    and importing them would double the student's test loop.
    """
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")) or STAGE_FILE.search(name):
        return None
    if config.impl_root != (ROOT / "solutions").resolve():
        return True
    expression = config.getoption("markexpr") or ""
    if expression and not re.search(r"\b(kit|slow|not)\b", expression):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """The kit's self-checks (marker ``kit``) concern the reference; skip them for other impls."""
    if config.impl_root == (ROOT / "solutions").resolve():
        return
    kit = [item for item in items if item.get_closest_marker("kit")]
    if kit:
        config.hook.pytest_deselected(items=kit)
        items[:] = [item for item in items if not item.get_closest_marker("kit")]


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def impl(request):
    """The implementation under test (see --impl and --isolate)."""
    config = request.config
    root = config.impl_root
    if not config.getoption("--isolate"):
        yield Implementation(LocalBackend(root))
        return
    from grader.sandbox import IsolatedBackend, Limits

    given = {"check_seconds": config.getoption("--time-limit"), "budget_seconds": config.getoption("--time-budget")}
    limits = Limits(**{name: value for name, value in given.items() if value is not None})
    # The session's sandbox (a grading worker's serves all its submissions): this submission
    # gets boxes of its own from it.
    with IsolatedBackend(root, limits, sandbox=config.attnkit_sandbox) as backend:
        yield Implementation(backend)
    if backend.confinement is not None:
        config.attnkit_confinement = backend.confinement.record()  # for the grading record


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Under --isolate, start the sandbox now: its torch import overlaps pytest's own collection. (A
    grading worker brings a sandbox of its own, kept for all its submissions.)"""
    config = session.config
    if config.getoption("--isolate") and getattr(config, "attnkit_sandbox", None) is None:
        from grader.sandbox import Sandbox

        config.attnkit_sandbox = Sandbox()
        config.attnkit_sandbox.start_soon()
        config.add_cleanup(config.attnkit_sandbox.close)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Each test is one check: under --isolate its time limit counts from here, once its fixtures
    are set up (starting the sandbox is not the learner's time). A hook rather than an autouse
    fixture: pytest sets up fixtures that ask for ``request`` afresh for every test."""
    impl = item.funcargs.get("impl") if hasattr(item, "funcargs") else None
    if impl is not None and item.config.getoption("--isolate"):
        impl.backend.start_check()


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


_reference_backends = {}  # solutions folder -> _MemoBackend, for every session of this process


@pytest.fixture(scope="session")
def reference():
    """The reference solutions, for hidden tests that compute expectations at test time."""
    solutions = ROOT / "solutions"
    if not solutions.is_dir():
        pytest.fail("this test needs the reference solutions (instructor side only)", pytrace=False)
    backend = _reference_backends.get(solutions)
    if backend is None:
        backend = _reference_backends[solutions] = _MemoBackend(solutions)
    return Implementation(backend)


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


_fixture_cache = {}  # path -> ((mtime_ns, size), arrays): a grading worker reads each file once


def load_fixture(visibility, stage):
    path = FIXTURES / visibility / f"{stage}.npz"
    if not path.is_file():
        pytest.fail(f"fixture file {path} is missing (regenerate with `attnkit fixtures`)", pytrace=False)
    stat = path.stat()
    version = (stat.st_mtime_ns, stat.st_size)
    cached = _fixture_cache.get(path)
    if cached is None or cached[0] != version:
        with np.load(path, allow_pickle=False) as data:
            cached = _fixture_cache[path] = (version, {k: data[k] for k in data.files})
    return Fixture({k: v.copy() for k, v in cached[1].items()})  # a test may change its arrays


@pytest.fixture(scope="module")
def stage(impl, request):
    """The stage module this test file covers (test_s08_causal_attention.py: s08_causal_attention)."""
    return impl.stage(stage_of(request.node.nodeid))


@pytest.fixture(scope="module")
def public_fx(request):
    """The public fixture of the stage this test file covers (the book's running example)."""
    return load_fixture("public", stage_of(request.node.nodeid))


@pytest.fixture(scope="module")
def hidden_fx(request):
    """The hidden (instructor-only) fixture of this test file's stage."""
    return load_fixture("hidden", stage_of(request.node.nodeid))


def stage_of(nodeid) -> str | None:
    match = STAGE_FILE.search(str(nodeid).split("::")[0])
    return match.group(1) if match else None


@pytest.fixture
def rng(request):
    """A NumPy generator for randomized cases: fresh each run (--seed), distinct per test."""
    return np.random.default_rng([request.config.case_seed, zlib.crc32(request.node.nodeid.encode())])


GPU_SKIP = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA case: no CUDA device on this machine (its CPU twin ran; run on a GPU to check this one)",
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU_SKIP])])
def device(request):
    """Every batched multi-head test runs on the CPU, and again on CUDA when there is one."""
    return request.param


# ---------------------------------------------------------------- failures that are errors

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """When learner code raised (rather than computed wrong numbers), say what the error usually means."""
    report = yield
    if report.failed and note_time_limit(item, report):  # see "time limits" below
        return report
    if report.failed and call.excinfo is not None and not call.excinfo.errisinstance(AssertionError):
        hints = explain_error(str(report.longrepr))
        marker = item.get_closest_marker("hint")
        if marker:
            hints.append(marker.args[0])
        if hints and hasattr(report.longrepr, "addsection"):
            text = "\n".join(hints)
            report.longrepr.addsection("Likely mistake", text)  # for the terminal
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:  # for one-line reports (grading feedback, -rf summaries)
                crash.message += f"\nLikely mistake: {text}"
    return report


# ---------------------------------------------------------------- time limits
#
# Each check has a time limit (pytest-timeout's `timeout`: the course's test_timeout in a release's
# pytest.ini, `-o timeout=...` when grading). A check that runs past it is stopped and fails; this
# section says so in words a student understands, and lets the rest of that stage's checks fail at
# once instead of each waiting out the limit again.

PYTEST_TIMEOUT = re.compile(r"Timeout \(>([0-9.]+)s\) from pytest-timeout")
TIME_LIMIT = re.compile(r"time limit|pytest-timeout")  # our wording, pytest-timeout's and the grading sandbox's
NOT_RUN = "not run: an earlier check of this stage hit the time limit"
OUT_OF_TIME = pytest.StashKey[set]()  # stages (sNN_topic) with a check that hit the time limit in this run


def stages_out_of_time(config) -> set:
    return config.stash.setdefault(OUT_OF_TIME, set())


def time_limit_message(stage, seconds) -> str:
    """What a student reads when a check of ``stage`` was stopped at the time limit."""
    return (
        f"stage {stage}: this check was stopped after {seconds:g} s (the time limit per check): look for a loop "
        f"that never ends in {stage}.py or a module it imports (a `while` whose condition never becomes false, "
        "a loop at the top of the module), or for very slow code (keep the work in vectorized torch operations)."
    )


def _limit_per_check(config):
    """Seconds per check (pytest-timeout's --timeout or ini ``timeout``), or None without a limit."""
    try:
        return float(config.getoption("timeout", None) or config.getini("timeout") or 0) or None
    except (ValueError, TypeError):  # pytest-timeout not installed, or an unreadable value
        return None


def note_time_limit(item, report) -> bool:
    """Called for every failed report. When the check ran out of time, remember its stage, and word
    pytest-timeout's message for the student, in the crash message too (grading feedback and -rf
    summaries show only that line). True when the failure is fully explained here (pytest-timeout's
    stop, or a check not run because of an earlier one), so no other hint applies."""
    stage = stage_of(item.nodeid)
    if stage is None:
        return False  # the kit's own tests keep pytest-timeout's message
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    limit = _limit_per_check(item.config)
    # A check that took the whole limit counts too: its code may have swallowed pytest-timeout's
    # exception (a bare `except:`) and failed some other way afterwards.
    if not (TIME_LIMIT.search(text) or (limit and report.when == "call" and report.duration >= 0.9 * limit)):
        return False
    stages_out_of_time(item.config).add(stage)
    stopped = PYTEST_TIMEOUT.search(text)
    if stopped:
        message = time_limit_message(stage, float(stopped.group(1)))
        if crash is not None:
            crash.message = message
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("Time limit", message + "\nThe traceback above ends at the line that was "
                                       "running when the check was stopped.")
        return True
    return NOT_RUN in text


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """After a check of a stage hit the time limit, its other checks fail at once. A module that
    loops at import would otherwise cost the limit once per check: a failed import is not cached."""
    if stage_of(item.nodeid) in stages_out_of_time(item.config):
        pytest.fail(NOT_RUN, pytrace=False)


def pytest_runtest_teardown(item, nextitem):
    """After the last check, forget which stages ran out of time: a grading worker runs its one
    pytest session again for the next submission, which must start afresh."""
    if nextitem is None:
        stages_out_of_time(item.config).clear()


# ---------------------------------------------------------------- summary

def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Per stage: how many tests pass, and which stage to work on next."""
    counts = defaultdict(lambda: [0, 0])  # stage -> [passed, total]
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") != "call" and outcome != "error":
                continue
            stage = stage_of(report.nodeid)
            if stage:
                counts[stage][0] += outcome == "passed"
                counts[stage][1] += 1
    if not counts:
        return
    tr = terminalreporter
    tr.section("attention-kit stages")
    tr.write_line(f"implementation: {config.impl_root}")
    todo = None
    for stage in sorted(counts):
        passed, total = counts[stage]
        mark = "done" if passed == total else "    "
        tr.write_line(f"  {mark}  {stage:<28} {passed:>3}/{total:<3} tests pass")
        if todo is None and passed < total:
            todo = stage
    if todo:
        tr.write_line(
            f"Next: stage {todo}. Open {todo}.py, fill in its TODOs, then run "
            f"`pytest tests/test_{todo}.py` (the failures above say what is expected)."
        )
    else:
        tr.write_line("Every stage passes.")
