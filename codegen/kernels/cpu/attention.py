"""kiln's CPU paged attention kernel: ragged causal attention over KV pages.

A task of a (sequence, KV head) serves the whole group of query heads that share that KV head,
so each K/V row is read from the pages once per group (GQA) rather than once per query head; with
group 1 it is plain MHA, with one KV head MQA. Each query walks only its own sequence's keys (cost
O(context), or O(window) for a layer with a sliding window), with an online softmax in float32.
On the CPU a task takes its queries in blocks of rows (query × head) against blocks of 16 keys at
fixed positions, in vector FMAs along the keys and along head_dim; on GPUs one key at a time.
On the CPU a sequence's query blocks are also dealt to several tasks per KV head, block i to task
i mod splits (interleaved, so later blocks' longer causal contexts are shared out), so that one
sequence's prefill gives every core work even where the model has few KV heads; each query's
arithmetic is the same whichever task computes it.
Queries are read from the fused projection qkv [T, (Hq + 2 Hkv) D] (q at column 0), rotated as
they are read when `rope` is set (codegen/kernels/rope_load.py).
Signature (the pages as the layer's KVSpec lays them out, `page_shape`):
    (qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, output)
With quantised pages (int8 or float8 rows with scales) the kernel also takes the row scales (the
page shape less head_dim) after last_page_len and multiplies each row by its scale as it reads it.
"""
from __future__ import annotations

import functools

from tvm.script import tirx as T

from kiln.interface import KVSpec

from ..rope_load import RotaryLoad, computed_trig, load_head_element, rope_angle
from ..tir_values import LOWEST

KEYS = 16                          # CPU: keys per block, one float32 vector of scores per query row
TASKS_PER_SEQUENCE = 32            # CPU: at least this many tasks per sequence (KV heads × query splits)


