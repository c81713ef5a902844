"""The reference process: it runs the reference of the stages a graded stage builds on, for that stage's proxies.

Part of the confined side (``child``): standard library only at the top, copied into the box's runtime folder.

The grader asks the template for it like a box (its own namespaces, fresh uid, limits: ``box_process.box_main``) but
with the role "reference": its first process, instead of forking workers, reads the reference sources the grader
sends (``load``), runs them into modules of their own names, says what each module holds (``describe``: names and
kinds, never code), then loads the learner's filter and answers requests until the grader closes its channel. It
never runs learner code, but every request it gets was written by learner code (the grader passes the proxies' calls
through unread): each is decoded as plain data and checked against what the reference itself builds before the
reference runs on it. An answer is plain data: the value (tensors as arrays), torch's random state after the call,
or an error's type and message; never a traceback, code or object. One submission's boxes share it; it dies with
the submission.
"""
from __future__ import annotations

import builtins
import ctypes
import time
import types

if __package__:  # the trusted side (grader.sandbox.reference_process)
    from .reference_proxy import LEAVES, to_plain, to_torch
    from .seccomp import confine_learner
    from .wire import clip, decode, encode, read_message, write_message
else:  # the box's runtime folder, which child.py puts on the path while it imports its siblings
    from reference_proxy import LEAVES, to_plain, to_torch
    from seccomp import confine_learner
    from wire import clip, decode, encode, read_message, write_message

REQUESTS, REPLIES = 3, 4  # its channel, as a box's
ERROR_CHARS = 1000  # of an error's message, sent back


def serve(lib: ctypes.CDLL) -> int:
    """Load the reference modules the grader sends, describe them, then answer requests until the channel closes."""
    message = read_message(REQUESTS)
    if message is None or message[0].get("cmd") != "load":
        return 0
    modules = load(message[0]["modules"])
    specs = {name: describe(module, modules) for name, module in modules.items()}
    write_message(REPLIES, {"kind": "loaded", "specs": specs})
    confine_learner(lib)  # what it computes on was chosen by learner code: nothing else may follow from it
    while True:
        message = read_message(REQUESTS)
        if message is None:
            return 0
        header, blobs = message
        started = time.process_time()
        out: list[bytes] = []
        try:
            request = decode(header.get("request"), blobs)
            if not isinstance(request, dict) or request.get("stage") != header.get("stage"):
                raise TypeError("a request for another stage than the grader allowed")
            value, rng = answer(modules, specs, request)
            reply = {"ok": True, "value": encode({"value": value, "rng": rng}, out)}
        except Exception as exc:  # the reference refused these inputs, or they were not what it takes
            out = []
            kind = type(exc).__name__ if getattr(builtins, type(exc).__name__, None) is type(exc) else "RuntimeError"
            reply = {"ok": False, "error": {"type": kind, "message": clip(str(exc), ERROR_CHARS)}}
        reply.update(kind="answer", call=header.get("call"), cpu=time.process_time() - started)
        write_message(REPLIES, reply, out)


def load(sources: list) -> dict[str, types.ModuleType]:
    """Run each reference source (name, text; in order: a module after those it imports) into a module of its
    name, importable by the ones after it."""
    import sys

    modules = {}
    for name, text in sources:
        module = types.ModuleType(name)
        module.__file__ = f"<reference {name}>"
        sys.modules[name] = module  # before it runs, as an import does
        exec(compile(text, module.__file__, "exec"), vars(module))
        modules[name] = module
    return modules


def describe(module: types.ModuleType, modules: dict) -> dict:
    """What a proxy of ``module`` needs (``reference_proxy.proxy_module``): each public name as a kind: a module
    (imported by name in the box), an object of another module (looked up there), a torch.nn.Module class of its
    own (with its public methods) or a function of its own (both run here). Constants are left out."""
    import torch

    names = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        origin = getattr(value, "__module__", None)
        if isinstance(value, types.ModuleType):
            names[name] = {"kind": "module", "module": value.__name__}
        elif origin == module.__name__ and isinstance(value, type) and issubclass(value, torch.nn.Module):
            names[name] = {"kind": "class", "methods": sorted(
                method for method, f in vars(value).items() if callable(f) and not method.startswith("_"))}
        elif origin == module.__name__ and isinstance(value, types.FunctionType):
            names[name] = {"kind": "function"}
        elif isinstance(origin, str) and origin not in modules and callable(value) and hasattr(value, "__qualname__"):
            names[name] = {"kind": "object", "module": origin, "name": value.__qualname__}
    return {"names": names}


