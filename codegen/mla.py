"""The kernels of Multi-head Latent Attention's absorbed form (passes/specialize_mla.py): kiln's own
on the CPU; on GPUs TVM's MLA append and attention kernels (codegen/tvm_kernels.py) and kiln's
head_linear.

  latent_append   one task per token: its row [c_kv | k_pe] into the latent pages (quantised with
                  one scale per row for an int8/fp8 cache, as kv_append quantises a K or V row)
  latent_attend   one task per (sequence, block of heads): each latent row is read once for the
                  block's heads, which score it against [q_latent | q_rope] (R + P wide) and mix
                  its first R values, online softmax in float32
  head_linear     one task per head: x[t, h] · W[h] with W [H, K, N] rows contiguous in N, so the
                  inner loop is a vector multiply-add over N (GPU: a thread per output)
The expanded form's kernels (CPU only; prefill steps, passes/specialize_mla.py):
  latent_gather   one task per context row: the row from its page, dequantised
  expanded_attend one task per (sequence, head): keys [k_nope | k_pe] N + P wide and values V wide
                  from the rows kiln's linear kernel rebuilt, online softmax in float32, the same
                  loop structure as latent_attend (a scalar dot per key, a vector mix of values)
The manifest and `kiln inspect` name the attention kernels kiln_latent (CPU) and tvm_mla (GPUs).
Latent pages: [num_pages, 1, 1, page_size, R + P] (ir/kv_spec.py kind "latent"); TVM's kernels see
them as [num_pages, page_size, R + P], the same bytes.
"""
from __future__ import annotations

import functools

from tvm import relax
from tvm.script import tirx as T

from kiln.errors import KilnError
from kiln.ir.kv_spec import KVSpec
from kiln.ir.quant import kv_scheme_for

from . import tvm_kernels
from .kv_append import row_encoder
from .latent_kernels import LatentKernel, choose_latent_kernel
from .tir_values import LOWEST

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

    @T.prim_func(private=True, s_tir=True)
    def latent_append(var_pages: T.handle, var_c: T.handle, var_pe: T.handle, var_slots: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, tokens = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), storage)
        c_kv = T.match_buffer(var_c, (tokens, rank), dtype)
        k_pe = T.match_buffer(var_pe, (tokens, rope), dtype)
        slots = T.match_buffer(var_slots, (tokens,), "int32")
        append(pages, None, c_kv, k_pe, slots, tokens)

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

    return latent_append if scheme is None else latent_append_scaled


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

    @T.prim_func(private=True, s_tir=True)
    def latent_attend(var_ql: T.handle, var_qr: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                      var_page_indptr: T.handle, var_page_values: T.handle, var_last_page_len: T.handle,
                      var_output: T.handle):
        T.func_attr({"tirx.noalias": True})
        total_len, batch, num_pages, nnz_pages = T.int64(), T.int64(), T.int64(), T.int64()
        q_latent = T.match_buffer(var_ql, (total_len, heads, rank), dtype)
        q_rope = T.match_buffer(var_qr, (total_len, heads, rope), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32")
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (batch,), "int32")
        output = T.match_buffer(var_output, (total_len, heads, rank), dtype)
        attend(q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len, None, output, batch)

    @T.prim_func(private=True, s_tir=True)
    def latent_attend_scaled(var_ql: T.handle, var_qr: T.handle, var_q_indptr: T.handle, var_pages: T.handle,
                             var_page_indptr: T.handle, var_page_values: T.handle, var_last_page_len: T.handle,
                             var_scales: T.handle, var_output: T.handle):
        T.func_attr({"tirx.noalias": True})
        total_len, batch, num_pages, nnz_pages = T.int64(), T.int64(), T.int64(), T.int64()
        q_latent = T.match_buffer(var_ql, (total_len, heads, rank), dtype)
        q_rope = T.match_buffer(var_qr, (total_len, heads, rope), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32")
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (batch,), "int32")
        scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
        output = T.match_buffer(var_output, (total_len, heads, rank), dtype)
        attend(q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len, scales, output, batch)

    return latent_attend_scaled if quantized else latent_attend


