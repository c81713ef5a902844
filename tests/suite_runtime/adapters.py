"""The one door between the tests and an implementation.

Tests never import learner code. They ask an ``Implementation`` to run an
*operation* on one of its stage modules and get plain NumPy arrays back:

    stage = impl.stage("s08_causal_attention")
    out = stage.forward("CausalAttention", init, x, weights=state_dict)

Every operation (see ``OPS``) takes plain values (arrays, numbers, strings,
dicts and lists of them) and returns plain values. That is what lets grading
run the learner side in another process without touching a test: a backend
only has to carry ``(op, module, kwargs)`` one way and the result the other.
``LocalBackend`` runs operations in this process.

Weights are always injected by name (``load_state_dict``), never drawn in a
particular order, so an implementation may create its parameters however it
likes as long as it uses the documented names and shapes.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

from .stage_names import builds_on, is_stage_module

# Triton kernels (the kernels assignment) run in Triton's interpreter, on CPU tensors, where no CUDA device is. Triton
# reads TRITON_INTERPRET when it is first imported (its own library functions, tl.max and the like, are kernels made
# then), and torch imports it on its own (FlexAttention does): so it is chosen here, before any of that. A grading box
# has it set by the sandbox (grader/sandbox/template.py), which is why CUDA is not asked then: a process that forks
# boxes must not start CUDA.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# pytest leaves this module's frames out of a failure's traceback (it reads __tracebackhide__ in a frame's
# globals too): a student's traceback goes from the test's line straight to their own code, the error's
# message unchanged. `pytest --fulltrace` shows every frame.
__tracebackhide__ = True


class SubmissionError(Exception):
    """The submission cannot be run as laid out (missing file, syntax error, wrong names...)."""


# ---------------------------------------------------------------- conversions

def to_torch(value):
    """Plain values in: arrays become tensors, containers are converted element-wise."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))  # copy: the learner may write in place
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    return value


