"""kiln's bf16 linear kernel for CPUs with AVX-512 BF16, for every step.

x and W are bf16 (the model's dtype), so each product is exact in float32 and the sums are what
the interpreter's float32 matmul computes, in another order. Weights are stored in layout
packedNBx2 (two inputs of a column side by side), the operand order of `vdpbf16ps`. A task owns one
weight panel (nb columns) and a tile of up to ROWS rows, and walks the inputs in K blocks (a
block of the panel is read from memory once, then from cache by every micro-tile); per block the
micro-kernel of codegen/kernels/cpu/bf16_micro.py adds MICRO_ROWS rows × the panel's columns into the tile's
float32 sums, leftover rows one at a time. A decode step is the same kernel with a tile of one
row. The epilogue (bias, rounding, residual) is codegen/kernels/weight_format.py's.

With `tiles` (CPUs with AMX, in steps that bring many rows): tasks of TILE_TASK_ROWS rows, whose
groups of 32 rows × 32 columns run AMX's tile micro-kernels (codegen/kernels/cpu/tile_micro.py)
over the same panels, K blocks of up to 1,024 inputs held in tiles; where the process may not use
tiles (kiln_tiles_ready: a CPU, kernel or setting without them), or the step has fewer rows than a
tile (a tile's product costs the same for 1 row as for 16), the same tasks run the AVX-512
micro-kernels above.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat
from kiln.selection.shapes import tile_bf16_takes

from .bf16_micro import LANES, PAIR, micro_name
from .gemm import panel_and_tile, signature, tile_output
from .tile_micro import BF16_STEP, READY, TILE_ROWS, bf16_name

ROWS, K_BLOCK, MICRO_ROWS = 48, 1024, 6
# with tiles: rows of a task (128: a prompt of 128 tokens reads each weight panel from memory once, where
# AMX's products leave the step bound by the weights' reads; not yet tuned on AMX), column tiles of a micro-kernel
TILE_TASK_ROWS, TILE_COLUMNS = 128, 2


def supports(n_out: int, n_in: int, nb: int) -> bool:
    return nb % LANES == 0 and n_in % PAIR == 0


def supports_tiles(n_out: int, n_in: int, nb: int) -> bool:
    return supports(n_out, n_in, nb) and tile_bf16_takes(n_in, nb)


def tile_kernels(nb: int) -> list[tuple]:
    """The tile micro-kernels ("bf16", row tiles, column tiles) the kernel with tiles calls for panels of
    nb columns."""
    cols = min(TILE_COLUMNS, nb // LANES)
    return [("bf16", 2, cols), ("bf16", 1, cols)]


def micro_kernels(nb: int) -> list[tuple[int, int]]:
    """The (rows, vectors) micro-kernels the kernel for panels of nb columns calls."""
    return [(MICRO_ROWS, nb // LANES), (1, nb // LANES)]


@functools.cache
def bf16_linear_kernel(n_out: int, n_in: int, nb: int, has_bias: bool, has_residual: bool, tiles: bool = False):
    """(x [m, n_in], w [n_out/nb, n_in/2, 2 nb], [bias,] [residual,] y [m, n_out]), all bf16."""
    if not (supports_tiles if tiles else supports)(n_out, n_in, nb):
        raise ValueError(f"the bf16 kernel takes panels of a multiple of {LANES} columns and a number of "
                         f"inputs a multiple of {BF16_STEP if tiles else PAIR}, not nb={nb}, n_in={n_in}")
    if tiles:       # the longest K block of whole tile steps: C tiles are loaded and stored once per block
        k_block = max(b for b in range(BF16_STEP, K_BLOCK + 1, BF16_STEP) if n_in % b == 0)
    else:
        k_block = next(b for b in (K_BLOCK, 128, 64, 32, 16, 8, 4, 2) if n_in % b == 0)
    task_rows = TILE_TASK_ROWS if tiles else ROWS
    panels, vectors = n_out // nb, nb // LANES
    w_shape = (panels, n_in // PAIR, PAIR * nb)
    tile, single = micro_name(MICRO_ROWS, vectors), micro_name(1, vectors)
    cols = min(TILE_COLUMNS, vectors)
    group = 2 * TILE_ROWS                  # rows of a two-row-tile micro-kernel

    @T.macro
    def tile_dot(name, acc, x, w, g, s, row, jo, kbo, rows):
        T.evaluate(T.call_extern("void", name, T.address_of(acc[g * group, s * cols * LANES]), T.int64(nb * 4),
                                 T.address_of(x[row, kbo * k_block]), T.int64(n_in * 2),
                                 T.address_of(w[jo, kbo * (k_block // PAIR), s * cols * PAIR * LANES]),
                                 T.int64(PAIR * nb * 2), T.Cast("int64", rows), T.int64(k_block // BF16_STEP)))

    @T.macro
    def dot(name, acc, x, w, r, row, jo, kbo):
        T.evaluate(T.call_extern("void", name, T.address_of(acc[r, 0]), T.int64(nb),
                                 T.address_of(x[row, kbo * k_block]), T.int64(n_in),
                                 T.address_of(w[jo, kbo * (k_block // PAIR), 0]), T.int64(PAIR * nb),
                                 T.int64(k_block // PAIR)))

    @T.macro
    def vector_dots(acc, x, w, row0, rows, full, jo, kbo):
        for t in range(full):
            dot(tile, acc, x, w, t * MICRO_ROWS, row0 + t * MICRO_ROWS, jo, kbo)
        for r in range(full * MICRO_ROWS, rows):
            dot(single, acc, x, w, r, row0 + r, jo, kbo)

    @T.macro
    def tile_dots(acc, x, w, row0, rows, jo, kbo):
        for g, s in T.grid((rows + group - 1) // group, vectors // cols):
            if rows - g * group > TILE_ROWS:
                tile_dot(bf16_name(2, cols), acc, x, w, g, s, row0 + g * group, jo, kbo, T.min(group, rows - g * group))
            else:
                tile_dot(bf16_name(1, cols), acc, x, w, g, s, row0 + g * group, jo, kbo, rows - g * group)

    @T.macro
    def bf16_dot(x, w, scale, bias, residual, y, m):
        for task in T.parallel(panels * ((m + task_rows - 1) // task_rows)):
            with T.sblock("tile"):
                jo = T.axis.spatial(panels, panel_and_tile(task, m, task_rows)[0])
                io = T.axis.spatial((m + task_rows - 1) // task_rows, panel_and_tile(task, m, task_rows)[1])
                T.reads(x[io * task_rows:io * task_rows + task_rows, 0:n_in], w[jo, 0:w_shape[1], 0:w_shape[2]])
                T.writes(y[io * task_rows:io * task_rows + task_rows, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((task_rows, nb), "float32")
                rows = T.min(task_rows, m - io * task_rows)
                full = rows // MICRO_ROWS
                for r in range(rows):
                    for c in T.vectorized(nb):
                        acc[r, c] = T.float32(0)
                for kbo in range(n_in // k_block):
                    if tiles:
                        if m >= TILE_ROWS and T.call_extern("int32", READY) != 0:
                            tile_dots(acc, x, w, io * task_rows, rows, jo, kbo)
                        else:
                            vector_dots(acc, x, w, io * task_rows, rows, full, jo, kbo)
                    else:
                        vector_dots(acc, x, w, io * task_rows, rows, full, jo, kbo)
                for r in range(rows):
                    for c in T.vectorized(nb):
                        y[io * task_rows + r, jo * nb + c] = tile_output(acc, WeightFormat(), "bfloat16", None, bias,
                                                                         residual, io * task_rows, jo * nb, r, c)

    return signature(bf16_dot, n_in, n_out, w_shape, "bfloat16", "bfloat16", None, "float32", has_bias,
                     has_residual)
