"""kiln's register-blocked CPU GEMM over packed weights, for steps that bring many rows (prefill chunks).

The packed GEMV schedule (codegen/kernels/cpu/packed_linear.py) decodes every weight element to float32 once per row,
so a chunk pays a conversion per multiply-add. Here a task owns one weight panel (nb output
columns) and a tile of up to ROWS rows, and walks the reduction in blocks of K_BLOCK:
  1. decode the panel's block [K_BLOCK, nb] to float32 once (bf16 widened, q8/fp8 cast, q4 nibbles
     times their group scale), and the tile's rows of x [ROWS, K_BLOCK] likewise;
  2. a micro-kernel multiplies MICRO_ROWS rows by `2 × vector lanes` columns per step: its
     accumulators stay in registers across the block (12 of AVX2's 16 ymm registers), each
     decoded weight vector serves MICRO_ROWS rows and each broadcast x value two vectors.
Rows that do not fill a micro-kernel run one at a time, each over the panel's nb columns (enough
independent accumulators to keep the FMA units busy), so one decode row costs one row.
The epilogue (q8/fp8 scale, bias, rounding, residual) is codegen/kernels/weight_format.py's.
"""
from __future__ import annotations

import functools

import tvm
from tvm.script import tirx as T

from kiln.selection.formats import WeightFormat

from ..weight_format import epilogue, epilogue_scale, weight_value

ROWS, K_BLOCK, MICRO_ROWS = 48, 128, 6     # measured on a 2-vCPU Zen 3 VM: docs/BENCHMARKS.md


def vector_lanes(target) -> int:
    """float32 lanes of the target's vector registers: 16 with AVX-512, 8 with AVX2, else 4 (SSE, NEON).
    (llvm_get_vector_width says 512 for an AVX2-only znver3, so ask for the features.)"""
    has = tvm.target.codegen.llvm_cpu_has_features
    if "x86" not in str(target.attrs.get("mtriple", "")):
        return 4
    return 16 if has(["avx512f"], target) else 8 if has(["avx2"], target) else 4


