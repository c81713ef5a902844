"""Proxies, in a box, of the stages the graded stage builds on: their behaviour, never their code.

Part of the confined side (``child``): standard library only at the top (torch is imported where a proxy is made),
copied into the box's runtime folder.

Stage 9's wrapper imports stage 8's ``CausalAttention``. When stage 9 is graded, its box gets, in place of any stage-8
module, a module made here from a description of the reference's names (``proxy_module``; the grader's reference
process makes it): the modules it imports (torch, torch.nn) by name, and for each of its classes a ``torch.nn.Module``
subclass of the same name whose construction and methods are run by that process on plain data. An instance holds
real parameters and buffers under the reference's names (torch.nn leaves, each made without drawing random numbers),
so that loading a state dict, ``.to()``, ``.train()``, counting parameters or reading a head's ``W_query`` work as with
the reference; each call sends the instance's state, the arguments and torch's random state, and gets back the
result and the random state the reference left. Gradients do not flow through a proxy (no check needs them).
"""
from __future__ import annotations

import builtins

if __package__:  # the trusted side (grader.sandbox.reference_proxy)
    from .wire import decode, encode
else:  # the box's runtime folder, which child.py puts on the path while it imports its siblings
    from wire import decode, encode

TENSOR = "__torch__"  # a tensor as plain data: {"__torch__": [dtype name, array]}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
# torch.nn leaves a proxy may hold (the reference's submodules), made empty and filled with the reference's state.
LEAVES = ("Linear", "Dropout", "ModuleList", "ModuleDict", "Sequential", "LayerNorm", "RMSNorm", "Embedding",
          "Identity", "ReLU", "GELU", "SiLU", "Tanh", "Softmax")
ERRORS = ("TypeError", "ValueError", "RuntimeError", "IndexError", "KeyError", "AttributeError", "MemoryError",
          "NotImplementedError", "ZeroDivisionError", "AssertionError", "OverflowError", "PermissionError")
MAX_DEPTH = 16  # of a module tree sent


# ---------------------------------------------------------------- plain data and tensors, both ways

