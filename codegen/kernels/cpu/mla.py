"""kiln's CPU kernels of Multi-head Latent Attention (passes/specialize_mla.py; on GPUs TVM's MLA
kernels run the absorbed form, codegen/kernels/tvm_kernels.py, and codegen/kernels/gpu/head_linear.py
the per-head linears).
  latent_append   one task per token: its row [c_kv | k_pe] into the latent pages (quantised with
                  one scale per row for an int8/fp8 cache, as kv_append quantises a K or V row)
  latent_attend   one task per (sequence, block of heads): each latent row is read once for the
                  block's heads, which score it against [q_latent | q_rope] (R + P wide) and mix
                  its first R values, online softmax in float32
  head_linear     one task per head: x[t, h] · W[h] with W [H, K, N] rows contiguous in N, so the
                  inner loop is a vector multiply-add over N
The expanded form's kernels (prefill steps, passes/specialize_mla.py):
  latent_gather   one task per context row: the row from its page, dequantised
  expanded_attend one task per (sequence, head): keys [k_nope | k_pe] N + P wide and values V wide
                  from the rows kiln's linear kernel rebuilt, online softmax in float32, the same
                  loop structure as latent_attend (a scalar dot per key, a vector mix of values)
Latent pages: [num_pages, 1, 1, page_size, R + P] (kiln/interface.py KVSpec kind "latent"); TVM's kernels see
them as [num_pages, page_size, R + P], the same bytes.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.interface import KVSpec
from kiln.ir.quant import kv_scheme_for

from ..tir_values import LOWEST
from .kv_append import row_encoder

HEAD_BLOCKS = 4          # latent_attend splits a sequence's heads into this many tasks (when they divide)


@functools.cache
def latent_append_kernel(spec: KVSpec, dtype: str):
    """(pages, [scales,] c_kv [T, R], k_pe [T, P], slot_mapping [T]): pages (and scales) in place, shaped
    by the layer's KVSpec (a latent row: width R + P, of which R is c_kv)."""
    width, rank, page_size, storage = spec.k_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    rope, scheme = width - rank, kv_scheme_for(storage)
    qmax = scheme.qmax if scheme else 1.0
    encode = row_encoder(scheme, dtype)

    @T.macro
    def append(pages, scales, c_kv, k_pe, slots, tokens):
        for t in T.parallel(tokens):
            with T.sblock("append"):
                vt = T.axis.spatial(tokens, t)
                T.reads(slots[vt], c_kv[vt, 0:rank], k_pe[vt, 0:rope])
                T.writes(pages[0:pages.shape[0], 0, 0, 0:page_size, 0:width],
                         *([] if scales is None else [scales[0:pages.shape[0], 0, 0, 0:page_size]]))
                row = T.sblock_alloc_buffer((width,), "float32")
                amax = T.sblock_alloc_buffer((1,), "float32")
                if slots[vt] >= 0:
                    page = slots[vt] // page_size
                    slot_row = slots[vt] % page_size
                    amax[0] = T.float32(0)
                    for d in range(width):
                        row[d] = T.if_then_else(d < rank, T.Cast("float32", c_kv[vt, T.min(d, rank - 1)]),
                                                T.Cast("float32", k_pe[vt, T.max(d - rank, 0)]))
                        amax[0] = T.max(amax[0], T.fabs(row[d]))
                    if scales is not None:
                        scales[page, 0, 0, slot_row] = T.if_then_else(amax[0] > T.float32(0),
                                                                      amax[0] / T.float32(qmax), T.float32(1))
                    for d in range(width):
                        pages[page, 0, 0, slot_row, d] = encode(
                            row[d], None if scales is None else scales[page, 0, 0, slot_row])

    if scheme is None:   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def latent_append(var_pages: T.handle, var_c: T.handle, var_pe: T.handle, var_slots: T.handle):
            T.func_attr({"tirx.noalias": True})
            num_pages, tokens = T.int64(), T.int64()
            pages = T.match_buffer(var_pages, spec.page_shape(num_pages), storage)
            c_kv = T.match_buffer(var_c, (tokens, rank), dtype)
            k_pe = T.match_buffer(var_pe, (tokens, rope), dtype)
            slots = T.match_buffer(var_slots, (tokens,), "int32")
            append(pages, None, c_kv, k_pe, slots, tokens)
        return latent_append

    @T.prim_func(private=True, s_tir=True)
    def latent_append_scaled(var_pages: T.handle, var_scales: T.handle, var_c: T.handle, var_pe: T.handle,
                             var_slots: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, tokens = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), storage)
        scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
        c_kv = T.match_buffer(var_c, (tokens, rank), dtype)
        k_pe = T.match_buffer(var_pe, (tokens, rope), dtype)
        slots = T.match_buffer(var_slots, (tokens,), "int32")
        append(pages, scales, c_kv, k_pe, slots, tokens)

    return latent_append_scaled


