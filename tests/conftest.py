"""pytest wiring of the graded suite: which implementation the tests reach, fixtures, devices, failure
reports, the stage summary.

    pytest                      # the stage modules (sNN_topic.py) of the folder the ini option impl names
    pytest --impl=PATH          # the stage modules of folder PATH
    pytest -m causal_attention  # one stage (stage_names.stage_command)

The ini option impl names this folder in a student's copy (pytest.ini), the reference solutions in
the kit (pyproject.toml).

The tests reach the implementation only through the ``impl`` fixture (``adapters.Implementation``).
It runs the stage modules in this process, unless a plugin answers ``pytest_attnkit_backend``
with a backend of its own: the grader's plugin (``grader.grading.plugin``) runs them in its sandbox.
"""
from __future__ import annotations

import hashlib
import re
import shlex
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from adapters import Implementation, LocalBackend
from checks import Call, error_text, explain_error
from stage_names import builds_on, register_markers, stage_command, stage_of, teaching_order

ROOT = Path(__file__).resolve().parent.parent  # the kit, or a student's release folder
FIXTURES = ROOT / "fixtures"
STAGE_TEST_FILES = tuple(sorted(p.name for p in Path(__file__).parent.glob("test_*.py") if stage_of(p.name)))


class BackendSpec:
    """The hook through which a grader runs the implementation somewhere else."""

    @pytest.hookspec(firstresult=True)
    def pytest_attnkit_backend(self, config, root):
        """A backend for the stage modules in folder ``root`` (``adapters.LocalBackend``'s ``run``), as a
        context manager that is closed once the session's tests are done; None: run them in this process."""


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(BackendSpec)


def pytest_configure(config):
    register_markers(config, Path(__file__).parent)  # each stage's marker, from the stage test files here


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def impl(pytestconfig):
    """The implementation under test (see --impl)."""
    root = Path(pytestconfig.getoption("impl"))
    backend = pytestconfig.hook.pytest_attnkit_backend(config=pytestconfig, root=root)
    if backend is None:
        yield Implementation(Witness(LocalBackend(root)))
        return
    with backend:
        yield Implementation(Witness(backend))


class Witness:
    """The implementation's backend, remembering the last operation that raised and its exception: the
    evidence that a reading of the error is checked against before a failure report shows it."""

    def __init__(self, backend):
        self.backend = backend
        self.failed = None  # (the exception, checks.Call)

    def run(self, op, module, **kwargs):
        __tracebackhide__ = True  # (a student's traceback goes from the test to their code)
        try:
            return self.backend.run(op, module, **kwargs)
        except Exception as exc:
            self.failed = (exc, Call(op, kwargs))
            raise

    def call_that_raised(self, exc):
        """The operation that raised ``exc``, or None when ``exc`` came from elsewhere (forgotten once asked)."""
        failed, self.failed = self.failed, None
        return failed[1] if failed is not None and failed[0] is exc else None


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
def stage(impl, request):
    """The stage module this test file covers (test_s08_causal_attention.py: s08_causal_attention)."""
    return impl.stage(stage_of(request.node.nodeid))


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


# ---------------------------------------------------------------- failure reports
#
# A failure's traceback goes from the test's line to the learner's code: the frames of the suite's
# support modules are hidden (``__tracebackhide__`` in adapters.py and checks.py), and so are those
# of nn.Module.__call__ between a call ``model(x)`` and the forward() it runs.

MODULE_CALL = ("_wrapped_call_impl", "_call_impl")  # nn.Module.__call__'s functions in torch/nn/modules/module.py


def _is_module_call(code) -> bool:
    return code.co_name in MODULE_CALL and code.co_filename == torch.nn.modules.module.__file__


