"""[attnkit-tamper] compile_to_ptx -- not an attack: the first half of the GPU design (docs/kernels-sandbox.md), tried
in a box under the learner's filter.

The whole of a k01 module. At import it turns Triton's interpreter off (triton is first imported here, in the
worker), and compiles a softmax kernel for an H100 (sm_90a) all the way to PTX, the way a box would on a GPU: Triton's
cache kept in anonymous memory files (memfd_create: nothing in any file system, gone with the process), the ptxas
stage replaced by handing the PTX to the CUDA driver (whose cuModuleLoadData compiles PTX in-process), the ptxas
version given instead of asked from the program. Then every call of softmax raises what happened. Expected: "COMPILED
in the box": no program had to run and no file had to be made. (Loading and launching need a GPU.)
"""
import os

os.environ.pop("TRITON_INTERPRET", None)  # compiled mode: triton is imported here first in this worker
os.environ["TRITON_CACHE_MANAGER"] = "k01_fused_softmax:MemoryCache"
os.environ["TRITON_MOCK_PTX_VERSION"] = "mocked by the trusted side"
os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import CacheManager

_FILES = {}  # key -> {filename: path}


def _memfile(name, data):
    fd = os.memfd_create(name, 0)
    os.write(fd, data if isinstance(data, bytes) else str(data).encode())
    return f"/proc/self/fd/{fd}"


class MemoryCache(CacheManager):
    """Triton's cache kept in anonymous memory files (memfd_create): readable by path, gone with the process."""

    def __init__(self, key, override=False, dump=False):
        self.key = key
        self.files = _FILES.setdefault(key, {})

    def get_file(self, filename):
        return self.files.get(filename)

    def put(self, data, filename, binary=True):
        self.files[filename] = _memfile(filename, data)
        return self.files[filename]

    def get_group(self, filename):
        return self.files.get(("group", filename))

    def put_group(self, filename, group):
        self.files[("group", filename)] = dict(group)


def ptx_for_the_driver(*args):
    """add_stages_inspection_hook: the last stage hands the PTX itself to the CUDA driver (cuModuleLoadData
    compiles PTX in-process), instead of running ptxas."""
    if not args:
        return "ptx-for-the-driver", "1"
    backend, stages, options, language, capability = args
    stages["cubin"] = lambda src, metadata: src.encode() + b"\0"



def install():
    """Triton 3.9's CompiledKernel takes each IR's kind from its file's suffix: read the kinds from the names the
    files were cached under instead (the memfds' paths have none)."""
    import json
    from collections import namedtuple
    from pathlib import Path

    import triton.compiler.compiler as compiler
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import AsmDict, make_backend

    def init(self, src, metadata_group, hash):
        metadata = json.loads(Path(next(p for c, p in metadata_group.items() if c.endswith(".json"))).read_text())
        target = metadata["target"]
        metadata["target"] = GPUTarget(target["backend"], target["arch"], target["warp_size"])
        self.metadata = namedtuple("KernelMetadata", sorted(metadata))(**metadata)
        backend = make_backend(self.metadata.target)
        self.packed_metadata = backend.pack_metadata(self.metadata)
        self.src, self.hash, self.name = src, hash, self.metadata.name
        kind = {c: c.rsplit(".", 1)[-1] for c in metadata_group}
        self.asm = AsmDict({kind[c]: Path(p).read_bytes() if kind[c] == backend.binary_ext else Path(p).read_text()
                            for c, p in metadata_group.items() if not c.endswith(".json")})
        self.metadata_group = metadata_group
        self.kernel = self.asm[backend.binary_ext]
        self.module = self.function = self._run = self._module_pid = None

    compiler.CompiledKernel.__init__ = init




@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + offs, e / tl.sum(e, axis=0), mask=offs < n_cols)


knobs.runtime.add_stages_inspection_hook = ptx_for_the_driver
install()
try:
    _compiled = triton.compile(ASTSource(softmax_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32",
                                                          "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024}),
                               target=GPUTarget("cuda", 90, 32), options={"ptx_version": 86})
    _RESULT = f"COMPILED in the box: {len(_compiled.asm['ptx'])} characters of PTX for sm_90a, {sorted(_compiled.asm)}"
except Exception as exc:
    _RESULT = f"NOT COMPILED: {type(exc).__name__}: {exc}"


def softmax(x, block_size=None):
    raise RuntimeError(_RESULT)
