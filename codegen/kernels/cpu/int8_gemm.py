"""kiln's int8-activation kernel for q8 and q4 linears on AVX2 CPUs (linear of format q8 or q4 with act_block).

The scheme (ir/ops.py; ir/quant.py quantize_activations): each row of x is quantised to int8 in
blocks of act_block inputs, each block's dot with the integer weight levels is exact in int32, and
is scaled once per block. This kernel serves steps with chunks (decode steps run codegen/kernels/cpu/int8_gemv.py,
whose float steps are the same, so a row's outputs do not depend on its step):
  1. x is quantised once, inside the kernel (a parallel loop over rows), to int16 levels and a
     scale per block; every task then reads them from cache;
  2. a task owns one weight panel (nb output columns) and a tile of up to ROWS rows. Per K_BLOCK
     inputs it widens the panel's block to int16 once, as pairs of inputs per column: the operand
     order of vpmaddwd (q4: a byte's two nibbles; q8: stored in pairs, layout packedNBx2);
  3. a micro-kernel multiplies MICRO_ROWS rows (single rows for the rest of the tile) by two
     vectors of 8 columns with vpmaddwd, 16 products per instruction (twice fp32 FMA's rate), into
     int32 accumulators held in registers for one activation block, then adds them to the tile's
     float32 accumulators times the block's scales (x's, and for q4 the weight group's; q4a then
     adds Σx times x's scale and the group's minimum, Σx per block summed once with the levels).
The epilogue (q8 scale, bias, rounding, residual) is codegen/kernels/weight_format.py's.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat

from ..weight_format import group_minimum, group_scale
from .gemm import panel_and_tile, signature, tile_output

ROWS, K_BLOCK, MICRO_ROWS = 48, 128, 6
LANES = 8                                  # int32 lanes of an AVX2 register: 8 output columns
PEAK_LANES = 16                            # floats a block's peak is taken over at once (max is exact in any order)
PAIR_DOT = "llvm.x86.avx2.pmadd.wd"        # int16 pairs multiplied and summed into int32 lanes



def x_quantizer(n_in: int, block: int, level_dtype: str, position=None, scale_shift=None):
    """A T.macro quantize(x, xq, sx, m) writing the scheme's levels of each row of x (ir/quant.py
    quantize_activations: q = rint(x * 127 / amax) per block) into xq as level_dtype, input k of a
    block at position(k) of it (default k), and each block's scale amax / 127 into sx, divided by
    2^scale_shift(b) where given (exact: for a kernel whose dots of block b are 2^n times the
    scheme's). amax is taken 16 floats at a time where the block allows. Rows run in parallel; the
    int8 kernels call it first, so x is read from memory once."""
    place = position or (lambda k: k)
    shift = scale_shift or (lambda b: 0)
    loop = T.serial if position else T.vectorized

    def block_peak(x, row, start):         # evaluated while parsing: max |x| of a block, a vector at a time
        lanes = [T.abs(T.Cast(f"float32x{PEAK_LANES}", x[row, T.ramp(start + c, 1, PEAK_LANES)]))
                 for c in range(0, block, PEAK_LANES)]
        return T.call_llvm_pure_intrin("float32", "llvm.vector.reduce.fmax", functools.reduce(T.max, lanes))

    @T.macro
    def quantize_row(x, xq, sx, m, i):
        for kb in range(n_in // block):
            with T.sblock("quantize"):
                row = T.axis.spatial(m, i)
                b = T.axis.spatial(n_in // block, kb)
                T.reads(x[row, b * block:b * block + block])
                T.writes(xq[row, b * block:b * block + block], sx[row, b])
                amax = T.sblock_alloc_buffer((1,), "float32", scope="local")
                if block % PEAK_LANES != 0:
                    amax[0] = T.float32(0)
                    for k in range(block):
                        amax[0] = T.max(amax[0], T.abs(T.Cast("float32", x[row, b * block + k])))
                else:
                    amax[0] = block_peak(x, row, b * block)
                sx[row, b] = amax[0] / T.float32(127) / T.Cast("float32", 1 << shift(b))
                for k in loop(block):
                    xq[row, b * block + place(k)] = T.Cast(level_dtype, T.nearbyint(
                        T.Cast("float32", x[row, b * block + k])
                        * T.if_then_else(amax[0] > T.float32(0), T.float32(127) / amax[0], T.float32(0))))

    @T.macro
    def quantize(x, xq, sx, m):
        if m == 1:         # a decode step: waking the thread pool costs more than quantising one row
            quantize_row(x, xq, sx, m, 0)
        else:
            for i in T.parallel(m):
                quantize_row(x, xq, sx, m, i)
    return quantize


def x_block_sums(n_in: int, block: int, needed: bool = True, times=None):
    """A T.macro sums(xq, x_sums, m) writing Σ of each block's levels (int32), times `times(b)` for
    block b where given: the kernels whose weight operand is offset to be unsigned (q4's nibbles,
    VNNI's q8 + 128) subtract offset · Σx. With `needed` False it sums nothing (a kernel variant
    that does not read them)."""
    factor = times or (lambda b: 1)

    @T.macro
    def sums_row(xq, x_sums, m, i):
        for b in range(n_in // block if needed else 0):
            with T.sblock("x_sums"):
                r = T.axis.spatial(m, i)
                bb = T.axis.spatial(n_in // block, b)
                T.reads(xq[r, bb * block:bb * block + block])
                T.writes(x_sums[r, bb])
                x_sums[r, bb] = factor(bb) * T.call_llvm_pure_intrin(  # one vector: a chain of scalar
                    "int32", "llvm.vector.reduce.add",                 # adds through memory cost ~1 µs a row
                    T.Cast(f"int32x{block}", xq[r, T.ramp(bb * block, 1, block)]))

    @T.macro
    def sums(xq, x_sums, m):
        if m == 1:         # as quantize: one row is summed without waking the thread pool
            sums_row(xq, x_sums, m, 0)
        else:
            for i in T.parallel(m):
                sums_row(xq, x_sums, m, i)
    return sums


@functools.cache
def int8_gemm_kernel(n_out: int, n_in: int, nb: int, dtype: str, fmt: WeightFormat, has_bias: bool,
                     has_residual: bool):
    """(x [m, n_in], w, scale, [bias,] [residual,] y [m, n_out]) for fmt q8 or q4 with act_block > 0,
    w stored [n_out/nb, n_in/2, nb] bytes of two nibbles (q4) or in layout packedNBx2 (q8); nb a
    multiple of 8."""
    if nb % LANES:
        raise ValueError(f"the int8 GEMM takes panels of a multiple of {LANES} columns, not {nb}")
    block, q4, grouped = fmt.act_block, fmt.nibbles, fmt.grouped      # q8g: q8's levels, q4's group scales
    k_block = next(b for b in (K_BLOCK, 64, 32, 16, 8, 4, 2) if n_in % b == 0 and b % block == 0) \
        if K_BLOCK % block == 0 else block
    panels, vectors = n_out // nb, nb // LANES
    per_slice = min(2, vectors)            # vectors of columns per micro-kernel step
    slices, pairs = vectors // per_slice, k_block // 2
    w_shape = (panels, n_in // 2, nb if q4 else 2 * nb)    # q4: a byte holds a pair; q8: layout packedNBx2
    scale_shape = (fmt.table_rows(n_in), n_out) if grouped else (n_out,)
    minimums = fmt.has_minimums

    quantize = x_quantizer(n_in, block, "int16")
    sum_blocks = x_block_sums(n_in, block)

    def tile_reads(xq, sx, x_sums, w, io, jo):      # evaluated while parsing: what a tile reads
        rows = slice(io * ROWS, io * ROWS + ROWS)
        sums = [x_sums[rows, 0:n_in // block]] if minimums else []
        return [xq[rows, 0:n_in], sx[rows, 0:n_in // block], *sums, w[jo, 0:w_shape[1], 0:w_shape[2]]]

    def int32x8(value):
        return T.broadcast(T.int32(value), LANES)

    def widened(w, jo, kbo, kp, v):       # evaluated while parsing: (W[c, k], W[c, k + 1]) for 8 columns
        columns = T.ramp(v * LANES, 1, LANES)
        if q4:                             # one byte holds both inputs of a pair
            byte = T.Cast("int32x8", w[jo, kbo * pairs + kp, columns])
            word = (byte & int32x8(15)) | ((byte >> int32x8(4)) << int32x8(16))
            return T.reinterpret("int16x16", word) - T.broadcast(T.int16(fmt.level_offset), 2 * LANES)
        return T.Cast("int16x16", w[jo, kbo * pairs + kp, T.ramp(v * 2 * LANES, 1, 2 * LANES)])   # stored in pairs

    def block_scale(sx, scale, row, kb, col):   # evaluated while parsing: float32x8 for block kb
        x_scale = T.broadcast(sx[row, kb], LANES)
        if not grouped or scale is None:   # q8's weight scale is per output: applied in the epilogue
            return x_scale                 # (and an unscaled signature is parsed, never used)
        columns = T.ramp(T.Cast("int32", col), 1, LANES)       # col is int64 where m is
        group = kb * block // fmt.group_size
        return x_scale * group_scale(fmt, lambda table_row: scale[table_row, columns], group, LANES)

    def minimum_term(sx, x_sums, scale, row, kb, col):    # evaluated while parsing: q4a's Σx · sx · minimum
        columns = T.ramp(T.Cast("int32", col), 1, LANES)
        minimum = group_minimum(fmt, lambda table_row: scale[table_row, columns], kb * block // fmt.group_size, LANES)
        return T.broadcast(T.Cast("float32", x_sums[row, kb]), LANES) * (T.broadcast(sx[row, kb], LANES) * minimum)

    @T.macro
    def micro(xq, sx, x_sums, wi, acc, dots, scale, jo, row0, r0, kbo, s, count):
        """acc[r0 : r0 + count, slice s] += the block-scaled dots over this K block."""
        for b in range(k_block // block):
            for r in T.unroll(count):
                for v in T.unroll(per_slice):
                    dots[r, T.ramp(v * LANES, 1, LANES)] = int32x8(0)
            for kp in range(block // 2):
                for r in T.unroll(count):
                    for v in T.unroll(per_slice):
                        dots[r, T.ramp(v * LANES, 1, LANES)] = dots[r, T.ramp(v * LANES, 1, LANES)] + \
                            T.call_llvm_pure_intrin(
                                "int32x8", PAIR_DOT,
                                T.reinterpret("int16x16", T.broadcast(T.reinterpret(
                                    "int32", xq[row0 + r0 + r, T.ramp(kbo * k_block + b * block + 2 * kp, 1, 2)]),
                                    LANES)),
                                wi[b * block // 2 + kp, T.ramp((s * per_slice + v) * 2 * LANES, 1, 2 * LANES)])
            for r in T.unroll(count):
                for v in T.unroll(per_slice):
                    acc[r0 + r, T.ramp((s * per_slice + v) * LANES, 1, LANES)] = \
                        acc[r0 + r, T.ramp((s * per_slice + v) * LANES, 1, LANES)] + \
                        T.Cast("float32x8", dots[r, T.ramp(v * LANES, 1, LANES)]) * block_scale(
                            sx, scale, row0 + r0 + r, kbo * (k_block // block) + b,
                            jo * nb + (s * per_slice + v) * LANES)
                    if minimums:
                        acc[r0 + r, T.ramp((s * per_slice + v) * LANES, 1, LANES)] = \
                            acc[r0 + r, T.ramp((s * per_slice + v) * LANES, 1, LANES)] + minimum_term(
                                sx, x_sums, scale, row0 + r0 + r, kbo * (k_block // block) + b,
                                jo * nb + (s * per_slice + v) * LANES)

    @T.macro
    def tiles(xq, sx, x_sums, w, scale, bias, residual, y, m):
        for task in T.parallel(panels * ((m + ROWS - 1) // ROWS)):
            with T.sblock("tile"):
                jo = T.axis.spatial(panels, panel_and_tile(task, m, ROWS)[0])
                io = T.axis.spatial((m + ROWS - 1) // ROWS, panel_and_tile(task, m, ROWS)[1])
                T.reads(tile_reads(xq, sx, x_sums, w, io, jo))
                T.writes(y[io * ROWS:io * ROWS + ROWS, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((ROWS, nb), "float32")
                wi = T.sblock_alloc_buffer((pairs, 2 * nb), "int16")
                dots = T.sblock_alloc_buffer((MICRO_ROWS, per_slice * LANES), "int32", scope="local")
                rows = T.min(ROWS, m - io * ROWS)
                full = rows // MICRO_ROWS
                for r, c in T.grid(ROWS, nb):
                    acc[r, c] = T.float32(0)
                for kbo in range(n_in // k_block):
                    for kp, v in T.grid(pairs, vectors):
                        wi[kp, T.ramp(v * 2 * LANES, 1, 2 * LANES)] = widened(w, jo, kbo, kp, v)
                    for t, s in T.grid(full, slices):
                        micro(xq, sx, x_sums, wi, acc, dots, scale, jo, io * ROWS, t * MICRO_ROWS, kbo, s, MICRO_ROWS)
                    for r, s in T.grid(rows - full * MICRO_ROWS, slices):
                        micro(xq, sx, x_sums, wi, acc, dots, scale, jo, io * ROWS, full * MICRO_ROWS + r, kbo, s, 1)
                for r in range(rows):
                    for c in T.vectorized(nb):
                        y[io * ROWS + r, jo * nb + c] = tile_output(acc, fmt, dtype, scale, bias, residual,
                                                                    io * ROWS, jo * nb, r, c)

    @T.macro
    def gemm(x, w, scale, bias, residual, y, m):
        xq = T.alloc_buffer((m, n_in), "int16")
        sx = T.alloc_buffer((m, n_in // block), "float32")
        quantize(x, xq, sx, m)
        if minimums:                   # q4a: Σx per block for the minimums' term
            x_sums = T.alloc_buffer((m, n_in // block), "int32")
            sum_blocks(xq, x_sums, m)
            tiles(xq, sx, x_sums, w, scale, bias, residual, y, m)
        else:                          # no other format reads one: x's scales stand in, unread
            tiles(xq, sx, sx, w, scale, bias, residual, y, m)

    return signature(gemm, n_in, n_out, w_shape, dtype, "uint8" if q4 else "int8", scale_shape,
                     fmt.table_dtype, has_bias, has_residual)
