"""kiln's int8-activation kernel for decode steps: q8 and q4 linears with act_block, few rows, AVX2.

The scheme and the float operations are codegen/kernels/cpu/int8_gemm.py's (exact integer dots per block of x,
then acc + dot · block scale in block order), so a row's outputs do not depend on which of the two
kernels ran it. The GEMM widens each weight block into an int16 buffer once per tile of rows; for
one decode row that widening costs as much as the dots. Here a task owns one weight panel and reads
each weight byte once per row, straight into registers, a block of the panel's rows (whole cache
lines) at a time (q4 prefetching AHEAD blocks on):
  - q4: two stored rows (two input pairs per column, four nibbles) are zero-extended and joined into
    16-bit lanes, one lane per output column, GROUP columns at a time. The nibbles, masked out, are
    vpmaddubsw's unsigned operand (level + 8, 0..15) against x's signed levels, which x_quantizer
    stores in the order (k0, k2, k1, k3) per four inputs to match: 32 products per instruction.
    Sums stay in int16 for 16 inputs (at most 16 · 15 · 127); 8 · Σx of the block is subtracted
    once, from its int32 total. q4a's nibbles are the levels: its dots start from 0, and after
    the block's scaled dots it adds Σx · x's scale · the group's minimum.
  - q8: stored in input pairs (layout packedNBx2), so one sign extension makes vpmaddwd's int16
    pairs for 8 columns, multiplied with x's pair of levels, 16 products per instruction.
The epilogue (q8 scale, bias, rounding, residual) is codegen/kernels/weight_format.py's.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat
from kiln.selection.shapes import INT8_GEMV_GROUP, int8_gemv_takes

from ..weight_format import group_minimum, group_scale
from .gemm import signature, tile_output
from .int8_gemm import LANES, PAIR_DOT, x_block_sums, x_quantizer

GROUP = INT8_GEMV_GROUP                    # output columns per step: 16 int16 lanes (q4), two pair dots (q8)
BYTE_DOT = "llvm.x86.avx2.pmadd.ub.sw"     # unsigned × signed bytes, adjacent pairs summed into int16
AHEAD = 4                                  # q4: blocks of weight rows (and scales) prefetched ahead
Q4_INT16_RUN = 16                          # q4 inputs whose byte dots an int16 lane can hold


def _quad_position(k):
    """Where input k of a block goes among x's levels for q4: (k0, k2, k1, k3) per four inputs."""
    return (k // 4) * 4 + (k % 2) * 2 + (k // 2) % 2


@functools.cache
def int8_gemv_kernel(n_out: int, n_in: int, nb: int, dtype: str, fmt: WeightFormat, has_bias: bool,
                     has_residual: bool):
    """(x [m, n_in], w, scale, [bias,] [residual,] y [m, n_out]), w stored as codegen/kernels/cpu/int8_gemm.py's
    kernel takes it; see selection/shapes.py int8_gemv_takes."""
    if not int8_gemv_takes(n_out, n_in, nb, fmt):
        raise ValueError(f"the int8 GEMV takes panels of a multiple of {GROUP} columns and q8/q4 blocks of "
                         f"a multiple of 4 inputs, not nb={nb}, {fmt}")
    block, q4, grouped = fmt.act_block, fmt.nibbles, fmt.grouped      # q8g: q8's levels, q4's group scales
    panels, blocks, groups = n_out // nb, n_in // block, nb // GROUP
    run = next(r for r in (Q4_INT16_RUN, 8, 4) if block % r == 0) if q4 else 2
    w_shape = (panels, n_in // 2, nb if q4 else 2 * nb)    # q4: a byte holds a pair; q8: layout packedNBx2
    scale_shape = (fmt.table_rows(n_in), n_out) if grouped else (n_out,)
    minimums = fmt.has_minimums
    quantize = x_quantizer(n_in, block, "int8", _quad_position) if q4 else x_quantizer(n_in, block, "int16")
    sum_blocks = x_block_sums(n_in, block, needed=q4)     # q8's levels are signed: no offset
    rows_per_block = block // 2                            # stored weight rows per block of x
    # Prefetching measured on Zen 3 (docs/BENCHMARKS.md): q4 gains ~1.5x, chiefly from its group
    # scales (a row of a [groups, n_out] table per block, which no stride prefetcher follows); q8
    # loses, its whole-line rows streaming well by themselves.
    prefetched_rows = rows_per_block if q4 else 0
    row_lines = (w_shape[2] + 63) // 64                    # cache lines of a stored row
    scale_lines = (nb * 2 + 63) // 64 if q4 else 0         # of a block's q4 scales, float16

    def int16x16(value):
        return T.broadcast(T.int16(value), 16)

    def joined(w, jo, row, g):             # evaluated while parsing: lane c = bytes (w[row, c], w[row + 1, c])
        columns = T.ramp(g * GROUP, 1, GROUP)
        return T.Cast("int16x16", w[jo, row, columns]) | (T.Cast("int16x16", w[jo, row + 1, columns]) << int16x16(8))

    def x_bytes(levels, r, k):             # evaluated while parsing: int8 levels (k, k + 1) in every 16-bit lane
        return T.reinterpret("int8x32", T.broadcast(T.reinterpret("int16", levels[r, T.ramp(k, 1, 2)]), 16))

    def x_words(levels, r, k):             # evaluated while parsing: int16 levels (k, k + 1) in every 32-bit lane
        return T.reinterpret("int16x16", T.broadcast(T.reinterpret("int32", levels[r, T.ramp(k, 1, 2)]), LANES))

    def byte_dot(unsigned, signed):
        return T.call_llvm_pure_intrin("int16x16", BYTE_DOT, unsigned, signed)

    def first_dot(x_sums, r, b):           # evaluated while parsing: q4's levels are nibbles - 8
        return -fmt.level_offset * x_sums[r, b] if q4 else T.int32(0)

    def scale_prefetch(scale, jo, b, line, row_of):     # evaluated while parsing (the unscaled signature has none)
        if scale is None or not q4:
            return T.int32(0)
        return T.call_intrin("void", "tirx.prefetch", T.address_of(
            scale[row_of((b + AHEAD) * block // fmt.group_size), jo * nb + line * 32]), 0, 3, 1)

    def block_scale(sx, scale, r, b, col):     # the GEMM's block_scale, for the same rounding
        x_scale = T.broadcast(sx[r, b], LANES)
        if not grouped or scale is None:
            return x_scale
        columns, group = T.ramp(col, 1, LANES), b * block // fmt.group_size
        return x_scale * group_scale(fmt, lambda table_row: scale[table_row, columns], group, LANES)

    def minimum_term(sx, x_sums, scale, r, b, col):     # evaluated while parsing: q4a's Σx · sx · minimum
        return T.broadcast(T.Cast("float32", x_sums[r, b]), LANES) * (T.broadcast(sx[r, b], LANES) * group_minimum(
            fmt, lambda table_row: scale[table_row, T.ramp(col, 1, LANES)], b * block // fmt.group_size, LANES))

    @T.macro
    def prefetch(w, scale, jo, b):
        """q4: ask for the weight rows and scales AHEAD blocks on (past the panel's end: the next
        task's rows, or nothing, which a prefetch never faults on)."""
        for row, line in T.grid(prefetched_rows, row_lines):
            T.evaluate(T.call_intrin("void", "tirx.prefetch", T.address_of(
                w[jo, (b + AHEAD) * rows_per_block + row, line * 64]), 0, 3, 1))
        for line in T.serial(scale_lines):
            T.evaluate(scale_prefetch(scale, jo, b, line, fmt.scale_row))
            if minimums:
                T.evaluate(scale_prefetch(scale, jo, b, line, fmt.minimum_row))

    @T.macro
    def q4_dots(w, xq, dots, run_sums, jo, r, g, b):
        """dots[0:GROUP] += Σ nibble · x over block b, in int16 runs of `run` inputs."""
        for h in range(block // run):
            run_sums[T.ramp(0, 1, 16)] = int16x16(0)
            for q in T.unroll(run // 4):
                k = b * block + h * run + q * 4
                nibbles = joined(w, jo, k // 2, g)
                run_sums[T.ramp(0, 1, 16)] = run_sums[T.ramp(0, 1, 16)] + byte_dot(
                    T.reinterpret("uint8x32", nibbles & int16x16(0x0F0F)), x_bytes(xq, r, k)) + byte_dot(
                    T.reinterpret("uint8x32", (nibbles >> int16x16(4)) & int16x16(0x0F0F)), x_bytes(xq, r, k + 2))
            for v in T.unroll(GROUP // LANES):
                dots[T.ramp(v * LANES, 1, LANES)] = dots[T.ramp(v * LANES, 1, LANES)] + T.Cast(
                    "int32x8", run_sums[T.ramp(v * LANES, 1, LANES)])

    @T.macro
    def q8_dots(w, xq, dots, run_sums, jo, r, g, b):
        """dots[0:GROUP] += Σ w · x over block b, a pair of inputs per vpmaddwd."""
        for kp in T.unroll(block // 2):
            for v in T.unroll(GROUP // LANES):
                dots[T.ramp(v * LANES, 1, LANES)] = dots[T.ramp(v * LANES, 1, LANES)] + T.call_llvm_pure_intrin(
                    "int32x8", PAIR_DOT, x_words(xq, r, b * block + 2 * kp),
                    T.Cast("int16x16", w[jo, b * rows_per_block + kp, T.ramp((g * GROUP + v * LANES) * 2, 1, 16)]))

    block_dots = q4_dots if q4 else q8_dots

    @T.macro
    def gemv(x, w, scale, bias, residual, y, m):
        xq = T.alloc_buffer((m, n_in), "int8" if q4 else "int16")
        sx = T.alloc_buffer((m, blocks), "float32")
        x_sums = T.alloc_buffer((m, blocks), "int32")      # q4: Σx per block, for the nibbles' +8
        quantize(x, xq, sx, m)
        sum_blocks(xq, x_sums, m)
        for task in T.parallel(panels):
            with T.sblock("panel"):
                jo = T.axis.spatial(panels, task)
                T.reads(xq[0:m, 0:n_in], sx[0:m, 0:blocks], x_sums[0:m, 0:blocks], w[jo, 0:w_shape[1], 0:w_shape[2]])
                T.writes(y[0:m, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((1, nb), "float32")
                dots = T.sblock_alloc_buffer((GROUP,), "int32", scope="local")
                run_sums = T.sblock_alloc_buffer((GROUP,), "int16", scope="local")
                for r in range(m):
                    for c in T.vectorized(nb):
                        acc[0, c] = T.float32(0)
                    for b, g in T.grid(blocks, groups):       # a block's rows of the panel: whole cache lines
                        if g == 0:
                            prefetch(w, scale, jo, b)
                        for c in T.vectorized(GROUP):
                            dots[c] = first_dot(x_sums, r, b)
                        block_dots(w, xq, dots, run_sums, jo, r, g, b)
                        for v in T.unroll(GROUP // LANES):
                            acc[0, T.ramp(g * GROUP + v * LANES, 1, LANES)] = \
                                acc[0, T.ramp(g * GROUP + v * LANES, 1, LANES)] + \
                                T.Cast("float32x8", dots[T.ramp(v * LANES, 1, LANES)]) * block_scale(
                                    sx, scale, r, b, jo * nb + g * GROUP + v * LANES)
                            if minimums:
                                acc[0, T.ramp(g * GROUP + v * LANES, 1, LANES)] = \
                                    acc[0, T.ramp(g * GROUP + v * LANES, 1, LANES)] + minimum_term(
                                        sx, x_sums, scale, r, b, jo * nb + g * GROUP + v * LANES)
                    for c in T.vectorized(nb):
                        y[r, jo * nb + c] = tile_output(acc, fmt, dtype, scale, bias, residual, r, jo * nb, 0, c)

    return signature(gemv, n_in, n_out, w_shape, dtype, "uint8" if q4 else "int8", scale_shape,
                     fmt.table_dtype, has_bias, has_residual)