@functools.cache
def packed_gemm_kernel(n_out: int, n_in: int, nb: int, dtype: str, fmt: WeightFormat, weight_dtype: str,
                       has_bias: bool, has_residual: bool, lanes: int):
    """(x [m, n_in], w [n_out/nb, n_in', nb], [scale,] [bias,] [residual,] y [m, n_out])."""
    width = min(2 * lanes, nb)
    k_block = next(b for b in (K_BLOCK, 64, 32, 16, 8, 4, 2, 1) if n_in % b == 0)
    panels, slices = n_out // nb, nb // width
    stored_in = n_in // 2 if fmt.nibbles else n_in
    scale_shape = ((fmt.table_rows(n_in), n_out) if fmt.grouped
                   else (n_out,) if fmt.kind in ("q8", "fp8") else None)
    scaled_format = scale_shape is not None
    scale_dtype = fmt.table_dtype

    def weight(w, scale, jo, k, c):                 # evaluated while parsing: the decoded W[j, k]
        if scale is None and scaled_format:       # a signature this format never uses
            return T.float32(0)
        return weight_value(fmt, lambda j, kk: w[jo, kk, c], scale, jo * nb + c, k)

    @T.macro
    def gemm(x, w, scale, bias, residual, y, m):
        for task in T.parallel(panels * ((m + ROWS - 1) // ROWS)):
            with T.sblock("tile"):
                jo = T.axis.spatial(panels, panel_and_tile(task, m, ROWS)[0])
                io = T.axis.spatial((m + ROWS - 1) // ROWS, panel_and_tile(task, m, ROWS)[1])
                T.reads(x[io * ROWS:io * ROWS + ROWS, 0:n_in], w[jo, 0:stored_in, 0:nb])
                T.writes(y[io * ROWS:io * ROWS + ROWS, jo * nb:jo * nb + nb])
                acc = T.sblock_alloc_buffer((ROWS, nb), "float32")
                wf = T.sblock_alloc_buffer((k_block, nb), "float32")
                xf = T.sblock_alloc_buffer((ROWS, k_block), "float32")
                rows = T.min(ROWS, m - io * ROWS)
                tiles = rows // MICRO_ROWS
                for r, c in T.grid(ROWS, nb):
                    acc[r, c] = T.float32(0)
                for kbo in range(n_in // k_block):
                    for kk in range(k_block):
                        for c in T.vectorized(nb):
                            wf[kk, c] = weight(w, scale, jo, kbo * k_block + kk, c)
                    for r in range(rows):
                        for kk in T.vectorized(k_block):
                            xf[r, kk] = T.Cast("float32", x[io * ROWS + r, kbo * k_block + kk])
                    for t in range(tiles):
                        for s in range(slices):
                            for kk in range(k_block):
                                for r in T.unroll(MICRO_ROWS):
                                    for c in T.vectorized(width):
                                        acc[t * MICRO_ROWS + r, s * width + c] = (
                                            acc[t * MICRO_ROWS + r, s * width + c]
                                            + xf[t * MICRO_ROWS + r, kk] * wf[kk, s * width + c])
                    for r in range(tiles * MICRO_ROWS, rows):      # the rest, a row at a time: the
                        for kk in range(k_block):                   # panel's nb columns in registers
                            for c in T.vectorized(nb):
                                acc[r, c] = acc[r, c] + xf[r, kk] * wf[kk, c]
                for r in range(rows):
                    for c in T.vectorized(nb):
                        y[io * ROWS + r, jo * nb + c] = tile_output(acc, fmt, dtype, scale, bias, residual,
                                                                    io * ROWS, jo * nb, r, c)

    return signature(gemm, n_in, n_out, (panels, stored_in, nb), dtype, weight_dtype,
                     scale_shape, scale_dtype, has_bias, has_residual)


def panel_and_tile(task, m, rows: int):
    """(weight panel, row tile) of a task when m rows are split in tiles of `rows`: a panel's row
    tiles are side by side, so each thread's share of the tasks is whole panels (balanced whatever
    the last tile holds), each read from memory once and then from cache."""
    tiles = (m + rows - 1) // rows
    return task // tiles, task % tiles


def tile_output(acc, fmt: WeightFormat, dtype: str, scale, bias, residual, row0, col0, r, c):
    """y[row0 + r, col0 + c] from a tile's float32 accumulators acc [rows, nb] (evaluated while
    parsing): the linear's epilogue, which indexes the whole output."""
    class Tile:
        def __getitem__(self, ij):
            return acc[ij[0] - row0, ij[1] - col0]
    return epilogue(Tile(), epilogue_scale(fmt, scale), bias, residual, dtype)(row0 + r, col0 + c)


def signature(body, n_in: int, n_out: int, w_shape: tuple, dtype: str, weight_dtype: str, scale_shape: tuple | None,
              scale_dtype: str, has_bias: bool, has_residual: bool):
    """The PrimFunc around `body(x, w, scale, bias, residual, y, m)` (a T.macro; absent inputs None)
    that takes the optional inputs the linear has, in the packed GEMV kernel's argument order. Only
    the signature asked for is parsed (parsing the body is most of a kernel's build time here)."""
    key = (scale_shape is not None, has_bias, has_residual)
    parsed_scale_shape = scale_shape or (1,)

    if key == (False, False, False):
        @T.prim_func(private=True, s_tir=True)
        def plain(var_x: T.handle, var_w: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, None, None, None, y, m)
        return plain

    if key == (True, False, False):
        @T.prim_func(private=True, s_tir=True)
        def scaled(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            scale = T.match_buffer(var_s, parsed_scale_shape, scale_dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, scale, None, None, y, m)
        return scaled

    if key == (False, True, False):
        @T.prim_func(private=True, s_tir=True)
        def with_bias(var_x: T.handle, var_w: T.handle, var_b: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            bias = T.match_buffer(var_b, (n_out,), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, None, bias, None, y, m)
        return with_bias

    if key == (False, False, True):
        @T.prim_func(private=True, s_tir=True)
        def with_residual(var_x: T.handle, var_w: T.handle, var_r: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            residual = T.match_buffer(var_r, (m, n_out), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, None, None, residual, y, m)
        return with_residual

    if key == (True, True, False):
        @T.prim_func(private=True, s_tir=True)
        def scaled_with_bias(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_b: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            scale = T.match_buffer(var_s, parsed_scale_shape, scale_dtype)
            bias = T.match_buffer(var_b, (n_out,), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, scale, bias, None, y, m)
        return scaled_with_bias

    if key == (True, False, True):
        @T.prim_func(private=True, s_tir=True)
        def scaled_with_residual(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_r: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            scale = T.match_buffer(var_s, parsed_scale_shape, scale_dtype)
            residual = T.match_buffer(var_r, (m, n_out), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, scale, None, residual, y, m)
        return scaled_with_residual

    if key == (False, True, True):
        @T.prim_func(private=True, s_tir=True)
        def with_bias_and_residual(var_x: T.handle, var_w: T.handle, var_b: T.handle, var_r: T.handle,
                                   var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            bias = T.match_buffer(var_b, (n_out,), dtype)
            residual = T.match_buffer(var_r, (m, n_out), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, None, bias, residual, y, m)
        return with_bias_and_residual

    if key == (True, True, True):
        @T.prim_func(private=True, s_tir=True)
        def scaled_with_bias_and_residual(var_x: T.handle, var_w: T.handle, var_s: T.handle, var_b: T.handle,
                                          var_r: T.handle, var_y: T.handle):
            T.func_attr({"tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(var_x, (m, n_in), dtype)
            w = T.match_buffer(var_w, w_shape, weight_dtype)
            scale = T.match_buffer(var_s, parsed_scale_shape, scale_dtype)
            bias = T.match_buffer(var_b, (n_out,), dtype)
            residual = T.match_buffer(var_r, (m, n_out), dtype)
            y = T.match_buffer(var_y, (m, n_out), dtype)
            body(x, w, scale, bias, residual, y, m)
        return scaled_with_bias_and_residual
    raise AssertionError(f"no signature for {key}")