def to_plain(value, what):
    """Results out: tensors become float32/int/bool NumPy arrays; anything else is an error."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype != torch.float64:
            value = value.float()  # bfloat16/float16 have no NumPy twin
        return value.numpy()
    if isinstance(value, dict):
        return {k: to_plain(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(to_plain(v, f"{what}[{i}]") for i, v in enumerate(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise SubmissionError(
        f"{what} returned a {type(value).__module__}.{type(value).__name__}; "
        "return a torch.Tensor (keep the computation in torch so that gradients can flow)."
    )


# ---------------------------------------------------------------- loading

def load_stage_module(root: Path, name: str, provided: dict[str, types.ModuleType] | None = None):
    """Import ``root/name.py`` afresh, with its sibling stage modules taken from ``root`` too, except
    those in ``provided`` (stage module name -> the module to import under that name): grading gives a
    stage proxies of the reference versions of the stages it builds on (grader/sandbox/reference.py), so that a
    mistake in stage 8 costs no points on stage 9."""
    if not is_stage_module(name):
        raise ValueError(f"{name!r} is not a stage module name (sNN_topic)")
    provided = provided or {}
    if name in provided or not all(map(is_stage_module, provided)):
        raise ValueError(f"cannot provide {sorted(provided)} for {name!r}: other stage modules only")
    path = Path(root) / f"{name}.py"
    if not path.is_file():
        raise SubmissionError(
            f"{path.name} is missing from {Path(root).resolve()}: every stage lives in a module of that exact "
            "name, in this folder (start from its stub: the file the assignment gave you, or exercises/ in the kit)."
        )
    # Stage modules import each other by plain name (s09 uses s08's CausalAttention); make
    # those imports resolve inside this root, and leave no trace for the next root.
    for m in _stage_modules_loaded():
        del sys.modules[m]
    sys.path.insert(0, str(root))
    # New or changed files in root must be seen: drop root's cached finder (cheaper than
    # importlib.invalidate_caches(), which visits every path entry; imports only read root).
    sys.path_importer_cache.pop(str(root), None)
    try:
        sys.modules.update(provided)
        return _import_learner_module(name, path)
    finally:
        sys.path.remove(str(root))
        for m in _stage_modules_loaded():
            del sys.modules[m]


def _import_learner_module(name, path):
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except SubmissionError:
        raise  # (grading stands in a module the submission lacks with one that says what to submit)
    except Exception as exc:
        culprit = _with_null_bytes(path) if "null bytes" in str(exc) else None
        if culprit is not None:  # a SyntaxError with no line number (a ValueError in older Pythons)
            raise SubmissionError(
                f"{culprit.name} contains null bytes (characters of code 0), so Python cannot read it as source "
                "code: it was probably saved in a wrong encoding (UTF-16, for instance) or is corrupted. "
                "Open it in a text editor, save it again as UTF-8 text, and run the tests again."
            ) from None
        if isinstance(exc, SyntaxError):
            where = Path(exc.filename or path)  # path, or a stage module next to it that it imports
            raise SubmissionError(
                f"{where.name if where.parent == path.parent else path.name} has a syntax error on line "
                f"{exc.lineno}: {exc.msg}\n    {(exc.text or '').strip()}\n"
                "Fix it (python -m py_compile FILE shows the same error) and run the tests again."
            ) from None
        raise SubmissionError(
            f"importing {path.name} failed with {type(exc).__name__}: {exc}\n"
            "Code at the top level of a module runs on import; keep work inside functions and classes."
        ) from exc
    return module


def _with_null_bytes(path):
    """The file among ``path`` and the stage modules it imports (from its folder) that has null bytes, or None."""
    imported = [path.parent / f"{name}.py" for name in builds_on(path.read_text(errors="replace"))]
    return next((p for p in [path, *imported] if p.is_file() and b"\0" in p.read_bytes()), None)


def _stage_modules_loaded():
    return [m for m in list(sys.modules) if m[1:3].isdigit() and is_stage_module(m)]  # (a quick look first)


def lookup(module, attr):
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SubmissionError(
            f"{module.__name__}.py defines no {attr!r}: keep the names of the exercise file."
        ) from None


# ---------------------------------------------------------------- modules

def manual_seed(seed):
    """torch.manual_seed(seed) for the devices the checks use, the CPU and CUDA. (torch.manual_seed
    itself also queues a seed for every other device type with a formatted stack trace, a cost
    per call that adds up over the thousands of seeded operations of a grading run.)"""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def build(module, cls, init, seed=None):
    """Instantiate ``cls`` from keyword arguments, optionally right after manual_seed(seed)."""
    if seed is not None:
        manual_seed(seed)
    return lookup(module, cls)(**init)


def inject(model, weights, cls):
    """Load ``weights`` (a state_dict subset with the documented names) into ``model``.

    Buffers the model owns (the causal mask) are kept; every parameter must be given.
    A learner who stores weights differently can remap names with PyTorch's own
    ``_register_load_state_dict_pre_hook``.
    """
    weights = to_torch(weights)
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # size mismatches
        detail = "\n".join(line.strip() for line in str(exc).splitlines()[1:])
        raise SubmissionError(
            f"{cls}: a parameter has the wrong shape.\n{detail}\n"
            "nn.Linear(d_in, d_out).weight has shape (d_out, d_in); an nn.Parameter matrix "
            "used as x @ W has shape (d_in, d_out)."
        ) from None
    params = dict(model.named_parameters())
    missing = [k for k in result.missing_keys if k in params]
    names = set(result.unexpected_keys) | set(missing)
    if names and all(k.endswith(".bias") for k in names):
        # Only biases differ: say the rule for the layers that differ (the projections' biases follow qkv_bias,
        # out_proj's never does), never one for layers that are right.
        given = "the test gave biases yours lacks" if result.unexpected_keys else "yours has biases not given"
        layers, rules = {k.split(".")[-2] for k in names if "." in k}, []
        if layers & {"W_query", "W_key", "W_value", "W_qkv"}:
            rules.append("The biases of W_query, W_key and W_value (or a fused W_qkv) follow qkv_bias: "
                         "nn.Linear(..., bias=qkv_bias) for each of them.")
        if "out_proj" in layers:
            rules.append("out_proj always has a bias, whatever qkv_bias says: nn.Linear(d_out, d_out).")
        raise SubmissionError(f"{cls}: {given}: {sorted(names)}.\n" + " ".join(
            rules or ["Each layer's bias is as the stage's docstring says."]))
    if names:
        raise SubmissionError(f"{cls}: parameter names differ from the documented ones.\n"
                              f"  expected (given by the test): {sorted(weights)}\n"
                              f"  yours: {sorted(params)}\n" + "\n".join(names_differ(model, weights, params)))
    return model


def unregistered(model) -> list[str]:
    """Attributes of ``model`` (and its submodules) that hold modules in a plain list, tuple or dict: torch does not
    register those, so their parameters are neither the module's nor loaded, moved or trained with it."""
    found = []
    # (torch's own registry, vars(sub)["_modules"], is a dict of the registered ones: a module counts as unregistered
    # only where nn.Module does not reach it at all)
    registered = {id(m) for m in model.modules()}
    for prefix, sub in model.named_modules():
        for name, value in vars(sub).items():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            count = sum(isinstance(v, torch.nn.Module) and id(v) not in registered for v in values)
            if count:
                kind = type(value).__name__
                found.append(f"{prefix + '.' if prefix else ''}{name} (a plain {kind} of {count} modules)")
    return found