@functools.cache
def head_linear_kernel(heads: int, k_in: int, n_out: int, dtype: str, gpu: bool):
    """(x [T, H, K], w [H, K, N], out [T, H, N]): out[t, h] = x[t, h] · w[h] in float32. CPU: a task
    per head, N as vector lanes; GPU: a block per (token, head), a thread per output."""

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
    return head_linear_gpu if gpu else head_linear


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

    @T.prim_func(private=True, s_tir=True)
    def latent_gather(var_pages: T.handle, var_slots: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, rows = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        slots = T.match_buffer(var_slots, (rows,), "int32")
        out = T.match_buffer(var_out, (rows, width), dtype)
        gather(pages, slots, None, out, rows)

    @T.prim_func(private=True, s_tir=True)
    def latent_gather_scaled(var_pages: T.handle, var_slots: T.handle, var_scales: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        num_pages, rows = T.int64(), T.int64()
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        slots = T.match_buffer(var_slots, (rows,), "int32")
        scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
        out = T.match_buffer(var_out, (rows, width), dtype)
        gather(pages, slots, scales, out, rows)

    return latent_gather_scaled if quantized else latent_gather


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


def _kernel(ctx, node) -> LatentKernel:
    """The MLA kernel family of the node's layer (codegen/latent_kernels.py)."""
    return choose_latent_kernel(ctx.target, ctx.kv_spec(node))


def _latent_rows(ctx, pages):
    """kiln's latent pages [P, 1, 1, S, W] as TVM's MLA kernels take them: [P, S, W], a view."""
    if len(pages.ty.shape) == 3:
        return pages
    num_pages, _, _, page_size, width = pages.ty.shape
    return ctx.bb.emit(relax.op.reshape(pages, [num_pages, page_size, width]))


def emit_latent_append(ctx, node, c_kv, k_pe, pages, slots, scales=None):
    rank, rope = int(c_kv.ty.shape[1]), int(k_pe.ty.shape[1])
    page_size, dtype = int(pages.ty.shape[3]), c_kv.ty.dtype
    if _kernel(ctx, node).name == "tvm_mla":       # TVM's append of the rows [c_kv | k_pe]
        rows = _latent_rows(ctx, pages)
        append = ctx.add_kernel(tvm_kernels.mla_append(rank + rope, dtype, page_size),
                                f"tvm_mla_append_{rank + rope}_{dtype}")
        data = ctx.bb.emit(relax.op.concat([c_kv, k_pe], axis=1))
        return ctx.bb.emit(relax.call_tir_inplace(append, [rows, data, slots], [0], rows.ty))
    scheme = kv_scheme_for(pages.ty.dtype)
    suffix = f"_{scheme.name}" if scheme else ""
    kernel = ctx.add_kernel(latent_append_kernel(ctx.kv_spec(node), dtype),
                            f"latent_append{suffix}_{rank}x{rope}_{dtype}", scheduled=True)
    if scales is None:
        return ctx.bb.emit(relax.call_tir_inplace(kernel, [pages, c_kv, k_pe, slots], [0], pages.ty))
    return ctx.bb.emit(relax.call_tir_inplace(kernel, [pages, scales, c_kv, k_pe, slots], [0, 1],
                                              [pages.ty, scales.ty]))     # (pages, scales): the attention reads both


def emit_latent_attend(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr, page_values, last_page_len,
                       scales=None):
    if not isinstance(pages.ty, relax.TensorType):                 # a quantised append's (pages, scales)
        pages, scales = (ctx.bb.emit(relax.TupleGetItem(pages, i)) for i in range(2))
    heads, rank = int(q_latent.ty.shape[1]), int(q_latent.ty.shape[2])
    rope, dtype, scale = int(q_rope.ty.shape[2]), q_latent.ty.dtype, float(node.attrs["scale"])
    out_ty = relax.TensorType(q_latent.ty.shape, dtype)
    if _kernel(ctx, node).name == "tvm_mla":
        rows = _latent_rows(ctx, pages)
        page_size = int(rows.ty.shape[1])
        attend = ctx.add_kernel(tvm_kernels.mla_attention(ctx.target, heads, rank, rope, page_size, dtype, scale),
                                f"tvm_mla_attention_h{heads}_{rank}x{rope}_{dtype}")
        query = ctx.bb.emit(relax.op.concat([q_latent, q_rope], axis=2))
        out = ctx.bb.emit(relax.call_tir(attend, [query, q_indptr, rows, page_indptr, page_values, last_page_len],
                                         [out_ty, relax.TensorType((q_latent.ty.shape[0], heads), "float32")]))
        return ctx.bb.emit(relax.TupleGetItem(out, 0))
    kernel = ctx.add_kernel(latent_attend_kernel(heads, ctx.kv_spec(node), dtype, scale),
                            f"latent_attend_{pages.ty.dtype}_h{heads}_{rank}x{rope}_{dtype}", scheduled=True)
    args = [q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len]
    return ctx.bb.emit(relax.call_tir(kernel, args + ([scales] if scales is not None else []), out_ty))


def emit_head_linear(ctx, node, x, w):
    heads, k_in, n_out = (int(d) for d in w.ty.shape)
    dtype = x.ty.dtype
    kernel = ctx.add_kernel(head_linear_kernel(heads, k_in, n_out, dtype, ctx.target.thread_blocks),
                            f"head_linear_h{heads}_{k_in}x{n_out}_{dtype}", scheduled=True)
    return ctx.bb.emit(relax.call_tir(kernel, [x, w], relax.TensorType((x.ty.shape[0], heads, n_out), dtype)))


def _cpu_only(ctx, node) -> None:
    if not _kernel(ctx, node).expanded_prefill:
        raise KilnError(f"{node.op}: the expanded MLA prefill form has kernels for the CPU only, not "
                        f"{ctx.target.name}; compile with --mla-expanded-from 0 (absorbed in every step)")


def emit_latent_gather(ctx, node, pages, slots, scales=None):
    _cpu_only(ctx, node)
    if not isinstance(pages.ty, relax.TensorType):                 # a quantised append's (pages, scales)
        pages, scales = (ctx.bb.emit(relax.TupleGetItem(pages, i)) for i in range(2))
    width, dtype = int(pages.ty.shape[4]), node.attrs["dtype"]
    kernel = ctx.add_kernel(latent_gather_kernel(ctx.kv_spec(node), dtype),
                            f"latent_gather_{pages.ty.dtype}_{width}_{dtype}", scheduled=True)
    out_ty = relax.TensorType((slots.ty.shape[0], width), dtype)
    return ctx.bb.emit(relax.call_tir(kernel, [pages, slots] + ([scales] if scales is not None else []), out_ty))


def emit_expanded_attend(ctx, node, q_nope, q_rope, kv, rows, q_indptr, kv_indptr):
    _cpu_only(ctx, node)
    heads, nope = int(q_nope.ty.shape[1]), int(q_nope.ty.shape[2])
    rope, width, dtype = int(q_rope.ty.shape[2]), int(rows.ty.shape[1]), q_nope.ty.dtype
    value = int(kv.ty.shape[1]) // heads - nope
    kernel = ctx.add_kernel(expanded_attend_kernel(heads, nope, rope, value, width, dtype, float(node.attrs["scale"])),
                            f"expanded_attend_h{heads}_{nope}x{rope}x{value}_{dtype}", scheduled=True)
    out_ty = relax.TensorType((q_nope.ty.shape[0], heads, value), dtype)
    return ctx.bb.emit(relax.call_tir(kernel, [q_nope, q_rope, kv, rows, q_indptr, kv_indptr], out_ty))
