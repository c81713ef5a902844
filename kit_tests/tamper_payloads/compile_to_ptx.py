"""[attnkit-tamper] compile_to_ptx -- not an attack: the first half of the GPU design (docs/kernels-sandbox.md), tried
in a box under the learner's filter.

The whole of a k01 module. At import it turns Triton's interpreter off (triton is first imported here, in the
worker), and compiles a softmax kernel for an H100 (sm_90a) all the way to PTX, the way a box would on a GPU, with the
kit's `suite_runtime.triton_compile.install()`: Triton's cache kept as bytes in the process's own memory (no file, no
memory file: RLIMIT_AS counts it), the ptxas stage replaced by handing the PTX to the CUDA driver (whose
cuModuleLoadData compiles PTX in-process), the ptxas version given instead of asked from the program. Then every call
of softmax raises what happened. Expected: "COMPILED in the box": no program had to run, no file had to be made, no
memory file either. (Loading and launching need a GPU.)
"""
from suite_runtime.triton_compile import install

install()  # before Triton is first imported in this worker: compiled mode, Triton's cache in this process's memory
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + offs, e / tl.sum(e, axis=0), mask=offs < n_cols)


try:
    _compiled = triton.compile(ASTSource(softmax_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_cols": "i32",
                                                          "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024}),
                               target=GPUTarget("cuda", 90, 32), options={"ptx_version": 86})
    _RESULT = f"COMPILED in the box: {len(_compiled.asm['ptx'])} characters of PTX for sm_90a, {sorted(_compiled.asm)}"
except Exception as exc:
    _RESULT = f"NOT COMPILED: {type(exc).__name__}: {exc}"


def softmax(x, block_size=None):
    raise RuntimeError(_RESULT)