def answer(modules: dict, specs: dict, request: dict) -> tuple:
    """Run what ``request`` asks of a reference: (its value as plain data, torch's random state after it).

    * {"what": "construct", "stage", "name", "init": [args, kwargs]}: build the class; its description;
    * {"what": "method", ..., "method", "init", "state", "args": [args, kwargs]}: the class built (without
      random numbers) from ``init`` and given ``state`` (``apply``), then its method called;
    * {"what": "function", "stage", "name", "args"}: the function called.

    Each runs from ``rng``, the caller's torch random state, and under torch.no_grad."""
    import numpy
    import torch

    if not isinstance(request, dict):
        raise TypeError("a request is a dict")
    stage, name, what = request.get("stage"), request.get("name"), request.get("what")
    entry = specs[stage]["names"].get(name, {}) if stage in specs and isinstance(name, str) else {}
    kind = "function" if what == "function" else "class"
    if entry.get("kind") != kind:
        raise TypeError(f"the reference has no {kind} {request.get('name')!r} to run")
    rng = request.get("rng")
    if not (isinstance(rng, numpy.ndarray) and rng.dtype == numpy.uint8 and rng.ndim == 1):
        raise ValueError("a malformed random state")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.set_rng_state(torch.from_numpy(rng.copy()))
        if what == "construct":
            args, kwargs = arguments(request.get("init"))
            value = description(vars(modules[stage])[name](*args, **kwargs))
        elif what == "method":
            method = request.get("method")
            if method not in entry["methods"]:
                raise TypeError(f"the reference {name} has no method {method!r} to run")
            instance = rebuilt(vars(modules[stage])[name], request.get("init"), request.get("state"))
            args, kwargs = arguments(request.get("args"))
            before = marks(instance)
            result = getattr(instance, method)(*args, **kwargs)
            value = {"result": to_plain(result), "changed": changed(instance, before)}
        elif what == "function":
            args, kwargs = arguments(request.get("args"))
            value = to_plain(vars(modules[stage])[name](*args, **kwargs))
        else:
            raise TypeError(f"unknown request {what!r}")
        rng = torch.get_rng_state().numpy()
    return value, rng


