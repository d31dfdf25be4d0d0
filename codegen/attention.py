"""Paged attention: append the new K/V rows into the pages in place, then ragged causal attention.

Both kernels come from TVM's LLM kernel factories, used as a library with
kiln's page layout [pages, 2, kv_heads, page_size, head_dim].
"""
from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.nn.llm import kv_cache as tvm_llm

# Scalar parameters of TVM's prefill kernel that kiln fixes at compile time (rope is applied before).
_CAUSAL, _ROTARY_MODE, _ROPE_SCALE, _ROPE_THETA, _SM_SCALE = 10, 11, 12, 13, 14


def attention_kernel(target, kv_heads, q_heads, head_dim, dtype, scale) -> tirx.PrimFunc:
    f = target.attention_kernel(kv_heads, q_heads, head_dim, dtype)
    p = f.params
    return f.specialize({
        p[_CAUSAL]: tirx.IntImm("int32", 1),
        p[_ROTARY_MODE]: tirx.IntImm("int32", 0),
        p[_ROPE_SCALE]: tirx.FloatImm("float32", 1.0),
        p[_ROPE_THETA]: tirx.FloatImm("float32", 1e4),
        p[_SM_SCALE]: tirx.FloatImm("float32", scale),
    })


def emit_paged_attention(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len):
    tokens, q_heads, head_dim = q.ty.shape
    kv_heads = int(k.ty.shape[1])
    dtype = node.type.dtype
    page_size = int(pages.ty.shape[3])
    append = ctx.add_kernel(tvm_llm._kv_cache_transpose_append(kv_heads, int(head_dim), dtype, page_size),
                            "kv_append")
    pages = ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty))
    attn = ctx.add_kernel(attention_kernel(ctx.target, kv_heads, int(q_heads), int(head_dim), dtype,
                                           node.attrs["scale"]), "paged_attention", scheduled=True)
    # The kernel's k_rope_pos_offset input is unused with rotary_mode 0; last_page_len fills the slot.
    out = ctx.bb.emit(relax.call_tir(
        attn, [q, q_indptr, pages, page_indptr, page_values, last_page_len, last_page_len, ctx.input("positions")],
        [relax.TensorType((tokens, q_heads, head_dim), dtype), relax.TensorType((tokens, q_heads), "float32")]))
    return ctx.bb.emit(relax.TupleGetItem(out, 0))
