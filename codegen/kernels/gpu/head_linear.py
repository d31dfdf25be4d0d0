"""MLA's per-head linear on GPUs (the CPU's is codegen/kernels/cpu/mla.py): out[t, h] = x[t, h] · w[h]
in float32, a thread block per (token, head) and a thread per output."""
from __future__ import annotations

import functools

from tvm.script import tirx as T


@functools.cache
def head_linear_kernel(heads: int, k_in: int, n_out: int, dtype: str):
    """(x [T, H, K], w [H, K, N], out [T, H, N])."""

    @T.prim_func(private=True, s_tir=True)
    def head_linear_gpu(var_x: T.handle, var_w: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens = T.int64()
        x = T.match_buffer(var_x, (tokens, heads, k_in), dtype)
        w = T.match_buffer(var_w, (heads, k_in, n_out), dtype)
        out = T.match_buffer(var_out, (tokens, heads, n_out), dtype)
        for task in T.thread_binding(tokens * heads, thread="blockIdx.x"):
            for n in T.thread_binding(n_out, thread="threadIdx.x"):
                with T.sblock("head"):
                    t = T.axis.spatial(tokens, task // heads)
                    h = T.axis.spatial(heads, task % heads)
                    vn = T.axis.spatial(n_out, n)
                    T.reads(x[t, h, 0:k_in], w[h, 0:k_in, vn])
                    T.writes(out[t, h, vn])
                    acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
                    acc[0] = T.float32(0)
                    for k in range(k_in):
                        acc[0] = acc[0] + T.Cast("float32", x[t, h, k]) * T.Cast("float32", w[h, k, vn])
                    out[t, h, vn] = T.Cast(dtype, acc[0])
    return head_linear_gpu