@functools.cache
def latent_attend_kernel(heads: int, spec: KVSpec, dtype: str, scale: float):
    """(q_latent [T, H, R], q_rope [T, H, P], q_indptr, pages, page_indptr, page_values,
    last_page_len, [scales,] output [T, H, R]), the pages shaped by the layer's KVSpec."""
    width, rank, page_size, kv_dtype = spec.k_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    rope = width - rank
    blocks = HEAD_BLOCKS if heads % HEAD_BLOCKS == 0 else 1
    group = heads // blocks
    quantized = kv_scheme_for(kv_dtype) is not None

    def row_scale(scales, page, row):   # evaluated while parsing: no scales, no multiply
        return T.float32(1) if scales is None else scales[page, 0, 0, row]

    @T.macro
    def attend(q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len, scales, output, batch):
        for task in T.parallel(batch * blocks):
            with T.sblock("attention"):
                b = T.axis.spatial(batch, task // blocks)
                blk = T.axis.spatial(blocks, task % blocks)
                T.reads(q_indptr[b:b + 2], page_indptr[b:b + 2], last_page_len[b],
                        page_values[0:page_values.shape[0]],
                        q_latent[0:q_latent.shape[0], blk * group:blk * group + group, 0:rank],
                        q_rope[0:q_rope.shape[0], blk * group:blk * group + group, 0:rope],
                        pages[0:pages.shape[0], 0, 0, 0:page_size, 0:width],
                        *([] if scales is None else [scales[0:pages.shape[0], 0, 0, 0:page_size]]))
                T.writes(output[0:q_latent.shape[0], blk * group:blk * group + group, 0:rank])
                acc = T.sblock_alloc_buffer((group, rank), "float32")
                qv = T.sblock_alloc_buffer((group, width), "float32")
                kv = T.sblock_alloc_buffer((width,), "float32")       # this latent row
                state = T.sblock_alloc_buffer((group, 4), "float32")  # max, sum, score, correction
                q_start = q_indptr[b]
                n_q = q_indptr[b + 1] - q_start
                p_start = page_indptr[b]
                n_pages = page_indptr[b + 1] - p_start
                kv_len = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
                for i in range(n_q):
                    for g, d in T.grid(group, width):
                        qv[g, d] = T.if_then_else(
                            d < rank, T.Cast("float32", q_latent[q_start + i, blk * group + g, T.min(d, rank - 1)]),
                            T.Cast("float32", q_rope[q_start + i, blk * group + g, T.max(d - rank, 0)])
                        ) * T.float32(scale)
                    for g, d in T.grid(group, rank):
                        acc[g, d] = T.float32(0)
                    for g in range(group):
                        state[g, 0] = T.float32(LOWEST)
                        state[g, 1] = T.float32(0)
                    for j in T.serial(kv_len - n_q + i + 1):             # causal: keys up to this query
                        page = page_values[p_start + j // page_size]
                        row = j % page_size
                        for d in range(width):                       # read the row once for the block
                            kv[d] = T.Cast("float32", pages[page, 0, 0, row, d]) * row_scale(scales, page, row)
                        for g in range(group):
                            state[g, 2] = T.float32(0)
                            for d in range(width):
                                state[g, 2] = state[g, 2] + qv[g, d] * kv[d]
                            m_new = T.max(state[g, 0], state[g, 2])
                            state[g, 3] = T.exp(state[g, 0] - m_new)
                            weight = T.exp(state[g, 2] - m_new)
                            state[g, 1] = state[g, 1] * state[g, 3] + weight
                            for d in range(rank):
                                acc[g, d] = acc[g, d] * state[g, 3] + weight * kv[d]
                            state[g, 0] = m_new
                    for g, d in T.grid(group, rank):
                        output[q_start + i, blk * group + g, d] = T.Cast(dtype, acc[g, d] / state[g, 1])

    @T.macro
    def matched(var_ql, var_qr, var_q_indptr, var_pages, var_page_indptr, var_page_values, var_last_page_len,
                var_scales, var_output):
        """The kernel over its arguments' buffers; row scales where given (a quantised cache's)."""
        T.func_attr({"tirx.noalias": True})
        total_len, batch, num_pages, nnz_pages = T.int64(), T.int64(), T.int64(), T.int64()
        q_latent = T.match_buffer(var_ql, (total_len, heads, rank), dtype)
        q_rope = T.match_buffer(var_qr, (total_len, heads, rope), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32")
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (batch,), "int32")
        if var_scales is None:
            output = T.match_buffer(var_output, (total_len, heads, rank), dtype)
            attend(q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len, None, output, batch)
        else:
            scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
            output = T.match_buffer(var_output, (total_len, heads, rank), dtype)
            attend(q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len, scales, output, batch)

    if not quantized:   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def latent_attend(var_ql: T.handle, var_qr: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                          var_page_indptr: T.handle, var_page_values: T.handle, var_last_page_len: T.handle,
                          var_output: T.handle):
            matched(var_ql, var_qr, var_q_indptr, var_pages, var_page_indptr, var_page_values, var_last_page_len, None,
                    var_output)
        return latent_attend

    @T.prim_func(private=True, s_tir=True)
    def latent_attend_scaled(var_ql: T.handle, var_qr: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                             var_page_indptr: T.handle, var_page_values: T.handle, var_last_page_len: T.handle,
                             var_scales: T.handle, var_output: T.handle):
        matched(var_ql, var_qr, var_q_indptr, var_pages, var_page_indptr, var_page_values, var_last_page_len,
                var_scales, var_output)

    return latent_attend_scaled


@functools.cache
def head_linear_kernel(heads: int, k_in: int, n_out: int, dtype: str):
    """(x [T, H, K], w [H, K, N], out [T, H, N]): out[t, h] = x[t, h] · w[h] in float32; a task per
    head, N as vector lanes."""

    @T.prim_func(private=True, s_tir=True)
    def head_linear(var_x: T.handle, var_w: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        tokens = T.int64()
        x = T.match_buffer(var_x, (tokens, heads, k_in), dtype)
        w = T.match_buffer(var_w, (heads, k_in, n_out), dtype)
        out = T.match_buffer(var_out, (tokens, heads, n_out), dtype)
        for task in T.parallel(heads):
            with T.sblock("head"):
                h = T.axis.spatial(heads, task)
                T.reads(x[0:tokens, h, 0:k_in], w[h, 0:k_in, 0:n_out])
                T.writes(out[0:tokens, h, 0:n_out])
                acc = T.sblock_alloc_buffer((n_out,), "float32")
                for t in range(tokens):
                    for n in T.vectorized(n_out):
                        acc[n] = T.float32(0)
                    for k in range(k_in):
                        for n in T.vectorized(n_out):
                            acc[n] = acc[n] + T.Cast("float32", x[t, h, k]) * T.Cast("float32", w[h, k, n])
                    for n in T.vectorized(n_out):
                        out[t, h, n] = T.Cast(dtype, acc[n])

    return head_linear


@functools.cache
def latent_gather_kernel(spec: KVSpec, dtype: str):
    """(pages, kv_slots [L], [scales,] out [L, width]): the rows at kv_slots, dequantised; the pages
    shaped by the layer's KVSpec."""
    width, page_size, kv_dtype = spec.k_head_dim, spec.page_size, spec.dtype
    quantized = kv_scheme_for(kv_dtype) is not None

    def row_scale(scales, page, row):   # evaluated while parsing: no scales, no multiply
        return T.float32(1) if scales is None else scales[page, 0, 0, row]

    @T.macro
    def gather(pages, slots, scales, out, rows):
        for i in T.parallel(rows):
            with T.sblock("gather"):
                vi = T.axis.spatial(rows, i)
                T.reads(slots[vi], pages[0:pages.shape[0], 0, 0, 0:page_size, 0:width],
                        *([] if scales is None else [scales[0:pages.shape[0], 0, 0, 0:page_size]]))
                T.writes(out[vi, 0:width])
                page = slots[vi] // page_size
                row = slots[vi] % page_size
                for d in range(width):
                    out[vi, d] = T.Cast(dtype, T.Cast("float32", pages[page, 0, 0, row, d]) * row_scale(scales, page, row))

    if not quantized:   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def latent_gather(var_pages: T.handle, var_slots: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            num_pages, rows = T.int64(), T.int64()
            pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
            slots = T.match_buffer(var_slots, (rows,), "int32")
            out = T.match_buffer(var_out, (rows, width), dtype)
            gather(pages, slots, None, out, rows)
        return latent_gather

    @T.prim_func(private=True, s_tir=True)
    def latent_gather_scaled(var_pages: T.handle, var_slots: T.handle, var_scales: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, rows = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        slots = T.match_buffer(var_slots, (rows,), "int32")
        scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
        out = T.match_buffer(var_out, (rows, width), dtype)
        gather(pages, slots, scales, out, rows)

    return latent_gather_scaled


@functools.cache
def expanded_attend_kernel(heads: int, nope: int, rope: int, value: int, width: int, dtype: str, scale: float):
    """(q_nope [T, H, N], q_rope [T, H, P], kv [L, H (N + V)], rows [L, width], q_indptr, kv_indptr,
    output [T, H, V])."""
    qk, per_head = nope + rope, nope + value

    @T.prim_func(private=True, s_tir=True)
    def expanded_attend(var_qn: T.handle, var_qr: T.handle, var_kv: T.handle, var_rows: T.handle,
                        var_q_indptr: T.handle, var_kv_indptr: T.handle, var_output: T.handle):
        T.func_attr({"tirx.noalias": True})
        total_len, kv_tokens, seqs1 = T.int64(), T.int64(), T.int64()
        q_nope = T.match_buffer(var_qn, (total_len, heads, nope), dtype)
        q_rope = T.match_buffer(var_qr, (total_len, heads, rope), dtype)
        kv = T.match_buffer(var_kv, (kv_tokens, heads * per_head), dtype)
        rows = T.match_buffer(var_rows, (kv_tokens, width), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (seqs1,), "int32")
        kv_indptr = T.match_buffer(var_kv_indptr, (seqs1,), "int32")
        output = T.match_buffer(var_output, (total_len, heads, value), dtype)
        batch = seqs1 - 1
        for task in T.parallel(batch * heads):
            with T.sblock("attention"):
                b = T.axis.spatial(batch, task // heads)
                h = T.axis.spatial(heads, task % heads)
                T.reads(q_indptr[b:b + 2], kv_indptr[b:b + 2], q_nope[0:total_len, h, 0:nope],
                        q_rope[0:total_len, h, 0:rope], kv[0:kv_tokens, h * per_head:h * per_head + per_head],
                        rows[0:kv_tokens, width - rope:width])
                T.writes(output[0:total_len, h, 0:value])
                acc = T.sblock_alloc_buffer((value,), "float32")
                qv = T.sblock_alloc_buffer((qk,), "float32")
                state = T.sblock_alloc_buffer((4,), "float32")        # max, sum, score, correction
                q_start = q_indptr[b]
                n_q = q_indptr[b + 1] - q_start
                k_start = kv_indptr[b]
                kv_len = kv_indptr[b + 1] - k_start
                for i in range(n_q):
                    for d in range(qk):
                        qv[d] = T.if_then_else(d < nope, T.Cast("float32", q_nope[q_start + i, h, T.min(d, nope - 1)]),
                                               T.Cast("float32", q_rope[q_start + i, h, T.max(d - nope, 0)])
                                               ) * T.float32(scale)
                    for d in range(value):
                        acc[d] = T.float32(0)
                    state[0] = T.float32(LOWEST)
                    state[1] = T.float32(0)
                    for j in T.serial(kv_len - n_q + i + 1):             # causal: keys up to this query
                        state[2] = T.float32(0)
                        for d in range(nope):
                            state[2] = state[2] + qv[d] * T.Cast("float32", kv[k_start + j, h * per_head + d])
                        for d in range(rope):
                            state[2] = state[2] + qv[nope + d] * T.Cast("float32", rows[k_start + j, width - rope + d])
                        m_new = T.max(state[0], state[2])
                        state[3] = T.exp(state[0] - m_new)
                        weight = T.exp(state[2] - m_new)
                        state[1] = state[1] * state[3] + weight
                        for d in range(value):
                            acc[d] = acc[d] * state[3] + weight * T.Cast("float32", kv[k_start + j, h * per_head + nope + d])
                        state[0] = m_new
                    for d in range(value):
                        output[q_start + i, h, d] = T.Cast(dtype, acc[d] / state[1])

    return expanded_attend
