"""kiln's quantising KV append kernel: write each new token's K and V rows into quantised pages.

Each row (one token, one KV head, k or v) is stored as q = x / scale with
scale = max|x| / qmax (1 for an all-zero row), exactly as ir/quant.py KVScheme.quantize_rows:
int8 rounds half to even and clips to ±qmax, float8 e4m3 converts. One task per (token, KV head).
Signature, pages and scales written in place:
    (pages [P, 2, H, S, D], scales [P, 2, H, S] f32, k [T, H, D], v [T, H, D], slot_mapping [T] i32)
A negative slot means "no row to write" (a padding token).
"""
from __future__ import annotations

from tvm.script import tirx as T

from kiln.ir.quant import KVScheme


def quantized_kv_append(kv_heads: int, head_dim: int, page_size: int, dtype: str, scheme: KVScheme):
    storage, qmax = scheme.storage_dtype, scheme.qmax

    def encode(x):
        if scheme.rounds:
            return T.Cast(storage, T.max(T.min(T.nearbyint(x), T.float32(qmax)), T.float32(-qmax)))
        return T.Cast(storage, x)

    @T.prim_func(private=True, s_tir=True)
    def kv_append_quantized(var_pages: T.handle, var_scales: T.handle, var_k: T.handle, var_v: T.handle,
                            var_slots: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, tokens = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, (num_pages, 2, kv_heads, page_size, head_dim), storage)
        scales = T.match_buffer(var_scales, (num_pages, 2, kv_heads, page_size), "float32")
        k = T.match_buffer(var_k, (tokens, kv_heads, head_dim), dtype)
        v = T.match_buffer(var_v, (tokens, kv_heads, head_dim), dtype)
        slots = T.match_buffer(var_slots, (tokens,), "int32")
        for task in T.parallel(tokens * kv_heads):
            with T.sblock("append"):
                t = T.axis.spatial(tokens, task // kv_heads)
                h = T.axis.spatial(kv_heads, task % kv_heads)
                T.reads(slots[t], k[t, h, 0:head_dim], v[t, h, 0:head_dim])
                T.writes(pages[0:num_pages, 0:2, h, 0:page_size, 0:head_dim], scales[0:num_pages, 0:2, h, 0:page_size])
                row = T.sblock_alloc_buffer((2, head_dim), "float32")
                amax = T.sblock_alloc_buffer((2,), "float32")
                if slots[t] >= 0:
                    page = slots[t] // page_size
                    slot_row = slots[t] % page_size
                    amax[0] = T.float32(0)
                    amax[1] = T.float32(0)
                    for d in range(head_dim):
                        row[0, d] = T.Cast("float32", k[t, h, d])
                        row[1, d] = T.Cast("float32", v[t, h, d])
                        amax[0] = T.max(amax[0], T.fabs(row[0, d]))
                        amax[1] = T.max(amax[1], T.fabs(row[1, d]))
                    for kind in range(2):
                        scales[page, kind, h, slot_row] = T.if_then_else(
                            amax[kind] > T.float32(0), amax[kind] / T.float32(qmax), T.float32(1))
                        for d in range(head_dim):
                            pages[page, kind, h, slot_row, d] = encode(row[kind, d] / scales[page, kind, h, slot_row])

    return kv_append_quantized