def names_differ(model, weights, params) -> list[str]:
    """What the learner's module lacks or has beyond the documented parameters, each said only where it holds."""
    lines = []
    lacking = sorted(k for k in weights if k not in params)
    extra = sorted(k for k in params if k not in weights)
    plain = unregistered(model)
    if plain:
        lines.append("Not registered as submodules (their parameters do not count): " + ", ".join(plain)
                     + ": hold modules in nn.ModuleList (or nn.ModuleDict), not a plain list or dict.")
    if lacking:
        lines.append(f"Yours lacks {lacking}: name them as the exercise's docstring does.")
    if extra:
        lines.append(f"Yours has parameters the exercise does not: {extra}: a parameter the computation needs is "
                     "one of the documented ones; remove or rename the others.")
    return lines


def place(model, x, device, dtype):
    dtype = getattr(torch, dtype)
    return model.to(device=device, dtype=dtype), x.to(device=device, dtype=dtype)


# ---------------------------------------------------------------- operations

def op_call(module, func, args=(), kwargs=None, seed=None):
    """Call a plain function of the stage module."""
    if seed is not None:
        manual_seed(seed)
    result = lookup(module, func)(*to_torch(list(args)), **to_torch(kwargs or {}))
    return to_plain(result, f"{func}()")


def op_forward(module, cls, init, x, weights=None, train=False, seed=None, device="cpu", dtype="float32"):
    """Build ``cls(**init)``, inject ``weights``, set train/eval mode and run it on ``x``."""
    model = build(module, cls, init, seed)
    if weights is not None:
        inject(model, weights, cls)
    model.train(train)
    model, x = place(model, to_torch(x), device, dtype)
    with torch.no_grad():
        out = model(x)
    return to_plain(out, f"{cls}.forward()")


def op_heads_forward(module, cls, init, x, weights):
    """Run a multi-head module and each of its ``heads`` on ``x``: (module output, [head outputs])."""
    model = inject(build(module, cls, init), weights, cls).eval()
    x = to_torch(x)
    heads = getattr(model, "heads", None)
    if heads is None:
        raise SubmissionError(f"{cls} has no attribute 'heads' (an nn.ModuleList of the heads).")
    with torch.no_grad():
        return to_plain(model(x), f"{cls}.forward()"), to_plain([h(x) for h in heads], f"{cls}.heads")


def op_inspect(module, cls, init):
    """Describe a freshly built module: parameters, buffers, submodules, shared storage."""
    model = build(module, cls, init)
    params_all = list(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict())
    return {
        "parameters": {n: list(p.shape) for n, p in model.named_parameters()},
        "parameter_count_with_duplicates": len(params_all),
        # (an empty tensor has no storage to share: its data_ptr is 0 whichever parameter it is, so it counts by
        # identity, as the same Parameter reused still does)
        "distinct_parameter_storages": len({p.data_ptr() if p.numel() else id(p) for _, p in params_all}),
        "buffers": {n: to_plain(b, n) for n, b in model.named_buffers()},
        "persistent_buffers": sorted(n for n, _ in model.named_buffers() if n in persistent),
        "modules": {n: type(m).__name__ for n, m in model.named_modules() if n},
        "dropout_p": {n: m.p for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout)},
        "unregistered": unregistered(model),
    }


