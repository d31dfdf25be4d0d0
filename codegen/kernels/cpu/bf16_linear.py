"""kiln's bf16 linear kernel for CPUs with AVX-512 BF16, for every step.

x and W are bf16 (the model's dtype), so each product is exact in float32 and the sums are what
the interpreter's float32 matmul computes, in another order. Weights are stored in layout
packedNBx2 (two inputs of a column side by side), the operand order of `vdpbf16ps`. A task owns one
weight panel (nb columns) and a tile of up to ROWS rows, and walks the inputs in K blocks (a
block of the panel is read from memory once, then from cache by every micro-tile); per block the
micro-kernel of codegen/kernels/cpu/bf16_micro.py adds MICRO_ROWS rows × the panel's columns into the tile's
float32 sums, leftover rows one at a time. A decode step is the same kernel with a tile of one
row. The epilogue (bias, rounding, residual) is codegen/kernels/weight_format.py's.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat

from .bf16_micro import LANES, PAIR, micro_name
from .gemm import panel_and_tile, signature, tile_output

ROWS, K_BLOCK, MICRO_ROWS = 48, 1024, 6


def supports(n_out: int, n_in: int, nb: int) -> bool:
    return nb % LANES == 0 and n_in % PAIR == 0


def micro_kernels(nb: int) -> list[tuple[int, int]]:
    """The (rows, vectors) micro-kernels the kernel for panels of nb columns calls."""
    return [(MICRO_ROWS, nb // LANES), (1, nb // LANES)]


@functools.cache
def bf16_linear_kernel(n_out: int, n_in: int, nb: int, has_bias: bool, has_residual: bool):
    """(x [m, n_in], w [n_out/nb, n_in/2, 2 nb], [bias,] [residual,] y [m, n_out]), all bf16."""
    if not supports(n_out, n_in, nb):
        raise ValueError(f"the bf16 kernel takes panels of a multiple of {LANES} columns and an even "
                         f"number of inputs, not nb={nb}, n_in={n_in}")
    k_block = next(b for b in (K_BLOCK, 128, 64, 32, 16, 8, 4, 2) if n_in % b == 0)
    panels, vectors = n_out // nb, nb // LANES
    w_shape = (panels, n_in // PAIR, PAIR * nb)
    tile, single = micro_name(MICRO_ROWS, vectors), micro_name(1, vectors)

    @T.macro
    def dot(name, acc, x, w, r, row, jo, kbo):
        T.evaluate(T.call_extern("void", name, T.address_of(acc[r, 0]), T.int64(nb),
                                 T.address_of(x[row, kbo * k_block]), T.int64(n_in),
                                 T.address_of(w[jo, kbo * (k_block // PAIR), 0]), T.int64(PAIR * nb),
                                 T.int64(k_block // PAIR)))

    @T.macro
    def bf16_dot(x, w, scale, bias, residual, y, m):
        for task in T.parallel(panels * ((m + ROWS - 1) // ROWS)):
            with T.sblock("tile"):
                jo = T.axis.spatial(panels, panel_and_tile(task, m, ROWS)[0])
                io = T.axis.spatial((m + ROWS - 1) // ROWS, panel_and_tile(task, m, ROWS)[1])
                T.reads(x[io * ROWS:io * ROWS + ROWS, 0:n_in], w[jo, 0:w_shape[1], 0:w_shape[2]])
                T.writes(y[io * ROWS:io * ROWS + ROWS, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((ROWS, nb), "float32")
                rows = T.min(ROWS, m - io * ROWS)
                full = rows // MICRO_ROWS
                for r in range(rows):
                    for c in T.vectorized(nb):
                        acc[r, c] = T.float32(0)
                for kbo in range(n_in // k_block):
                    for t in range(full):
                        dot(tile, acc, x, w, t * MICRO_ROWS, io * ROWS + t * MICRO_ROWS, jo, kbo)
                    for r in range(full * MICRO_ROWS, rows):
                        dot(single, acc, x, w, r, io * ROWS + r, jo, kbo)
                for r in range(rows):
                    for c in T.vectorized(nb):
                        y[io * ROWS + r, jo * nb + c] = tile_output(acc, WeightFormat(), "bfloat16", None, bias,
                                                                    residual, io * ROWS, jo * nb, r, c)

    return signature(bf16_dot, n_in, n_out, w_shape, "bfloat16", "bfloat16", None, "float32", has_bias,
                     has_residual)
