"""kiln's CPU paged attention kernel: ragged causal attention over KV pages, one task per (sequence, head).

Each query walks only its own sequence's keys (cost O(context)), with an
online softmax in float32; K/V rows are read straight from the pages.
Signature (kiln's page layout, pages: [num_pages, 2, kv_heads, page_size, head_dim]):
    (q, q_indptr, pages, page_indptr, page_values, last_page_len, output)
"""
from __future__ import annotations

from tvm.script import tirx as T


def cpu_paged_attention(q_heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: str, scale: float):
    group = q_heads // kv_heads
    lowest = -3.0e38

    @T.prim_func(private=True, s_tir=True)
    def paged_attention(var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
                        var_page_values: T.handle, var_last_page_len: T.handle, var_output: T.handle):
        T.func_attr({"tirx.noalias": True})
        total_len, batch, num_pages, nnz_pages = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(var_q, (total_len, q_heads, head_dim), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch + 1,), "int32")
        pages = T.match_buffer(var_pages, (num_pages, 2, kv_heads, page_size, head_dim), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch + 1,), "int32")
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32")
        last_page_len = T.match_buffer(var_last_page_len, (batch,), "int32")
        output = T.match_buffer(var_output, (total_len, q_heads, head_dim), dtype)
        for task in T.parallel(batch * q_heads):
            with T.sblock("attention"):
                b = T.axis.spatial(batch, task // q_heads)
                h = T.axis.spatial(q_heads, task % q_heads)
                T.reads(q_indptr[b:b + 2], page_indptr[b:b + 2], last_page_len[b], page_values[0:nnz_pages],
                        q[0:total_len, h, 0:head_dim], pages[0:num_pages, 0:2, h // group, 0:page_size, 0:head_dim])
                T.writes(output[0:total_len, h, 0:head_dim])
                acc = T.sblock_alloc_buffer((head_dim,), "float32")
                qv = T.sblock_alloc_buffer((head_dim,), "float32")
                state = T.sblock_alloc_buffer((3,), "float32")      # running max, running sum, score
                q_start = q_indptr[b]
                n_q = q_indptr[b + 1] - q_start
                p_start = page_indptr[b]
                n_pages = page_indptr[b + 1] - p_start
                kv_len = T.if_then_else(n_pages > 0, (n_pages - 1) * page_size + last_page_len[b], 0)
                for i in range(n_q):
                    for d in range(head_dim):
                        qv[d] = T.Cast("float32", q[q_start + i, h, d]) * T.float32(scale)
                        acc[d] = T.float32(0)
                    state[0] = T.float32(lowest)
                    state[1] = T.float32(0)
                    for j in range(kv_len - n_q + i + 1):           # causal: keys up to this query's position
                        page = page_values[p_start + j // page_size]
                        row = j % page_size
                        state[2] = T.float32(0)
                        for d in range(head_dim):
                            state[2] = state[2] + qv[d] * T.Cast("float32", pages[page, 0, h // group, row, d])
                        m_new = T.max(state[0], state[2])
                        correction = T.exp(state[0] - m_new)
                        weight = T.exp(state[2] - m_new)
                        state[1] = state[1] * correction + weight
                        for d in range(head_dim):
                            acc[d] = acc[d] * correction + weight * T.Cast("float32", pages[page, 1, h // group, row, d])
                        state[0] = m_new
                    for d in range(head_dim):
                        output[q_start + i, h, d] = T.Cast(dtype, acc[d] / state[1])

    return paged_attention