def to_plain(value, depth: int = 0):
    """Tensors (and parameters) as {"__torch__": [dtype, array]}, containers element by element; numbers, strings
    and NumPy values as they are. Anything else cannot reach the reference: TypeError."""
    import numpy
    import torch

    if depth > MAX_DEPTH:
        raise TypeError("arguments nested too deeply")
    if value is None or isinstance(value, (bool, int, float, str, numpy.ndarray, numpy.generic)):
        return value
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise TypeError(f"a tensor of {tensor.dtype} cannot be sent to the reference")
        array = (tensor.float() if name == "bfloat16" else tensor).contiguous().numpy()
        return {TENSOR: [name, array]}
    if isinstance(value, (list, tuple)):  # (a tuple's subclasses, torch.Size among them, as tuples)
        items = [to_plain(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: to_plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"a {type(value).__module__}.{type(value).__name__} cannot be sent to the reference: it runs "
                    "in another process, on tensors, numbers and strings")


def to_torch(value, depth: int = 0):
    """The inverse of ``to_plain``: {"__torch__": [dtype, array]} back to a tensor of that dtype."""
    import numpy
    import torch

    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if isinstance(value, dict) and set(value) == {TENSOR}:
        name, array = value[TENSOR] if isinstance(value[TENSOR], list) and len(value[TENSOR]) == 2 else (None, None)
        if name not in DTYPES or not isinstance(array, numpy.ndarray):
            raise ValueError("a malformed tensor")
        return torch.from_numpy(numpy.array(array)).to(getattr(torch, name))
    if isinstance(value, (list, tuple)):
        items = [to_torch(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: to_torch(v, depth + 1) for k, v in value.items()}
    return value


def module_state(module, depth: int = 0, seen=None) -> dict:
    """What a reference's method needs of an instance: for it and each submodule, its mode, plain attributes,
    parameters, buffers and tensor attributes (plain data)."""
    import torch

    seen = set() if seen is None else seen
    if depth > MAX_DEPTH or id(module) in seen:
        raise ValueError("a module that holds itself, or nested too deeply, cannot be sent to the reference")
    seen.add(id(module))
    public = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    return {
        "training": bool(module.training),
        "attributes": {k: v for k, v in public.items() if v is None or isinstance(v, (bool, int, float, str))},
        "tensors": {k: to_plain(v) for k, v in public.items() if isinstance(v, torch.Tensor)},
        "parameters": {k: to_plain(v) for k, v in module._parameters.items()},
        "buffers": {k: to_plain(v) for k, v in module._buffers.items()},
        "children": {k: module_state(c, depth + 1, seen) for k, c in module._modules.items() if c is not None},
    }


def fill(module, node: dict, depth: int = 0) -> None:
    """Give ``module`` (empty: no parameters, buffers or submodules yet) the state ``node`` describes, as the
    reference's construction left it (the reference process's description, ``describe`` there)."""
    import torch

    if depth > MAX_DEPTH:
        raise ValueError("a module tree nested too deeply")
    for name, value in node["attributes"].items():
        object.__setattr__(module, name, tuple(value) if isinstance(value, list) else value)
    for name, value in node["parameters"].items():
        module.register_parameter(name, None if value is None else torch.nn.Parameter(to_torch(value)))
    for name, value in node["buffers"].items():
        module.register_buffer(name, None if value is None else to_torch(value),
                               persistent=name not in node["non_persistent"])
    for name, value in node["tensors"].items():
        object.__setattr__(module, name, to_torch(value))
    for name, child in node["children"].items():
        if child["type"] not in LEAVES:
            raise ValueError(f"a reference's submodule of type {child['type']!r} cannot be rebuilt in the box")
        cls = getattr(torch.nn, child["type"])
        leaf = cls.__new__(cls)
        torch.nn.Module.__init__(leaf)
        fill(leaf, child, depth + 1)
        module.add_module(name, leaf)
    module.training = bool(node["training"])


def take_over(module, changed: dict) -> None:
    """What a reference's method changed of an instance's state (by module name: attributes, tensor attributes,
    parameters, buffers; ``reference_process.changed``), made this instance's."""
    import torch

    modules = dict(module.named_modules())
    for path, node in changed.items():
        sub = modules.get(path)
        if sub is None:
            continue
        for name, value in node["attributes"].items():
            object.__setattr__(sub, name, value)
        for name, value in node["tensors"].items():
            object.__setattr__(sub, name, to_torch(value))
        for name, value in node["parameters"].items():
            sub._parameters[name] = None if value is None else torch.nn.Parameter(to_torch(value))
        for name, value in node["buffers"].items():
            sub._buffers[name] = None if value is None else to_torch(value)


# ---------------------------------------------------------------- proxies

def proxy_module(stage: str, spec: dict, channel):
    """The module that stands in for the reference of ``stage`` (``spec``: what the reference process said of its
    names); ``channel``: the worker's channel (``worker_process.Channel``), through which its calls go."""
    import importlib
    import types

    module = types.ModuleType(stage)
    module.__file__ = f"<reference {stage}, run by the grader>"
    for name, entry in spec["names"].items():
        kind = entry.get("kind")
        if kind == "module":
            value = importlib.import_module(entry["module"])
        elif kind == "object":
            value = importlib.import_module(entry["module"])
            for part in entry["name"].split("."):
                value = getattr(value, part)
        elif kind == "class":
            value = proxy_class(stage, name, entry["methods"], channel)
        elif kind == "function":
            value = proxy_function(stage, name, channel)
        else:
            continue
        setattr(module, name, value)
    return module


def ask(channel, request: dict):
    """Send ``request`` (plain data, torch's random state added) to the reference through the grader; the value
    it answers (plain data), with torch's random state as the reference left it. An error of the reference is
    raised here, as the builtin exception of its type."""
    import torch

    blobs = []
    value = encode({**request, "rng": torch.get_rng_state().numpy()}, blobs)
    header, answers = channel.call({"stage": request["stage"], "request": value}, blobs)
    if not header.get("ok"):
        error = header.get("error") if isinstance(header.get("error"), dict) else {}
        kind = error.get("type") if error.get("type") in ERRORS else "RuntimeError"
        raise getattr(builtins, kind)(str(error.get("message", "the reference failed")))
    answer = decode(header.get("value"), answers)
    torch.set_rng_state(torch.from_numpy(answer["rng"].copy()))
    return answer["value"]


def proxy_class(stage: str, name: str, methods: list[str], channel) -> type:
    """A torch.nn.Module subclass named ``name`` (the reference's class of ``stage``): constructed by the
    reference process (the instance gets its parameters, buffers, submodules and attributes), each method in
    ``methods`` run there on the instance's state."""
    import torch

    def __init__(self, *args, **kwargs):
        torch.nn.Module.__init__(self)
        init = to_plain([list(args), kwargs])
        fill(self, ask(channel, {"stage": stage, "what": "construct", "name": name, "init": init}))
        object.__setattr__(self, "_reference_init", init)

    def method(method_name):
        def call(self, *args, **kwargs):
            init = getattr(self, "_reference_init", None)
            if init is None:
                raise TypeError(f"{name}.{method_name}() needs a {name} built by {name}(...)")
            answer = ask(channel, {"stage": stage, "what": "method", "name": name, "method": method_name,
                                   "init": init, "state": module_state(self), "args": to_plain([list(args), kwargs])})
            take_over(self, answer["changed"])
            return to_torch(answer["result"])

        call.__name__ = call.__qualname__ = method_name
        return call

    namespace = {"__init__": __init__, "__module__": stage, "__qualname__": name,
                 "__doc__": f"The reference {name} of {stage}, run by the grader."}
    namespace.update({method_name: method(method_name) for method_name in methods})
    return type(name, (torch.nn.Module,), namespace)


def proxy_function(stage: str, name: str, channel):
    """A function named ``name`` (the reference's function of ``stage``), run by the reference process."""
    def call(*args, **kwargs):
        return to_torch(ask(channel, {"stage": stage, "what": "function", "name": name,
                                      "args": to_plain([list(args), kwargs])}))

    call.__name__ = call.__qualname__ = name
    call.__module__ = stage
    return call