def skip_module_calls(tb):
    """Unlink nn.Module.__call__'s frames from the traceback ``tb`` (an exception's own chain of frames,
    which is what pytest formats). The last frame, where the error was raised, always stays."""
    while tb is not None and tb.tb_next is not None:
        following = tb.tb_next
        if following.tb_next is not None and _is_module_call(following.tb_frame.f_code):
            tb.tb_next = following.tb_next
        else:
            tb = following


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure as a student reads it: without nn.Module's dispatch frames; when learner code raised (rather
    than computed wrong numbers), what the error usually means; a book test's failure in its context."""
    shown = item.config.getoption("tbstyle", "no") != "no"  # ("no" also without the terminal plugin: grading)
    if call.excinfo is not None and shown and not item.config.getoption("fulltrace", False):
        skip_module_calls(call.excinfo.tb)
    report = yield
    if report.failed and note_time_limit(item, report):  # see "time limits" below
        return report
    if report.failed and note_book_failure(item, call, report):  # see "book tests" below
        return report
    report.not_written_yet = _not_written_yet(item, call) if report.failed else None  # (for the stage summary)
    if report.not_written_yet and shown:
        # A stub's traceback says nothing its message does not: one line, where to write the code (a first
        # run of every stage on the stubs is then a few hundred lines, not thousands).
        entry = call.excinfo.traceback[-1]
        report.longrepr = f"{_shown(Path(entry.path))}:{entry.lineno + 1}: {call.excinfo.exconly()}"
        return report
    if report.failed and call.excinfo is not None and not call.excinfo.errisinstance(AssertionError):
        hints = explain_error(error_text(call.excinfo.typename, str(call.excinfo.value)),
                              _call_that_raised(item, call.excinfo.value),
                              getattr(getattr(item, "module", None), "ERROR_READINGS", None))
        if hints and hasattr(report.longrepr, "addsection"):
            text = "\n".join(hints)
            report.longrepr.addsection("Likely mistake", text)  # for the terminal
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:  # for one-line reports (grading feedback, -rf summaries)
                crash.message += f"\nLikely mistake: {text}"
    return report


def _call_that_raised(item, exc):
    """The operation on the implementation under test that raised ``exc`` (checks.Call), or None."""
    impl = item.funcargs.get("impl") if hasattr(item, "funcargs") else None
    witness = getattr(impl, "backend", None)
    return witness.call_that_raised(exc) if isinstance(witness, Witness) else None


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
    if stage_of(item.nodeid) in stages_out_of_time(item.config) and not _skipped_by_marks(item):
        pytest.fail(NOT_RUN, pytrace=False)


def _skipped_by_marks(item) -> bool:
    """Whether pytest skips ``item`` by its marks (a CUDA case without CUDA): it stays skipped, not failed,
    so that it counts for nothing either way. (This hook runs before pytest's own skipping hook.)"""
    return any(mark.name == "skip" or (mark.name == "skipif" and mark.args and mark.args[0] is True)
               for mark in item.iter_markers())


def _not_written_yet(item, call) -> str | None:
    """The stage whose module raised the NotImplementedError the check failed on, when it is a module of the
    implementation under test: a part not written yet there (each stub raises one, naming its function)."""
    if call.excinfo is None or not call.excinfo.errisinstance(NotImplementedError):
        return None
    raised_in = Path(call.excinfo.traceback[-1].path)
    if raised_in.parent != Path(item.config.getoption("impl")):
        return None
    return stage_of(f"test_{raised_in.stem}.py")


def pytest_runtest_teardown(item, nextitem):
    """After the last check, forget which stages ran out of time and which checks failed: a grading
    worker runs its one pytest session again for the next submission, which must start afresh."""
    if nextitem is None:
        stages_out_of_time(item.config).clear()
        failed_checks(item.config).clear()


# ---------------------------------------------------------------- book tests
#
# A `book` test (no points) builds a module right after torch.manual_seed and expects the book's
# printed numbers. They come out only if the module computes right AND creates its weights in the
# book's order; the test's hint speaks of the order, which is the cause only when the stage's other
# tests (they give the weights by name) pass. So those run first, and a book test that gets other
# numbers while some of them failed says to fix those first. (Grading runs without book tests.)

FAILED_CHECKS = pytest.StashKey[dict]()  # stage (sNN_topic) -> names of its failed non-book checks in this run


def failed_checks(config) -> dict:
    return config.stash.setdefault(FAILED_CHECKS, {})


def _is_book(item) -> bool:
    return item.get_closest_marker("book") is not None


def pytest_collection_modifyitems(items):
    """Each stage's book tests run after its other tests (the order is otherwise kept)."""
    first = {}  # stage -> index of its first test
    for index, item in enumerate(items):
        first.setdefault(stage_of(item.nodeid), index)

    def place(numbered):
        index, item = numbered
        stage = stage_of(item.nodeid)
        return (first[stage] if stage else index, _is_book(item))

    items[:] = [item for _, item in sorted(enumerate(items), key=place)]


