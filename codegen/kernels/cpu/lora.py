"""kiln's CPU LoRA kernel (ir/lora_ops.py): y[t] += each module's part of x[t] · a[s]ᵀ times b[s] in its
columns, for each row t whose slot s = slots[t] is not -1, in place on y.

The step's rows go in tiles of TILE (in parallel), and a tile's rows in runs that share a slot: a decode
step's rows, each on its own adapter, are runs of one (Punica's BGMV, a gathered matrix-vector product
each); a prompt's rows are runs of TILE (its SGMV: each of the adapter's rows read once for the run).
For a run on slot s: the shrink h = a[s] · x[row] (P·R rank rows, each a dot product over the inputs
in lanes of partial sums, vectorised, summed at the end), then the expand y[row, n] += Σ_r h[j·R + r] ·
b[s, r, n] for the columns n of module j (b's rows are contiguous over the outputs, so the outputs
vectorise with the rank as the outer loop; the lanes divide every module's width, so a vector's
columns share one module). Everything is in float32; y is rounded once.
Signature, y written in place: (y [T, out], x [T, in], a [S, P·R, in], b [S, R, out], slots [T] i32); a and b
may be of another dtype than x and y (bfloat16 beside float32 activations: half the bytes a step reads).
"""
from __future__ import annotations

import functools
import math

from tvm.script import tirx as T


def _lanes(width: int) -> int:
    return next(lanes for lanes in (16, 8, 4, 2, 1) if width % lanes == 0)


def _module_of(column, ends: tuple[int, ...]):
    """The module (0..P-1) whose columns hold `column` (a TIR expression), from the modules' end columns."""
    module = T.int32(0)
    for end in ends[:-1]:
        module = module + T.Cast("int32", column >= end)
    return module


TILE = 4                # rows a task takes; a run of rows on one slot reads the adapter once


@functools.cache
def cpu_lora(n_in: int, rows: tuple[int, ...], rank: int, slots: int, dtype: str, adapter_dtype: str):
    n_out, rank_rows = sum(rows), rank * len(rows)
    ends = tuple(sum(rows[:j + 1]) for j in range(len(rows)))
    lanes_in, lanes_out = _lanes(n_in), _lanes(math.gcd(*rows))

    @T.prim_func(private=True, s_tir=True)
    def lora(var_y: T.handle, var_x: T.handle, var_a: T.handle, var_b: T.handle, var_slots: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens = T.int64()
        y = T.match_buffer(var_y, (tokens, n_out), dtype)
        x = T.match_buffer(var_x, (tokens, n_in), dtype)
        a = T.match_buffer(var_a, (slots, rank_rows, n_in), adapter_dtype)
        b = T.match_buffer(var_b, (slots, rank, n_out), adapter_dtype)
        row_slots = T.match_buffer(var_slots, (tokens,), "int32")
        for task in T.parallel((tokens + TILE - 1) // TILE):
            with T.sblock("tile"):
                tile = T.axis.spatial((tokens + TILE - 1) // TILE, task)
                T.reads(x[0:tokens, 0:n_in], a[0:slots, 0:rank_rows, 0:n_in], b[0:slots, 0:rank, 0:n_out],
                        row_slots[0:tokens])
                T.writes(y[0:tokens, 0:n_out])
                h = T.sblock_alloc_buffer((TILE, rank_rows), "float32")
                part = T.sblock_alloc_buffer((TILE, lanes_in), "float32")
                acc = T.sblock_alloc_buffer((TILE, lanes_out), "float32")
                run = T.sblock_alloc_buffer((2,), "int32")              # the run's length; whether it goes on
                first = tile * TILE
                for q in range(TILE):
                    # a run starts at row q where the row before it (in the tile) is on another slot
                    if first + q < tokens and (q == 0 or row_slots[first + q] != row_slots[first + q - 1]):
                        s = row_slots[first + q]
                        run[0] = 1
                        run[1] = 1
                        for j in range(1, TILE):
                            if run[1] == 1 and q + j < TILE and first + q + j < tokens:
                                if row_slots[first + q + j] == s:
                                    run[0] = run[0] + 1
                                else:
                                    run[1] = 0
                            else:
                                run[1] = 0
                        if s >= 0:
                            for r in range(rank_rows):
                                for p in range(run[0]):
                                    for lane in T.vectorized(lanes_in):
                                        part[p, lane] = T.float32(0)
                                for k in range(n_in // lanes_in):
                                    for p in range(run[0]):
                                        for lane in T.vectorized(lanes_in):
                                            part[p, lane] = part[p, lane] + T.Cast(
                                                "float32", x[first + q + p, k * lanes_in + lane]) * T.Cast(
                                                "float32", a[s, r, k * lanes_in + lane])
                                for p in range(run[0]):
                                    h[p, r] = T.float32(0)
                                    for lane in range(lanes_in):
                                        h[p, r] = h[p, r] + part[p, lane]
                            for n in range(n_out // lanes_out):
                                for p in range(run[0]):
                                    for lane in T.vectorized(lanes_out):
                                        acc[p, lane] = T.Cast("float32", y[first + q + p, n * lanes_out + lane])
                                for r in range(rank):
                                    for p in range(run[0]):
                                        for lane in T.vectorized(lanes_out):
                                            acc[p, lane] = acc[p, lane] + h[p, _module_of(n * lanes_out, ends)
                                                                            * rank + r] * T.Cast(
                                                "float32", b[s, r, n * lanes_out + lane])
                                for p in range(run[0]):
                                    for lane in T.vectorized(lanes_out):
                                        y[first + q + p, n * lanes_out + lane] = T.Cast(dtype, acc[p, lane])
    return lora
