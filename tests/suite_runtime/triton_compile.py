"""Compiling a Triton kernel for a GPU inside a grading box: nothing run, nothing written, nothing outside memory.

A box's filter lets learner code run no program, create no file and make no anonymous memory file (issue 33: memory
that no address-space limit counts). Triton's GPU compile, left alone, does all three: it caches every stage of a
kernel in files under ``~/.triton/cache``, runs ``ptxas`` to turn PTX into a cubin, and asks ``ptxas`` its version.
``install()`` takes each of them away with Triton's own knobs, so that a compile in a box needs only the CPU and the
box's own address space (which ``RLIMIT_AS`` counts):

* ``MemoryCache`` (Triton's ``TRITON_CACHE_MANAGER`` knob) keeps every artefact as bytes in this process. The paths
  it gives Triton are names only (``memory:<hash>/<file>``); ``CompiledKernel`` is taught to read them from here.
* The ``cubin`` stage hands the PTX itself on (``add_stages_inspection_hook``): the CUDA driver's
  ``cuModuleLoadData`` compiles PTX in-process, with the same back end as ``ptxas``.
* ``ptxas``'s version is given (``TRITON_MOCK_PTX_VERSION``) by the trusted side, which asked it before any box.

What is proven without a GPU (the tamper entry ``k-compile-to-ptx``): a kernel compiles down to PTX for an H100 in a
box under the learner's filter. Loading and launching it need a GPU: see ``docs/kernels-sandbox.md``.
"""
from __future__ import annotations

import json
import os
from collections import namedtuple

PREFIX = "memory:"
_ARTEFACTS: dict[str, bytes] = {}  # "memory:<hash>/<file>" -> the artefact; lives and dies with this process
_GROUPS: dict[str, dict[str, str]] = {}  # "memory:<hash>/<file>.json" -> {file: name of its artefact}
MemoryCache: type | None = None  # made by install()


def _name(key: str, filename: str) -> str:
    return f"{PREFIX}{key}/{filename}"


def _read(name: str) -> bytes:
    return _ARTEFACTS[name]


class _MemoryCache:
    """Triton's cache manager, in this process's memory: ``put`` keeps the bytes, ``get_file`` answers by name.
    (``install()`` makes it a subclass of Triton's ``CacheManager`` as ``MemoryCache``: importing Triton here would
    fix its interpreter mode before ``install()`` chose it.)"""

    def __init__(self, key, override=False, dump=False):
        self.key = key

    def get_file(self, filename):
        name = _name(self.key, filename)
        return name if name in _ARTEFACTS else None

    def put(self, data, filename, binary=True):
        name = _name(self.key, filename)
        _ARTEFACTS[name] = data if isinstance(data, bytes) else str(data).encode()
        return name

    def get_group(self, filename):
        return _GROUPS.get(_name(self.key, filename))

    def put_group(self, filename, group):
        _GROUPS[_name(self.key, filename)] = dict(group)


def _ptx_for_the_driver(*args):
    """Triton's stages hook: asked with no argument, it names itself (part of the cache key); then it replaces the
    ``cubin`` stage by the PTX, NUL-terminated, as ``cuModuleLoadData`` takes it."""
    if not args:
        return "ptx-for-the-driver", "1"
    backend, stages, options, language, capability = args
    if "cubin" in stages:
        stages["cubin"] = lambda src, metadata: src.encode() + b"\0"


def _compiled_kernel_init(self, src, metadata_group, hash):
    """Triton 3.9's ``CompiledKernel.__init__``, reading each artefact from memory and its kind from the name it was
    cached under (Triton reads files, and a kind from a file's suffix)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import AsmDict, make_backend

    metadata = json.loads(_read(next(p for c, p in metadata_group.items() if c.endswith(".json"))))
    target = metadata["target"]
    metadata["target"] = GPUTarget(target["backend"], target["arch"], target["warp_size"])
    self.metadata = namedtuple("KernelMetadata", sorted(metadata))(**metadata)
    backend = make_backend(self.metadata.target)
    self.packed_metadata = backend.pack_metadata(self.metadata)
    self.src, self.hash, self.name = src, hash, self.metadata.name
    asm = {}
    for filename, name in metadata_group.items():
        kind = filename.rsplit(".", 1)[-1]
        if kind != "json":
            asm[kind] = _read(name) if kind == backend.binary_ext else _read(name).decode()
    self.asm = AsmDict(asm)
    self.metadata_group = metadata_group
    self.kernel = self.asm[backend.binary_ext]
    self.module = self.function = self._run = self._module_pid = None


def install(ptxas_version: str = "given by the trusted side") -> None:
    """Make this process's Triton compile for a GPU without files, programs or memory files. Call it before the first
    compile; it turns Triton's interpreter off."""
    global MemoryCache
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_MANAGER"] = f"{__name__}:MemoryCache"
    os.environ["TRITON_MOCK_PTX_VERSION"] = ptxas_version
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (it warns otherwise)
    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime.cache import CacheManager

    MemoryCache = type("MemoryCache", (_MemoryCache, CacheManager), {})

    knobs.runtime.add_stages_inspection_hook = _ptx_for_the_driver
    compiler.CompiledKernel.__init__ = _compiled_kernel_init