def note_book_failure(item, call, report) -> bool:
    """Called for every failed report not explained by the time limit: remember a stage's failed
    non-book checks, and when a book test gets other numbers after some of them failed, say so in
    place of its message (its hint would send the student the wrong way). True when done here."""
    stage = stage_of(item.nodeid)
    if stage is None:
        return False
    failed = failed_checks(item.config).setdefault(stage, [])
    if not _is_book(item):
        failed.append(item.name)
        return False
    if not failed or call.when != "call" or not call.excinfo.errisinstance(AssertionError):
        return False  # an error (a stub, a crash) speaks for itself; after passing checks the hint holds
    numbers = str(call.excinfo.value).splitlines()[0]
    others = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    report.longrepr = (
        f"{stage}: not the book's numbers: {numbers}\n"
        f"Fix this stage's other failures first ({others}). This check (no points) builds the module after "
        "torch.manual_seed and expects the book's printed numbers: that needs a module that computes right "
        "with given weights, and only then does the order in which it creates its weights matter."
    )
    return True


# ---------------------------------------------------------------- summary

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Per stage: how many tests pass, and which stage to work on next, in what words. Written last, after
    pytest's own summaries (the reasons for skipped CUDA cases ...), right above the line of counts."""
    yield
    stage_summary(terminalreporter, config)


def stage_summary(terminalreporter, config):
    counts = defaultdict(lambda: [0, 0])  # stage -> [passed, total]
    failing = {}  # failing stage -> True while every failure is its own stub's NotImplementedError
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") != "call" and outcome != "error":
                continue
            stage = stage_of(report.nodeid)
            if stage:
                counts[stage][0] += outcome == "passed"
                counts[stage][1] += 1
                if outcome != "passed":
                    own = getattr(report, "not_written_yet", None) == stage
                    failing[stage] = failing.get(stage, True) and own
    if not counts:
        return
    impl = Path(config.getoption("impl"))
    option = _impl_option(config, impl)

    def command(stage=None):
        return stage_command(stage, option) if stage else f"pytest --impl={option}" if option else "pytest"

    tr = terminalreporter
    tr.section("attention-kit stages")
    tr.write_line(f"implementation: {impl}")
    unchecked = {}  # failing stage -> the stages it builds on that this run did not check
    for stage in sorted(counts, key=teaching_order):
        passed, total = counts[stage]
        line = f"  {'    ' if stage in failing else 'done'}  {stage:<28} {passed:>3}/{total:<3} tests pass"
        for earlier in _builds_on(impl, stage) if stage in failing else []:  # its failures may be the earlier one's
            if earlier in failing:
                line += f"  (builds on {earlier}: make that pass first)"
            elif earlier not in counts:
                line += f"  (builds on {earlier}, not checked in this run)"
                unchecked.setdefault(stage, []).append(earlier)
        tr.write_line(line)
    todo = min(failing, key=teaching_order, default=None)
    if todo is None:
        every = len(counts) == len(STAGE_TEST_FILES)
        tr.write_line("Every stage passes." if every else
                      f"Every stage checked passes ({len(counts)} of {len(STAGE_TEST_FILES)}: `{command()}` "
                      "checks all).")
        return
    module = _shown(impl / f"{todo}.py")
    for earlier in unchecked.get(todo, []):
        tr.write_line(f"First: run `{command(earlier)}`: {todo} builds on {earlier}, whose mistakes fail "
                      f"{todo}'s tests too.")
    if failing[todo]:  # still a stub
        tr.write_line(f"Next: stage {todo}: fill in the TODOs of {module},\n"
                      f"      then run `{command(todo)}` (the failures above say what is expected).")
    else:
        tr.write_line(f"Next: stage {todo}: fix {module},\n"
                      f"      then run `{command(todo)}` (the failures above say what is wrong).")


def _impl_option(config, impl: Path) -> str | None:
    """What a suggested command must add so that it tests ``impl`` again: None when a bare `pytest` tests it
    (the ini option impl names it), else ``impl`` as the student would type it, quoted for the shell."""
    if impl == (ROOT / config.getini("impl")).resolve():
        return None
    return shlex.quote(_shown(impl))


def _builds_on(impl: Path, stage) -> list[str]:
    """The stages whose modules the student's module of ``stage`` imports."""
    try:
        return builds_on((impl / f"{stage}.py").read_text(errors="replace"))
    except OSError:  # missing: its tests say so
        return []


def _shown(path: Path) -> str:
    """``path`` as the student would type it: relative to the folder pytest runs in, when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