def op_transfer_v2_to_v1(module, d_in, d_out, v2_weights, x):
    """Build v1 and v2, inject v2's weights, call transfer_weights_v2_to_v1; return v1's state and output."""
    sa_v2 = inject(lookup(module, "SelfAttention_v2")(d_in, d_out), v2_weights, "SelfAttention_v2")
    sa_v1 = lookup(module, "SelfAttention_v1")(d_in, d_out)
    lookup(module, "transfer_weights_v2_to_v1")(sa_v2, sa_v1)
    with torch.no_grad():
        out = sa_v1(to_torch(x))
    state = {k: v for k, v in sa_v1.state_dict().items()}
    return to_plain(state, "SelfAttention_v1.state_dict()"), to_plain(out, "SelfAttention_v1.forward()")


class Allocations(torch.overrides.TorchFunctionMode):
    """Watches every torch function and tensor method called while active (a public hook of torch's):
    the largest tensor any of them returned, and the names of the functions called. That is how a
    test sees what an implementation materialises (a full num_tokens x num_tokens score matrix, say)
    without reading its source."""

    def __init__(self):
        super().__init__()
        self.largest, self.functions = 0, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.functions.add(getattr(func, "__name__", str(func)))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


@contextlib.contextmanager
def peak_memory(device):
    """The most bytes torch held allocated on ``device`` at once inside the block, beyond what it held at the
    block's start: yields a dict whose "bytes" is set when the block ends. On CUDA, the caching allocator's
    own count (``torch.cuda.max_memory_allocated``); on the CPU, every allocation and release of torch's CPU
    allocator, as its profiler records them while active (slow to start, once per process: CPU checks only)."""
    held = {"bytes": None}
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield held
        held["bytes"] = torch.cuda.max_memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        yield held
    held["bytes"] = cpu_peak_bytes(recorded)


def cpu_peak_bytes(recorded) -> int:
    """The largest total of CPU memory allocated and not yet released during a profile (``torch.profiler``
    with ``profile_memory=True``): its allocation events in time order, releases of memory allocated
    before it began left out."""
    from torch._C._profiler import _EventType  # (what torch's own memory profiler reads too)

    events, nodes = [], list(reversed(recorded.profiler.kineto_results.experimental_event_tree()))
    while nodes:  # in the tree's order, which the sort by time below keeps among events of the same time
        node = nodes.pop()
        nodes.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields))
    sizes, held, peak = {}, 0, 0
    for _, event in sorted(events, key=lambda e: e[0]):
        if event.alloc_size > 0:
            sizes[event.ptr] = event.alloc_size
            held += event.alloc_size
            peak = max(peak, held)
        elif event.ptr in sizes:
            held -= sizes.pop(event.ptr)
    return peak


