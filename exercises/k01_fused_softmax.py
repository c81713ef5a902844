"""Stage k01: a fused softmax in Triton, and Triton's programming model.

modern-attention's stage m07 computed attention tile by tile in PyTorch: every tile was a handful of torch calls,
each reading its inputs from the GPU's memory and writing its result back. A KERNEL is one program that the GPU
runs thousands of times at once, each copy (a PROGRAM, or block) on its own slice of the data, keeping what it
works on in registers and on-chip memory. Triton (Tillet et al., 2019; what torch.compile and FlashAttention's
Triton versions are written in) lets you write such a program in Python:

    @triton.jit
    def kernel(x_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)                     # which copy of the program this is: 0 .. grid - 1
        offs = pid * BLOCK + tl.arange(0, BLOCK)   # a BLOCK of element indices, a vector (BLOCK a power of 2)
        mask = offs < n                            # the lanes that lie inside the tensor
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)   # pointers + offsets: a vector load; masked lanes get other
        tl.store(x_ptr + offs, x * 2, mask=mask)   # only the lanes in the mask are written

    kernel[(triton.cdiv(n, BLOCK),)](x, n, BLOCK=128)     # the launch: the GRID (how many programs), then arguments

A tensor argument arrives as a pointer to its first element; its layout is yours to follow, with its strides.
Everything a program computes is a whole block at once (vectors and matrices of constexpr sizes); reductions
(tl.max, tl.sum) fold a block to a scalar or a row.

The softmax of one row x of n values is exp(x - max(x)) / sum(exp(x - max(x))): subtracting the max changes
nothing mathematically and keeps every exp <= 1, so no exp overflows. This kernel runs ONE PROGRAM PER ROW and reads
the row in chunks of BLOCK_SIZE values, so that rows longer than a block work too (a vocabulary's 32000 logits):

    pass 1  the running max: a BLOCK_SIZE vector holding, lane by lane, the largest value seen in that lane over
            the chunks so far; one tl.max at the end gives the row's max
    pass 2  the sum of exp(x - max), lane by lane again, one tl.sum at the end
    pass 3  exp(x - max) / sum, written chunk by chunk

The last chunk of a row is usually partial (n is not a multiple of BLOCK_SIZE): its lanes past the row's end are
MASKED. Loaded with other=-inf, they count for nothing in the max, and exp(-inf) = 0 adds nothing to the sum.
torch.softmax computes all this too; on a GPU it is one fused kernel like this one, reading x from memory as
few times as the row's length allows.

Without a CUDA GPU, the kernels run in Triton's interpreter (TRITON_INTERPRET=1): the same code, on CPU tensors,
one program after another, in NumPy. It is slow (keep sizes small) but shows every value as you wrote it.

API
    softmax_kernel[grid](x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK_SIZE)
        one program per row (program id 0 = the row); rows of n_cols values, row r of x starting at
        x_ptr + r * x_row_stride (in elements), the same for out.
    softmax(x, block_size=None) -> torch.softmax(x, dim=-1), x's shape and dtype
        x (..., n_cols), float32 or bfloat16 (bfloat16 is read and written as such, computed in float32);
        block_size: the chunk length, a power of 2 (None: the row's length rounded up to a power of 2, at most
        1024). Any block_size gives the same values. Rows of huge values (1e4) or of very negative ones (-1e4)
        give no NaN, a row of n_cols not a multiple of block_size is masked.
"""
import os

import torch

# Without a CUDA GPU, Triton's interpreter runs the kernels, on CPU tensors. Triton reads this when it is first
# imported (its own library functions, tl.max and the like, are kernels made then): so it is set before; an
# explicit TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)  # this program's row: 0 .. n_rows - 1 (the grid has one program per row)
    x_row = x_ptr + row * x_row_stride  # pointer to the row's first value (strides count elements, not bytes)
    out_row = out_ptr + row * out_row_stride
    lanes = tl.arange(0, BLOCK_SIZE)  # (BLOCK_SIZE,) the offsets of one chunk: 0, 1, ..., BLOCK_SIZE - 1

    # TODO: Pass 1, the running max: for each chunk start in 0, BLOCK_SIZE, 2 * BLOCK_SIZE ... < n_cols, load the
    #       chunk's (BLOCK_SIZE,) values with the lanes past n_cols masked (other=-inf: they never win), and keep lane
    #       by lane the larger of the running max and the chunk; then reduce the lanes to the row's max (a scalar).
    raise NotImplementedError("k01_fused_softmax: softmax_kernel: see its TODO")

    # TODO: Pass 2, the denominator: the sum over the row of exp(x - row_max), chunk by chunk, lane by lane (masked
    #       lanes loaded as -inf add exp(-inf) = 0), reduced to a scalar at the end.
    raise NotImplementedError("k01_fused_softmax: softmax_kernel: see its TODO")

    # TODO: Pass 3: write exp(x - row_max) / row_sum for every column of the row, chunk by chunk, only the lanes inside
    #       the row (a store masked like the loads), in out's dtype.
    raise NotImplementedError("k01_fused_softmax: softmax_kernel: see its TODO")


def softmax(x, block_size=None):
    """torch.softmax(x, dim=-1) by softmax_kernel: x (..., n_cols) -> the same shape and dtype."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)  # (n_rows, n_cols): every leading axis is rows
    if rows.stride(-1) != 1:
        rows = rows.contiguous()  # the kernel reads a row's values one after another
    out = torch.full_like(rows, float("nan"))  # (a lane the kernel never writes stays NaN: it cannot pass by chance)
    block = block_size or min(triton.next_power_of_2(n_cols), 1024)
    # TODO: Launch: a grid of one program per row, each given the row length, the row strides of x and out (in elements)
    #       and the chunk length as the constexpr BLOCK_SIZE.
    raise NotImplementedError("k01_fused_softmax: softmax: see its TODO")
    return out.reshape(x.shape)