def arguments(value) -> tuple[list, dict]:
    """[args, kwargs] as sent (``reference_proxy.to_plain``), with tensors again."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], list) and isinstance(value[1], dict)
            and all(isinstance(k, str) for k in value[1])):
        raise TypeError("malformed arguments")
    return to_torch(value[0]), to_torch(value[1])


def description(module, root: bool = True) -> dict:
    """A built instance as plain data (``reference_proxy.fill`` rebuilds it): mode, plain attributes, tensor
    attributes, parameters, buffers (and which are not persistent), and submodules (torch.nn leaves only)."""
    import torch

    public = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}
    children = {}
    for name, child in module._modules.items():
        if child is None:
            continue
        if type(child).__name__ not in LEAVES or getattr(torch.nn, type(child).__name__, None) is not type(child):
            raise RuntimeError(f"the reference's submodule {name} ({type(child).__name__}) cannot be rebuilt in a box")
        children[name] = description(child, root=False)
    return {
        "type": None if root else type(module).__name__,
        "training": bool(module.training),
        "attributes": {k: v for k, v in public.items()
                       if v is None or isinstance(v, (bool, int, float, str))
                       or (isinstance(v, tuple) and all(isinstance(i, (int, float)) for i in v))},
        "tensors": {k: to_plain(v) for k, v in public.items() if isinstance(v, torch.Tensor)},
        "parameters": {k: to_plain(v) for k, v in module._parameters.items()},
        "buffers": {k: to_plain(v) for k, v in module._buffers.items()},
        "non_persistent": sorted(module._non_persistent_buffers_set),
        "children": children,
    }


def rebuilt(cls: type, init, state):
    """An instance of ``cls`` built from ``init`` (its random numbers drawn from a copy of the generator, then
    replaced: no random number of the caller's is used), given ``state``. (Built on the CPU: torch's meta device
    would need no memory, but costs ten times as long for the kit's small modules, and the state sent is as large.)"""
    import torch

    args, kwargs = arguments(init)
    with torch.random.fork_rng(devices=[]):
        instance = cls(*args, **kwargs)
    apply(instance, state, cls.__name__)
    return instance


def marks(module) -> dict:
    """What each part of ``module``'s state is now (``changed`` compares): for each of its modules (by name), each
    public attribute, parameter and buffer by identity, and each tensor's version (bumped by in-place writes)."""
    import torch

    def mark(value):
        return (id(value), value._version if isinstance(value, torch.Tensor) else None)

    return {path: {**{k: mark(v) for k, v in vars(sub).items() if not k.startswith("_") and k != "training"},
                   **{f"parameter {k}": mark(v) for k, v in sub._parameters.items()},
                   **{f"buffer {k}": mark(v) for k, v in sub._buffers.items()}}
            for path, sub in module.named_modules()}


def changed(module, before: dict) -> dict:
    """What a method changed of ``module``'s state since ``marks`` gave ``before`` (a cache it filled, a counter
    it moved), by module name, as ``reference_proxy.module_state`` sends state: the proxy takes it over, so that
    its next call starts from it, as the reference's own instance would."""
    import torch

    found = {}
    for path, sub in module.named_modules():
        was, now = before.get(path, {}), marks(sub)[""]
        node = {"attributes": {}, "tensors": {}, "parameters": {}, "buffers": {}}
        for key, mark in now.items():
            if was.get(key) == mark:
                continue
            if key.startswith("parameter "):
                node["parameters"][key[10:]] = to_plain(sub._parameters[key[10:]])
            elif key.startswith("buffer "):
                node["buffers"][key[7:]] = to_plain(sub._buffers[key[7:]])
            else:
                value = vars(sub)[key]
                if isinstance(value, torch.Tensor):
                    node["tensors"][key] = to_plain(value)
                elif value is None or isinstance(value, (bool, int, float, str)):
                    node["attributes"][key] = value
        if any(node.values()):
            found[path] = node
    return found


def apply(module, node, path: str, depth: int = 0) -> None:
    """Give ``module`` the state ``node`` describes (``reference_proxy.module_state``): every parameter, buffer and
    tensor attribute the reference has, of the same shape; its plain attributes where their type is kept; the
    mode; the same for each submodule. What the reference lacks is left out; what it has and ``node`` lacks is an
    error."""
    import torch

    if depth > 16 or not isinstance(node, dict):
        raise ValueError(f"{path}: malformed state")
    module.training = bool(node.get("training"))
    given = {key: node.get(key) if isinstance(node.get(key), dict) else {}
             for key in ("attributes", "tensors", "parameters", "buffers", "children")}

    def tensor(kind, name, like):
        if name not in given[kind]:
            raise ValueError(f"{path}.{name} is missing (the reference's has shape {tuple(like.shape)})")
        value = to_torch(given[kind][name])
        if not isinstance(value, torch.Tensor) or value.shape != like.shape:
            raise ValueError(f"{path}.{name} has shape {tuple(getattr(value, 'shape', ()))}; the reference's has "
                             f"{tuple(like.shape)}")
        return value

    for name, value in list(vars(module).items()):
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, torch.Tensor):
            object.__setattr__(module, name, tensor("tensors", name, value))
        elif name in given["attributes"] and (value is None or isinstance(value, (bool, int, float, str))):
            new = given["attributes"][name]
            if type(new) is type(value) or (type(value) is float and type(new) is int):
                object.__setattr__(module, name, new)
    for name, value in list(module._parameters.items()):
        if value is not None:
            module._parameters[name] = torch.nn.Parameter(tensor("parameters", name, value), requires_grad=False)
    for name, value in list(module._buffers.items()):
        if value is not None:
            module._buffers[name] = tensor("buffers", name, value)
    for name, child in module._modules.items():
        if child is not None:
            if name not in given["children"]:
                raise ValueError(f"{path}.{name} is missing")
            apply(child, given["children"][name], f"{path}.{name}", depth + 1)

