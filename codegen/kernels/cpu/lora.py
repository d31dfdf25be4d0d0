"""kiln's CPU LoRA kernel (ir/lora_ops.py): y[t] += each module's part of x[t] · a[s]ᵀ times b[s] in its
columns, for each row t whose slot s = slots[t] is not -1, in place on y, rows in parallel.

Each row is a gathered matrix-vector product pair (Punica's BGMV): the shrink h = a[s] · x[t]
(P·R rank rows, each a dot product over the inputs in lanes of partial sums, vectorised, summed at the
end) and the expand y[t, n] += Σ_r h[j·R + r] · b[s, r, n] for the columns n of module j (b's rows are
contiguous over the outputs, so the outputs vectorise with the rank as the outer loop; the lanes
divide every module's width, so a vector's columns share one module). Everything is in float32; y is
rounded once. A step whose rows share an adapter reads its matrices from cache once per row: adapters
are small (rank · (in + out)).
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
        for t in T.parallel(tokens):
            with T.sblock("row"):
                i = T.axis.spatial(tokens, t)
                T.reads(x[i, 0:n_in], a[0:slots, 0:rank_rows, 0:n_in], b[0:slots, 0:rank, 0:n_out], row_slots[i])
                T.writes(y[i, 0:n_out])
                h = T.sblock_alloc_buffer((rank_rows,), "float32")
                part = T.sblock_alloc_buffer((lanes_in,), "float32")
                acc = T.sblock_alloc_buffer((lanes_out,), "float32")
                s = row_slots[i]
                if s >= 0:
                    for r in range(rank_rows):
                        for lane in T.vectorized(lanes_in):
                            part[lane] = T.float32(0)
                        for k in range(n_in // lanes_in):
                            for lane in T.vectorized(lanes_in):
                                part[lane] = part[lane] + T.Cast("float32", x[i, k * lanes_in + lane]) * T.Cast(
                                    "float32", a[s, r, k * lanes_in + lane])
                        h[r] = T.float32(0)
                        for lane in range(lanes_in):
                            h[r] = h[r] + part[lane]
                    for n in range(n_out // lanes_out):
                        for lane in T.vectorized(lanes_out):
                            acc[lane] = T.Cast("float32", y[i, n * lanes_out + lane])
                        for r in range(rank):
                            for lane in T.vectorized(lanes_out):
                                acc[lane] = acc[lane] + h[_module_of(n * lanes_out, ends) * rank + r] * T.Cast(
                                    "float32", b[s, r, n * lanes_out + lane])
                        for lane in T.vectorized(lanes_out):
                            y[i, n * lanes_out + lane] = T.Cast(dtype, acc[lane])
    return lora
