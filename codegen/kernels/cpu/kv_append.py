"""kiln's CPU KV append kernel: write each new token's K and V rows into the pages.

K and V are read from the fused projection qkv [T, (Hq + 2 Hkv) D] (k at column Hq·D, v after
it), with rope applied to k as it is read when `rope` is set. Pages are the model dtype, or a
quantised KV scheme (ir/quant.py KVScheme): each row (one token, one KV head, k or v) stored as
q = x / scale with scale = max|x| / qmax (1 for an all-zero row), int8 rounding half to even and
clipping to ±qmax, float8 converting. One task per (token, KV head).
Signature, pages (and scales) written in place, shaped by the layer's KVSpec (`page_shape`):
    (pages [P, 2, Hkv, S, D], [scales [P, 2, Hkv, S] f32,] qkv, positions [T] i32, inv_freq [D/2] f32,
     slot_mapping [T] i32)
A negative slot means "no row to write" (a padding token).
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.interface import KVSpec
from kiln.ir.quant import KVScheme, kv_scheme_for

from ..rope_load import RotaryLoad, computed_trig, load_head_element, rope_angle


def row_encoder(scheme: KVScheme | None, dtype: str):
    """encode(x, scale): a float32 value as a KV page stores it, used while a kernel is parsed:
    rounded to `dtype` (scale None), or x / scale in the scheme's storage dtype, int8 rounding half
    to even and clipping to ±qmax, float8 converting."""
    storage = scheme.storage_dtype if scheme else dtype
    qmax = scheme.qmax if scheme else 1.0

    def encode(x, scale):            # both of a kernel's variants are parsed, the scaled one unquantised too
        if scale is None:
            return T.Cast(storage, x)
        if scheme is not None and scheme.rounds:
            return T.Cast(storage, T.max(T.min(T.nearbyint(x / scale), T.float32(qmax)), T.float32(-qmax)))
        return T.Cast(storage, x / scale)
    return encode


@functools.cache                    # every layer asks for the same kernel: parse it once
def cpu_kv_append(q_heads: int, spec: KVSpec, dtype: str, rope: RotaryLoad | None):
    kv_heads, head_dim, page_size, storage = spec.kv_heads, spec.head_dim, spec.page_size, spec.dtype
    scheme = kv_scheme_for(storage)
    qmax = scheme.qmax if scheme else 1.0
    encode = row_encoder(scheme, dtype)
    width = (q_heads + 2 * kv_heads) * head_dim
    freqs = (rope.rotary_dim if rope else head_dim) // 2
    rotated_freqs = freqs if rope else 0                 # the angles a task computes ahead

    @T.macro
    def append(pages, scales, qkv, positions, inv_freq, slots, tokens):
        for task in T.parallel(tokens * kv_heads):
            with T.sblock("append"):
                t = T.axis.spatial(tokens, task // kv_heads)
                h = T.axis.spatial(kv_heads, task % kv_heads)
                T.reads(slots[t], qkv[t, 0:width], positions[t], inv_freq[0:freqs])
                T.writes(pages[0:pages.shape[0], 0:2, h, 0:page_size, 0:head_dim],
                         *([] if scales is None else [scales[0:pages.shape[0], 0:2, h, 0:page_size]]))
                row = T.sblock_alloc_buffer((2, head_dim), "float32")
                amax = T.sblock_alloc_buffer((2,), "float32")
                trig = T.sblock_alloc_buffer((2, freqs), "float32")     # cos, sin of the token's angles
                if slots[t] >= 0:
                    page = slots[t] // page_size
                    slot_row = slots[t] % page_size
                    amax[0] = T.float32(0)
                    amax[1] = T.float32(0)
                    for f in range(rotated_freqs):                       # once per angle, not per element
                        trig[0, f] = T.cos(rope_angle(positions, inv_freq, t, f))
                        trig[1, f] = T.sin(rope_angle(positions, inv_freq, t, f))
                    for d in range(head_dim):
                        row[0, d] = load_head_element(qkv, positions, inv_freq, t, (q_heads + h) * head_dim, d,
                                                      dtype, rope, computed_trig(trig))
                        row[1, d] = T.Cast("float32", qkv[t, (q_heads + kv_heads + h) * head_dim + d])
                        amax[0] = T.max(amax[0], T.fabs(row[0, d]))
                        amax[1] = T.max(amax[1], T.fabs(row[1, d]))
                    for kind in range(2):
                        if scales is not None:
                            scales[page, kind, h, slot_row] = T.if_then_else(
                                amax[kind] > T.float32(0), amax[kind] / T.float32(qmax), T.float32(1))
                        for d in range(head_dim):
                            pages[page, kind, h, slot_row, d] = encode(
                                row[kind, d], None if scales is None else scales[page, kind, h, slot_row])

    if scheme is None:   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def kv_append(var_pages: T.handle, var_qkv: T.handle, var_positions: T.handle, var_inv_freq: T.handle,
                      var_slots: T.handle):
            T.func_attr({"tirx.noalias": True})
            num_pages, tokens, n_pos = T.int64(), T.int64(), T.int64()
            pages = T.match_buffer(var_pages, spec.page_shape(num_pages), storage)
            qkv = T.match_buffer(var_qkv, (tokens, width), dtype)
            positions = T.match_buffer(var_positions, (n_pos,), "int32")
            inv_freq = T.match_buffer(var_inv_freq, (freqs,), "float32")
            slots = T.match_buffer(var_slots, (tokens,), "int32")
            append(pages, None, qkv, positions, inv_freq, slots, tokens)
        return kv_append

    @T.prim_func(private=True, s_tir=True)
    def kv_append_scaled(var_pages: T.handle, var_scales: T.handle, var_qkv: T.handle, var_positions: T.handle,
                         var_inv_freq: T.handle, var_slots: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, tokens, n_pos = T.int64(), T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), storage)
        scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
        qkv = T.match_buffer(var_qkv, (tokens, width), dtype)
        positions = T.match_buffer(var_positions, (n_pos,), "int32")
        inv_freq = T.match_buffer(var_inv_freq, (freqs,), "float32")
        slots = T.match_buffer(var_slots, (tokens,), "int32")
        append(pages, scales, qkv, positions, inv_freq, slots, tokens)

    return kv_append_scaled