def op_session(module, cls=None, init=None, weights=None, steps=(), train=False, seed=None, device="cpu",
               dtype="float32"):
    """Build ``cls(**init)`` (if given), inject ``weights``, then run ``steps`` in order, returning one
    result per step. A step is a dict:

    * ``{"method": name, "args": [...], "kwargs": {...}}``: ``model.name(*args, **kwargs)`` (no grad);
    * ``{"function": name, "args": [...], "kwargs": {...}, "model": True}``: the module's function
      ``name``, given the model first when ``model`` is true;
    * ``{"get": name}``: the model's attribute ``name`` (a tensor, a number or None);
    * ``"measure": True`` in a method or function step: the result becomes ``{"result": ...,
      "largest": numel of the largest tensor a torch function returned, "functions": [names called],
      "peak_bytes": the most memory the step held on ``device`` beyond what was held at its start
      (``peak_memory``), or None unless the step also has ``"peak_memory": True``}``.

    Arrays go to ``device`` and, if floating point, to ``dtype``. Each step's result is converted as
    soon as it is made (a method may return a tensor it later changes in place)."""
    model = None
    if cls is not None:
        model = build(module, cls, init or {}, seed)
        if weights is not None:
            inject(model, weights, cls)
        model.train(train)
        model = model.to(device=device, dtype=getattr(torch, dtype))
    elif seed is not None:
        manual_seed(seed)

    def placed(value):
        """Tensors (from to_torch) moved to ``device``, the floating-point ones in ``dtype``."""
        if isinstance(value, torch.Tensor):
            return value.to(device=device, dtype=getattr(torch, dtype) if value.is_floating_point() else None)
        if isinstance(value, dict):
            return {k: placed(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(placed(v) for v in value)
        return value

    results = []
    for step in steps:
        if "get" in step:
            if model is None or not hasattr(model, step["get"]):
                raise SubmissionError(f"{cls or module.__name__} has no attribute {step['get']!r}: keep the names "
                                      "the exercise's docstring gives.")
            results.append(to_plain(getattr(model, step["get"]), f"{cls}.{step['get']}"))
            continue
        args, kwargs = placed(to_torch(list(step.get("args", ())))), placed(to_torch(dict(step.get("kwargs", {}))))
        if "method" in step:
            what = f"{cls}.{step['method']}()"
            func = getattr(model, step["method"], None)
            if not callable(func):
                raise SubmissionError(f"{cls} has no method {step['method']!r}: keep the names the exercise's "
                                      "docstring gives.")
        else:
            func, what = lookup(module, step["function"]), f"{step['function']}()"
            if step.get("model"):
                args = [model, *args]
        watch = Allocations() if step.get("measure") else contextlib.nullcontext()
        peak = peak_memory(device) if step.get("peak_memory") else contextlib.nullcontext({"bytes": None})
        with torch.no_grad(), watch, peak as held:
            result = func(*args, **kwargs)
        result = to_plain(result, what)  # (after the peak's read: a bfloat16 result is copied to float32 here)
        if step.get("measure"):
            result = {"result": result, "largest": watch.largest, "functions": sorted(watch.functions),
                      "peak_bytes": held["bytes"]}
        results.append(result)
    return results


def op_grad(module, func, args, grad_output, kwargs=None, device="cpu", dtype="float32"):
    """Call the module's function ``func`` on ``args`` with autograd on, every floating-point array among them a
    leaf that requires grad (on ``device``, in ``dtype``), and backpropagate ``grad_output`` from its output:
    (the output, [the gradient of each argument, None for those that are not floating-point arrays]). A function
    whose output does not reach its inputs' gradients returns None for them (it made no graph)."""
    dtype_ = getattr(torch, dtype)
    leaves = []
    for arg in to_torch(list(args)):
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            arg = arg.to(device=device, dtype=dtype_).requires_grad_(True)
        elif isinstance(arg, torch.Tensor):
            arg = arg.to(device=device)
        leaves.append(arg)
    with torch.enable_grad():
        out = lookup(module, func)(*leaves, **to_torch(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            raise SubmissionError(f"{func}() returned a {type(out).__name__}; it must return one torch.Tensor")
        if out.requires_grad:
            out.backward(to_torch(grad_output).to(device=device, dtype=out.dtype))
    grads = [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None for leaf in leaves]
    return to_plain(out, f"{func}()"), to_plain(grads, f"the gradients of {func}()")


def op_timed(module, func, args, kwargs=None, device="cuda", dtype="float32", repeat=10):
    """Run the module's function ``func`` ``repeat`` times on the same inputs (on ``device``, in ``dtype``),
    waiting for the device after the last; returns its last result. What it costs is measured by the caller, on
    its own clock, around the whole operation (tests/suite_plugin/speed.py): a time this process reported could
    be anything it likes."""
    dtype_ = getattr(torch, dtype)
    placed = [a.to(device=device, dtype=dtype_ if a.is_floating_point() else None) if isinstance(a, torch.Tensor)
              else a for a in to_torch(list(args))]
    function, kwargs = lookup(module, func), to_torch(kwargs or {})
    with torch.no_grad():
        for _ in range(max(1, int(repeat))):
            result = function(*placed, **kwargs)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    return to_plain(result, f"{func}()")


def interpreted_errors_unwrapped(run):
    """``run`` with an error raised inside a Triton kernel that Triton's interpreter ran (it wraps each in its own
    InterpreterError, whose message is the error's repr) raised as the error itself, with its traceback, which ends
    at the kernel's line: a student reads the kernel's own error, and a stub's NotImplementedError stays one."""
    def unwrapped(module, **kwargs):
        try:
            return run(module, **kwargs)
        except Exception as exc:
            cause = exc
            while type(cause).__name__ == "InterpreterError" and isinstance(cause.__cause__, Exception):
                cause = cause.__cause__
            if cause is exc:
                raise
            raise cause.with_traceback(cause.__traceback__) from None

    unwrapped.__name__ = unwrapped.__qualname__ = run.__name__
    unwrapped.__doc__ = run.__doc__
    return unwrapped


def importable(op):
    """``op`` run with its stage module importable by name, as a module imported the usual way is, and no longer
    afterwards (load_stage_module leaves no trace between roots). torch.compile needs it: tracing a function it
    imports the function's module by name to guard the globals it reads, and FlexAttention (stage f04) traces the
    learner's score_mod and mask_mod that way even when it runs eagerly."""
    def run(module, **kwargs):
        name = module.__name__
        before = sys.modules.get(name)
        sys.modules[name] = module
        try:
            return op(module, **kwargs)
        finally:
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before

    run.__name__ = run.__qualname__ = op.__name__
    run.__doc__ = op.__doc__
    return run


OPS = {name: interpreted_errors_unwrapped(importable(op)) for name, op in {
    "call": op_call,
    "session": op_session,
    "forward": op_forward,
    "heads_forward": op_heads_forward,
    "inspect": op_inspect,
    "transfer_v2_to_v1": op_transfer_v2_to_v1,
    "grad": op_grad,
    "timed": op_timed,
}.items()}


# ---------------------------------------------------------------- front end

class LocalBackend:
    """Runs operations in this process (for students, the kit's own CI and the reference)."""

    def __init__(self, root):
        self.root = Path(root)
        self._modules = {}

    def run(self, op, module, **kwargs):
        if module not in self._modules:
            try:
                self._modules[module] = load_stage_module(self.root, module)
            except SubmissionError as exc:
                self._modules[module] = exc
        loaded = self._modules[module]
        if isinstance(loaded, SubmissionError):
            raise SubmissionError(str(loaded))
        return OPS[op](loaded, **kwargs)


class Stage:
    """One stage module of an implementation. ``stage.fn(*arrays)`` calls function ``fn``."""

    def __init__(self, backend, module):
        self._backend, self.module = backend, module

    def __getattr__(self, func):
        if func.startswith("_"):
            raise AttributeError(func)

        def call(*args, seed=None, **kwargs):
            return self._backend.run("call", self.module, func=func, args=args, kwargs=kwargs, seed=seed)

        return call

    def forward(self, cls, init, x, weights=None, **options):
        return self._backend.run("forward", self.module, cls=cls, init=init, x=x, weights=weights, **options)

    def heads_forward(self, cls, init, x, weights):
        return self._backend.run("heads_forward", self.module, cls=cls, init=init, x=x, weights=weights)

    def inspect(self, cls, init):
        return self._backend.run("inspect", self.module, cls=cls, init=init)

    def session(self, cls=None, init=None, weights=None, steps=(), **options):
        """Build a module and run ``steps`` on it (``op_session``): one result per step."""
        return self._backend.run("session", self.module, cls=cls, init=init, weights=weights, steps=list(steps),
                                 **options)

    def run(self, op, **kwargs):
        return self._backend.run(op, self.module, **kwargs)


class Implementation:
    """A directory of stage modules (solutions/, exercises/ or a submission), reached via a backend."""

    def __init__(self, backend):
        self.backend = backend

    def stage(self, module):
        return Stage(self.backend, module)