@functools.cache                    # every layer asks for the same kernel: parse it once
def cpu_paged_attention(q_heads: int, spec: KVSpec, dtype: str, scale: float, rope: RotaryLoad | None = None,
                        window: int = 0, softcap: float = 0.0, gpu: bool = False):
    kv_heads, head_dim, page_size, kv_dtype = spec.kv_heads, spec.head_dim, spec.page_size, spec.dtype
    quantized = spec.scales == "row"
    group = q_heads // kv_heads
    freqs = (rope.rotary_dim if rope else head_dim) // 2
    width = (q_heads + 2 * kv_heads) * head_dim

    def row_scale(scales, page, kind, kvh, row):      # evaluated while parsing: no scales, no multiply
        return T.float32(1) if scales is None else scales[page, kind, kvh, row]

    def first_key(seen):               # evaluated while parsing: a window sees the last `window` keys
        return T.max(seen - window, 0) if window else 0

    def capped(score):                 # evaluated while parsing: Gemma 2's soft-capped scores
        return T.tanh(score / T.float32(softcap)) * T.float32(softcap) if softcap else score

    def context_length(page_indptr, last_page_len, b):    # evaluated while parsing: sequence b's keys
        n_pages = page_indptr[b + 1] - page_indptr[b]
        return T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)

    def task_reads(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, scales, b,
                   kvh):                # evaluated while parsing: what the task of sequence b, KV head kvh reads
        return [q_indptr[b:b + 2], page_indptr[b:b + 2], last_page_len[b], page_values[0:page_values.shape[0]],
                qkv[0:qkv.shape[0], 0:width], positions[0:positions.shape[0]], inv_freq[0:freqs],
                pages[0:pages.shape[0], 0:2, kvh, 0:page_size, 0:head_dim],
                *([] if scales is None else [scales[0:pages.shape[0], 0:2, kvh, 0:page_size]])]

    # CPU: queries in blocks of rows (query × head of the group) against blocks of KEYS keys. A block's
    # K and V rows are read and widened once for all its rows; scores, their exps and the weighted
    # V sums run as vector FMAs along the keys (K stored transposed) and along head_dim.
    rows = max(1, 16 // group) * group                  # query rows per block: whole groups
    queries = rows // group
    splits = -(-TASKS_PER_SEQUENCE // kv_heads)         # tasks per (sequence, KV head)
    rotated_freqs = freqs if rope else 0                # the angles a query block computes ahead

    @T.macro
    def attend_blocked(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, scales,
                       output, batch):
        for task in T.parallel(batch * kv_heads * splits):
            with T.sblock("attention"):
                b = T.axis.spatial(batch, task // (kv_heads * splits))
                kvh = T.axis.spatial(kv_heads, task // splits % kv_heads)
                split = T.axis.spatial(T.int64(splits), task % splits)       # int64, as the task
                T.reads(*task_reads(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values,
                                    last_page_len, scales, b, kvh))
                T.writes(output[0:qkv.shape[0], kvh * group:kvh * group + group, 0:head_dim])
                qv = T.sblock_alloc_buffer((rows, head_dim), "float32")
                acc = T.sblock_alloc_buffer((rows, head_dim), "float32")
                kt = T.sblock_alloc_buffer((head_dim, KEYS), "float32")     # the key block, transposed
                vb = T.sblock_alloc_buffer((KEYS, head_dim), "float32")
                sc = T.sblock_alloc_buffer((rows, KEYS), "float32")         # scores, then weights
                stat = T.sblock_alloc_buffer((rows, 4), "float32")          # max, sum, new max, correction
                trig = T.sblock_alloc_buffer((queries, 2, freqs), "float32")  # cos, sin of each query's angles
                q_start = q_indptr[b]
                n_q = q_indptr[b + 1] - q_start
                p_start = page_indptr[b]
                kv_len = context_length(page_indptr, last_page_len, b)
                for qs in range(((n_q + queries - 1) // queries + splits - 1 - T.Cast("int32", split)) // splits):
                    qb = T.Cast("int32", split) + qs * splits              # this task's query blocks
                    n_here = T.min(queries, n_q - qb * queries)
                    # a query's angles once for the heads of its group, not once per element
                    for qq, f in T.grid(queries, rotated_freqs):
                        if qq < n_here:
                            trig[qq, 0, f] = T.cos(rope_angle(positions, inv_freq, q_start + qb * queries + qq, f))
                            trig[qq, 1, f] = T.sin(rope_angle(positions, inv_freq, q_start + qb * queries + qq, f))
                    for r, d in T.grid(rows, head_dim):
                        qv[r, d] = T.if_then_else(r // group < n_here, load_head_element(
                            qkv, positions, inv_freq, q_start + T.min(qb * queries + r // group, n_q - 1),
                            (kvh * group + r % group) * head_dim, d, dtype, rope,
                            computed_trig(trig, r // group)), T.float32(0)) * T.float32(scale)
                        acc[r, d] = T.float32(0)
                    for r in range(rows):
                        stat[r, 0] = T.float32(LOWEST)
                        stat[r, 1] = T.float32(0)
                    first_seen = kv_len - n_q + qb * queries + 1           # keys the block's first query sees
                    last_seen = kv_len - n_q + qb * queries + n_here
                    k_start = first_key(first_seen)
                    # key blocks start at multiples of KEYS whatever the step: a query's sums are the
                    # same in a prefill, a chunk, a batch or a decode step (a block with no key of
                    # its row changes nothing: weight 0, correction exp(0) = 1)
                    k_block0 = k_start // KEYS * KEYS
                    for kb in range((last_seen - k_block0 + KEYS - 1) // KEYS):
                        j0 = k_block0 + kb * KEYS
                        for jj in range(KEYS):
                            j = T.max(T.min(j0 + jj, last_seen - 1), k_start)   # outside: a copy, masked below
                            page = page_values[p_start + j // page_size]
                            for d in T.vectorized(head_dim):
                                vb[jj, d] = T.Cast("float32", pages[page, 1, kvh, j % page_size, d]) * row_scale(
                                    scales, page, 1, kvh, j % page_size)
                            for d in T.vectorized(head_dim):
                                kt[d, jj] = T.Cast("float32", pages[page, 0, kvh, j % page_size, d]) * row_scale(
                                    scales, page, 0, kvh, j % page_size)
                        for r in range(n_here * group):                      # a decode step: one query
                            seen = first_seen + r // group
                            for jj in T.vectorized(KEYS):
                                sc[r, jj] = T.float32(0)
                            for d in range(head_dim):
                                for jj in T.vectorized(KEYS):
                                    sc[r, jj] = sc[r, jj] + qv[r, d] * kt[d, jj]
                            for jj in T.vectorized(KEYS):
                                sc[r, jj] = T.if_then_else(
                                    (j0 + jj < seen) & (j0 + jj >= first_key(seen)), capped(sc[r, jj]),
                                    T.float32(LOWEST))
                            stat[r, 2] = stat[r, 0]
                            for jj in range(KEYS):
                                stat[r, 2] = T.max(stat[r, 2], sc[r, jj])            # the new max
                            for jj in T.vectorized(KEYS):
                                sc[r, jj] = T.if_then_else(sc[r, jj] > T.float32(LOWEST),
                                                           T.exp(sc[r, jj] - stat[r, 2]), T.float32(0))
                            stat[r, 3] = T.exp(stat[r, 0] - stat[r, 2])
                            stat[r, 0] = stat[r, 2]
                            stat[r, 1] = stat[r, 1] * stat[r, 3]
                            for jj in range(KEYS):
                                stat[r, 1] = stat[r, 1] + sc[r, jj]
                            for d in T.vectorized(head_dim):
                                acc[r, d] = acc[r, d] * stat[r, 3]
                            for jj in range(KEYS):
                                for d in T.vectorized(head_dim):
                                    acc[r, d] = acc[r, d] + sc[r, jj] * vb[jj, d]
                    for r, d in T.grid(rows, head_dim):
                        if r // group < n_here:
                            output[q_start + qb * queries + r // group, kvh * group + r % group, d] = T.Cast(
                                dtype, acc[r, d] / stat[r, 1])

    # GPU: a thread block per task, one key at a time
    @T.macro
    def attend(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, scales,
               output, batch):
        for task in T.thread_binding(batch * kv_heads, thread="blockIdx.x"):
            with T.sblock("attention"):
                b = T.axis.spatial(batch, task // kv_heads)
                kvh = T.axis.spatial(kv_heads, task % kv_heads)
                T.reads(*task_reads(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values,
                                    last_page_len, scales, b, kvh))
                T.writes(output[0:qkv.shape[0], kvh * group:kvh * group + group, 0:head_dim])
                acc = T.sblock_alloc_buffer((group, head_dim), "float32", scope="local")
                qv = T.sblock_alloc_buffer((group, head_dim), "float32", scope="local")
                kv = T.sblock_alloc_buffer((2, head_dim), "float32", scope="local")     # this key and value row
                state = T.sblock_alloc_buffer((group, 4), "float32", scope="local")     # max, sum, score, correction
                q_start = q_indptr[b]
                n_q = q_indptr[b + 1] - q_start
                p_start = page_indptr[b]
                kv_len = context_length(page_indptr, last_page_len, b)
                for i in range(n_q):
                    for g, d in T.grid(group, head_dim):
                        qv[g, d] = load_head_element(qkv, positions, inv_freq, q_start + i,
                                                     (kvh * group + g) * head_dim, d, dtype,
                                                     rope) * T.float32(scale)
                        acc[g, d] = T.float32(0)
                    for g in range(group):
                        state[g, 0] = T.float32(LOWEST)
                        state[g, 1] = T.float32(0)
                    seen = kv_len - n_q + i + 1                      # causal: keys up to this query's position
                    for j in T.serial(first_key(seen), seen):
                        page = page_values[p_start + j // page_size]
                        row = j % page_size
                        for d in range(head_dim):                    # read the K/V row once for the group
                            kv[0, d] = T.Cast("float32", pages[page, 0, kvh, row, d]) * row_scale(
                                scales, page, 0, kvh, row)
                            kv[1, d] = T.Cast("float32", pages[page, 1, kvh, row, d]) * row_scale(
                                scales, page, 1, kvh, row)
                        for g in range(group):
                            state[g, 2] = T.float32(0)
                            for d in range(head_dim):
                                state[g, 2] = state[g, 2] + qv[g, d] * kv[0, d]
                            state[g, 2] = capped(state[g, 2])
                            m_new = T.max(state[g, 0], state[g, 2])
                            state[g, 3] = T.exp(state[g, 0] - m_new)
                            weight = T.exp(state[g, 2] - m_new)
                            state[g, 1] = state[g, 1] * state[g, 3] + weight
                            for d in range(head_dim):
                                acc[g, d] = acc[g, d] * state[g, 3] + weight * kv[1, d]
                            state[g, 0] = m_new
                    for g, d in T.grid(group, head_dim):
                        output[q_start + i, kvh * group + g, d] = T.Cast(dtype, acc[g, d] / state[g, 1])

    body = attend if gpu else attend_blocked

    @T.macro
    def matched(var_qkv, var_positions, var_inv_freq, var_q_indptr, var_pages, var_page_indptr, var_page_values,
                var_last_page_len, var_scales, var_output):
        """The kernel over its arguments' buffers; row scales where given (a quantised cache's)."""
        T.func_attr({"tirx.noalias": True})
        total_len, n_pos, batch, num_pages, nnz_pages = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
        qkv = T.match_buffer(var_qkv, (total_len, width), dtype)
        positions = T.match_buffer(var_positions, (n_pos,), "int32")
        inv_freq = T.match_buffer(var_inv_freq, (freqs,), "float32")
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32")
        pages = T.match_buffer(var_pages, spec.page_shape(num_pages), kv_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (batch,), "int32")
        if var_scales is None:
            output = T.match_buffer(var_output, (total_len, q_heads, head_dim), dtype)
            body(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, None, output,
                 batch)
        else:
            scales = T.match_buffer(var_scales, spec.page_shape(num_pages)[:4], "float32")
            output = T.match_buffer(var_output, (total_len, q_heads, head_dim), dtype)
            body(qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, scales, output,
                 batch)

    if not quantized:   # only the form asked for is parsed
        @T.prim_func(private=True, s_tir=True)
        def paged_attention(var_qkv: T.handle, var_positions: T.handle, var_inv_freq: T.handle, var_q_indptr: T.handle,
                            var_pages: T.handle, var_page_indptr: T.handle, var_page_values: T.handle,
                            var_last_page_len: T.handle, var_output: T.handle):
            matched(var_qkv, var_positions, var_inv_freq, var_q_indptr, var_pages, var_page_indptr, var_page_values,
                    var_last_page_len, None, var_output)
        return paged_attention

    @T.prim_func(private=True, s_tir=True)
    def paged_attention_scaled(var_qkv: T.handle, var_positions: T.handle, var_inv_freq: T.handle,
                               var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
                               var_page_values: T.handle, var_last_page_len: T.handle, var_scales: T.handle,
                               var_output: T.handle):
        matched(var_qkv, var_positions, var_inv_freq, var_q_indptr, var_pages, var_page_indptr, var_page_values,
                var_last_page_len, var_scales, var_output)

    return paged_attention_scaled
