"""kiln's int8-activation kernel for q8 and q4 linears on CPUs with AVX-512 VNNI, for every step.

The scheme and the float steps are codegen/kernels/cpu/int8_gemm.py's (x quantised per block inside the kernel,
exact integer dots per block, then acc + dot · block scale in block order), so the outputs equal
that kernel's and the interpreter's. The dots run on vpdpbusd: four unsigned bytes times four signed
bytes, summed into each int32 lane, 64 products per instruction with nothing to widen. The weights
are stored four bytes per output column side by side (layout packedNBx4 over the stored columns),
so one 64-byte row of a panel is the operand for 16 columns:
  - q8: four levels; XOR 0x80 makes them unsigned (level + 128), so a block's dots start from
    -128 · Σx (x_block_sums computes it with the sums);
  - q4: weights in layout packedNBx4nB (B the activation block): byte i of a pair of blocks'
    stored rows holds input i of the first block in its low nibble and input i of the second in
    its high one, both level + 8. An AND with 0x0F gives the first block's operand, an AND with
    0xF0 sixteen times the second's, whose dots then start from -16 · 8 · Σx and take x's scale
    / 16 (the quantiser stores it so; a power of two: the products round as the scheme's). No
    shift is needed: on Zen 4 a byte shift (vgf2p8affineqb) takes a slot of vpdpbusd's pipes,
    an AND does not (bench/zen4_ports.c, docs/BENCHMARKS.md). x's levels stay in input order.
    q4's group scales are stored by panel (layout panelsNB): a task reads them as one run beside
    its weights' run, not as a 128-byte piece of every scale row (a decode GEMV ~8% faster on
    Zen 4, docs/BENCHMARKS.md).
  - q4a: q4's bytes, the nibbles the levels themselves (no offset): a block's dots start from 0,
    and after its scaled dots the block adds Σx · x's scale · the group's minimum (the scale
    table's odd rows, by panel as q4's).
A task owns one weight panel (nb columns) and a tile of up to ROWS rows. Per K block (read from
memory once, then from cache by every micro-tile) a micro-kernel runs MICRO_ROWS rows × 2 vectors
of 16 columns (leftover rows one at a time × 4 vectors), int32 dots in registers for one activation
block (a single row: q4's two blocks of a stored row at once, so each row is loaded once), their
scaled float sums in registers for the K block. A decode step is the same kernel
with a tile of one row. Nothing is prefetched in software: on Zen 4 prefetching the next K block's
weights halved a decode GEMV's rate; prefetching a few blocks ahead, or the q4 scales, was slower
or gained nothing measurable (docs/BENCHMARKS.md). The epilogue (q8 scale, bias, rounding,
residual) is codegen/kernels/weight_format.py's.

With `tiles` (CPUs with AMX, in steps that bring many rows): tasks of TILE_TASK_ROWS rows, whose
groups of 32 rows × 32 columns take each activation block's integer dots from AMX, a few blocks
per call of a tile micro-kernel (codegen/kernels/cpu/tile_micro.py), then scale them in block order
as above: the same integers and float steps, so the same outputs.
  - q8, q8g: tdpbssd on x's levels and the stored levels, both signed: the dots start from 0.
  - q4, q4a, q4k: per K block the task first writes its panel's nibbles as the bytes above (AND
    0x0F for a stored row's first block, 0xF0 for its second), which tdpbsud takes unsigned; the
    dots start from the same -offset · Σx.
Where the process may not use tiles (kiln_tiles_ready), or the step has fewer rows than a tile, the
same tasks run the vpdpbusd micro-kernels.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat
from kiln.selection.shapes import QUAD, VNNI_LANES, tile_int8_takes, vnni_takes

from ..weight_format import group_minimum, group_scale
from .gemm import panel_and_tile, signature, tile_output
from .int8_gemm import x_block_sums, x_quantizer
from .tile_micro import READY, TILE_ROWS, int8_name

QUAD_DOT = "llvm.x86.avx512.vpdpbusd.512"  # unsigned × signed bytes, four per int32 lane summed in
LANES = VNNI_LANES                         # int32 lanes of a 512-bit register: 16 output columns
ROWS, K_BLOCK, MICRO_ROWS = 48, 512, 6
MICRO_VECTORS, SINGLE_VECTORS = 2, 4       # vectors of 16 columns per step: a micro-tile's, one row's
# with tiles: a task's rows (as bf16_linear.py's), column tiles and activation blocks of a micro-kernel call
TILE_TASK_ROWS, TILE_COLUMNS, TILE_BLOCKS = 128, 2, 4


def supports_tiles(n_out: int, n_in: int, nb: int, fmt: WeightFormat) -> bool:
    return vnni_takes(n_out, n_in, nb, fmt) and tile_int8_takes(fmt)


def tile_kernels(nb: int, fmt: WeightFormat) -> list[tuple]:
    """The tile micro-kernels ("s8" or "u8", row tiles, column tiles, block) the kernel with tiles calls."""
    cols, weights = min(TILE_COLUMNS, nb // LANES), "u8" if fmt.nibbles else "s8"
    return [(weights, 2, cols, fmt.act_block), (weights, 1, cols, fmt.act_block)]



@functools.cache
def vnni_linear_kernel(n_out: int, n_in: int, nb: int, dtype: str, fmt: WeightFormat, has_bias: bool,
                       has_residual: bool, tiles: bool = False):
    """(x [m, n_in], w, scale, [bias,] [residual,] y [m, n_out]), w stored in layout packedNBx4:
    [n_out/nb, n_in/4, 4 nb] int8 (q8), or in packedNBx4nB [n_out/nb, n_in/8, 4 nb] bytes of two
    nibbles (q4, B the activation block); q4's group scales in layout panelsNB: [n_out/nb, n_in/group, nb]."""
    if not vnni_takes(n_out, n_in, nb, fmt):
        raise ValueError(f"the VNNI kernel takes q8/q4 with panels of a multiple of {LANES} columns and "
                         f"activation blocks of whole stored rows, not nb={nb}, {fmt}")
    if tiles and not supports_tiles(n_out, n_in, nb, fmt):
        raise ValueError(f"the VNNI kernel's tiles take activation blocks of 32 or 64 inputs, not {fmt}")
    block, q4, grouped = fmt.act_block, fmt.nibbles, fmt.grouped      # q8g: q8's levels, q4's group scales
    parts = 2 if q4 else 1                             # blocks a stored row holds (q4: one per nibble)
    unit = parts * block                               # inputs of one run of stored rows
    unit_rows = block // QUAD                          # its stored rows
    k_block = next((b for b in (K_BLOCK, 256, 128, 64, 32) if n_in % b == 0 and b % unit == 0), unit)
    blocks, panels, vectors = n_in // block, n_out // nb, nb // LANES
    micro_vectors, single_vectors = min(MICRO_VECTORS, vectors), min(SINGLE_VECTORS, vectors)   # vectors: 1, 2, 4
    w_shape = (panels, n_in // (QUAD * parts), QUAD * nb)
    scale_shape = (panels, fmt.table_rows(n_in), nb) if grouped else (n_out,)   # layout panelsNB
    quantize = x_quantizer(n_in, block, "int8", scale_shift=(lambda b: 4 * (b % parts)) if q4 else None)
    minimums = fmt.has_minimums
    # each block's dots start from -offset · Σx; q4a's from 0, its Σx kept for the minimums' term
    sum_blocks = x_block_sums(n_in, block, times=None if minimums else lambda b: -offset(b % parts))

    def unsigned(w, jo, row, v, part):     # evaluated while parsing: the unsigned operand for 16 columns
        stored = w[jo, row, T.ramp(v * QUAD * LANES, 1, QUAD * LANES)]
        if not q4:
            return stored ^ T.broadcast(T.int8(-128), QUAD * LANES)
        mask = T.Cast("uint8", 15 << 4 * part)                                      # part: low, high nibbles
        return T.reinterpret("int8x64", stored & T.broadcast(mask, QUAD * LANES))

    def offset(part):                      # evaluated while parsing: the unsigned operand's excess over a level
        return fmt.level_offset << 4 * part if q4 else 128

    def dots_start(x_sums, row, b):        # evaluated while parsing
        return T.broadcast(T.int32(0) if minimums else x_sums[row, b], LANES)

    def together(count):                   # evaluated while parsing: blocks a step takes at once
        return parts if count == 1 else 1  # a single row: q4's two blocks of each stored row it loads

    def kb(kbo, step, q, count):           # evaluated while parsing: the activation block of a step's q-th
        return kbo * (k_block // block) + step * together(count) + q

    def part(kbo, step, q, count):         # evaluated while parsing: which nibbles of its stored rows hold it
        return kb(kbo, step, q, count) % parts

    def x_quad(xq, row, k):                # evaluated while parsing: levels k .. k + 3 in every int32 lane
        return T.reinterpret("int8x64", T.broadcast(T.reinterpret("int32", xq[row, T.ramp(k, 1, QUAD)]), LANES))

    def block_scale(sx, scale, row, b, jo, vector):   # evaluated while parsing: float32x16, the GEMM's rounding
        x_scale = T.broadcast(sx[row, b], LANES)
        if not grouped or scale is None:   # q8's weight scale is per output: applied in the epilogue
            return x_scale
        columns = T.ramp(vector * LANES, 1, LANES)
        group = b * block // fmt.group_size
        return x_scale * group_scale(fmt, lambda table_row: scale[jo, table_row, columns], group, LANES)

    def minimum_term(sx, x_sums, scale, row, b, jo, vector):   # evaluated while parsing: q4a's Σx · sx · minimum
        true_scale = sx[row, b] * T.Cast("float32", 1 + 15 * (b % parts))     # x's scale as the scheme has it
        columns = T.ramp(vector * LANES, 1, LANES)
        group = b * block // fmt.group_size
        minimum = group_minimum(fmt, lambda table_row: scale[jo, table_row, columns], group, LANES)
        return T.broadcast(T.Cast("float32", x_sums[row, b]), LANES) * (T.broadcast(true_scale, LANES) * minimum)

    @T.macro
    def micro(xq, sx, x_sums, w, acc, dots, sums, scale, jo, row0, r0, kbo, s, count, width):
        """acc[r0 : r0 + count, vectors s·width ...] += the block-scaled dots over K block kbo,
        summed in registers (sums) for the K block."""
        for r in T.unroll(count):
            for v in T.unroll(width):
                sums[r, T.ramp(v * LANES, 1, LANES)] = acc[r0 + r, T.ramp((s * width + v) * LANES, 1, LANES)]
        for step in range(k_block // block // together(count)):
            for q in T.unroll(together(count)):
                for r in T.unroll(count):
                    for v in T.unroll(width):
                        dots[q * count + r, T.ramp(v * LANES, 1, LANES)] = dots_start(
                            x_sums, row0 + r0 + r, kb(kbo, step, q, count))
            for kr in T.unroll(unit_rows):
                for v in T.unroll(width):
                    for q in T.unroll(together(count)):
                        for r in T.unroll(count):
                            dots[q * count + r, T.ramp(v * LANES, 1, LANES)] = T.call_llvm_pure_intrin(
                                "int32x16", QUAD_DOT, dots[q * count + r, T.ramp(v * LANES, 1, LANES)],
                                unsigned(w, jo, kb(kbo, step, q, count) // parts * unit_rows + kr, s * width + v,
                                         part(kbo, step, q, count)),
                                x_quad(xq, row0 + r0 + r, kb(kbo, step, q, count) * block + kr * QUAD))
            for q in T.unroll(together(count)):
                for r in T.unroll(count):
                    for v in T.unroll(width):
                        sums[r, T.ramp(v * LANES, 1, LANES)] = sums[r, T.ramp(v * LANES, 1, LANES)] + T.Cast(
                            "float32x16", dots[q * count + r, T.ramp(v * LANES, 1, LANES)]) * block_scale(
                                sx, scale, row0 + r0 + r, kb(kbo, step, q, count), jo, s * width + v)
                        if minimums:
                            sums[r, T.ramp(v * LANES, 1, LANES)] = sums[r, T.ramp(v * LANES, 1, LANES)] + \
                                minimum_term(sx, x_sums, scale, row0 + r0 + r, kb(kbo, step, q, count), jo,
                                             s * width + v)
        for r in T.unroll(count):
            for v in T.unroll(width):
                acc[r0 + r, T.ramp((s * width + v) * LANES, 1, LANES)] = sums[r, T.ramp(v * LANES, 1, LANES)]

    task_rows = TILE_TASK_ROWS if tiles else ROWS
    cols = min(TILE_COLUMNS, vectors)
    group = 2 * TILE_ROWS                            # rows of a two-row-tile micro-kernel
    k_blocks = k_block // block
    chunk = max(c for c in range(1, TILE_BLOCKS + 1) if k_blocks % c == 0)    # blocks per micro-kernel call
    tile_weights = "u8" if q4 else "s8"

    def tile_start(x_sums, row, b):        # evaluated while parsing: what a block's tile dots start from
        return dots_start(x_sums, row, b) if q4 else T.broadcast(T.int32(0), LANES)

    @T.macro
    def vector_dots(xq, sx, x_sums, w, acc, dots, sums, scale, jo, row0, rows, full, kbo):
        for t, s in T.grid(full, vectors // micro_vectors):
            micro(xq, sx, x_sums, w, acc, dots, sums, scale, jo, row0, t * MICRO_ROWS, kbo, s,
                  MICRO_ROWS, micro_vectors)
        for r, s in T.grid(rows - full * MICRO_ROWS, vectors // single_vectors):
            micro(xq, sx, x_sums, w, acc, dots, sums, scale, jo, row0, full * MICRO_ROWS + r, kbo, s,
                  1, single_vectors)

    def tile_operand(w, wb, jo, kbo, c, s):   # evaluated while parsing: where the chunk's B tiles start
        if q4:        # the bytes written for this K block: block b's stored rows at wb[b]
            return T.address_of(wb[c * chunk, 0, s * cols * LANES * QUAD])
        return T.address_of(w[jo, (kbo * k_block + c * chunk * block) // QUAD, s * cols * LANES * QUAD])

    @T.macro
    def nibble_bytes(w, wb, jo, kbo):
        """wb[b] = the bytes of the K block's activation block b: its stored rows' nibbles, masked."""
        for b, kr in T.grid(k_blocks, unit_rows):
            for i in T.vectorized(QUAD * nb):
                wb[b, kr, i] = w[jo, (kbo * k_blocks + b) // parts * unit_rows + kr, i] & T.Cast(
                    "uint8", 15 << 4 * (b % parts))

    @T.macro
    def tile_call(name, tdots, xq, operand, g, row0, kbo, c, rows):
        T.evaluate(T.call_extern("void", name, T.address_of(tdots[0, 0, 0]), T.int64(cols * LANES * 4),
                                 T.int64(group * cols * LANES * 4),
                                 T.address_of(xq[row0 + g * group, kbo * k_block + c * chunk * block]),
                                 T.int64(n_in), operand, T.int64(QUAD * nb), T.Cast("int64", rows), T.int64(chunk)))

    @T.macro
    def tile_dots(xq, sx, x_sums, w, wb, acc, tdots, scale, jo, row0, rows, kbo):
        if q4:
            nibble_bytes(w, wb, jo, kbo)
        for g, s, c in T.grid((rows + group - 1) // group, vectors // cols, k_blocks // chunk):
            if rows - g * group > TILE_ROWS:
                tile_call(int8_name(2, cols, block, tile_weights), tdots, xq, tile_operand(w, wb, jo, kbo, c, s), g,
                          row0, kbo, c, T.min(group, rows - g * group))
            else:
                tile_call(int8_name(1, cols, block, tile_weights), tdots, xq, tile_operand(w, wb, jo, kbo, c, s), g,
                          row0, kbo, c, rows - g * group)
            for b, r in T.grid(chunk, T.min(group, rows - g * group)):
                for v in T.unroll(cols):
                    acc[g * group + r, T.ramp((s * cols + v) * LANES, 1, LANES)] = acc[
                        g * group + r, T.ramp((s * cols + v) * LANES, 1, LANES)] + T.Cast(
                            "float32x16", tdots[b, r, T.ramp(v * LANES, 1, LANES)] + tile_start(
                                x_sums, row0 + g * group + r, kbo * k_blocks + c * chunk + b)) * block_scale(
                                sx, scale, row0 + g * group + r, kbo * k_blocks + c * chunk + b, jo, s * cols + v)
                    if minimums:
                        acc[g * group + r, T.ramp((s * cols + v) * LANES, 1, LANES)] = acc[
                            g * group + r, T.ramp((s * cols + v) * LANES, 1, LANES)] + minimum_term(
                                sx, x_sums, scale, row0 + g * group + r, kbo * k_blocks + c * chunk + b, jo,
                                s * cols + v)

    @T.macro
    def vnni(x, w, scale, bias, residual, y, m):
        xq = T.alloc_buffer((m, n_in), "int8")
        sx = T.alloc_buffer((m, blocks), "float32")
        x_sums = T.alloc_buffer((m, blocks), "int32")
        quantize(x, xq, sx, m)
        sum_blocks(xq, x_sums, m)
        for task in T.parallel(panels * ((m + task_rows - 1) // task_rows)):
            with T.sblock("tile"):
                jo = T.axis.spatial(panels, panel_and_tile(task, m, task_rows)[0])
                io = T.axis.spatial((m + task_rows - 1) // task_rows, panel_and_tile(task, m, task_rows)[1])
                T.reads(xq[io * task_rows:io * task_rows + task_rows, 0:n_in],
                        sx[io * task_rows:io * task_rows + task_rows, 0:blocks],
                        x_sums[io * task_rows:io * task_rows + task_rows, 0:blocks], w[jo, 0:w_shape[1], 0:w_shape[2]])
                T.writes(y[io * task_rows:io * task_rows + task_rows, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((task_rows, nb), "float32")
                dots = T.sblock_alloc_buffer((max(MICRO_ROWS, parts), SINGLE_VECTORS * LANES), "int32", scope="local")
                sums = T.sblock_alloc_buffer((MICRO_ROWS, SINGLE_VECTORS * LANES), "float32", scope="local")
                if tiles:
                    tdots = T.sblock_alloc_buffer((chunk, group, cols * LANES), "int32")
                    wb = T.sblock_alloc_buffer((k_blocks, block // QUAD, QUAD * nb), "uint8")
                rows = T.min(task_rows, m - io * task_rows)
                full = rows // MICRO_ROWS
                for r in range(rows):
                    for c in T.vectorized(nb):
                        acc[r, c] = T.float32(0)
                for kbo in range(n_in // k_block):
                    if tiles:
                        if m >= TILE_ROWS and T.call_extern("int32", READY) != 0:
                            tile_dots(xq, sx, x_sums, w, wb, acc, tdots, scale, jo, io * task_rows, rows, kbo)
                        else:
                            vector_dots(xq, sx, x_sums, w, acc, dots, sums, scale, jo, io * task_rows, rows, full, kbo)
                    else:
                        vector_dots(xq, sx, x_sums, w, acc, dots, sums, scale, jo, io * task_rows, rows, full, kbo)
                for r in range(rows):
                    for c in T.vectorized(nb):
                        y[io * task_rows + r, jo * nb + c] = tile_output(acc, fmt, dtype, scale, bias, residual,
                                                                         io * task_rows, jo * nb, r, c)

    return signature(vnni, n_in, n_out, w_shape, dtype, "uint8" if q4 else "int8", scale_shape,
                     fmt.table_dtype, has_bias, has_residual)
