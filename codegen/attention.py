"""Paged attention: append the new K/V rows into the pages in place, then ragged causal attention.

The target names its attention kernel (`Target.attention`):
  "kiln_cpu"      kiln's own CPU kernel (codegen/cpu_attention.py);
  "tvm_prefill"   TVM's paged prefill kernel factory, used as a library (GPU, already scheduled).
The append kernel is TVM's `_kv_cache_transpose_append`, or kiln's quantising one
(codegen/kv_append.py) for int8/float8 pages. All use kiln's page layout
[pages, 2, kv_heads, page_size, head_dim].
"""
from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.nn.llm import kv_cache as tvm_llm

from kiln.errors import KilnError
from kiln.ir.quant import kv_scheme_for

from .cpu_attention import cpu_paged_attention
from .kv_append import quantized_kv_append

# Scalar parameters of TVM's prefill kernel that kiln fixes at compile time (rope is applied before).
_CAUSAL, _ROTARY_MODE, _ROPE_SCALE, _ROPE_THETA, _SM_SCALE = 10, 11, 12, 13, 14


def tvm_prefill_kernel(target, kv_heads, q_heads, head_dim, page_size, dtype, scale) -> tirx.PrimFunc:
    f = tvm_llm._attention_prefill(kv_heads, q_heads, head_dim, dtype, False, {}, target.tvm_target(),
                                   page_size=page_size)
    p = f.params
    return f.specialize({
        p[_CAUSAL]: tirx.IntImm("int32", 1),
        p[_ROTARY_MODE]: tirx.IntImm("int32", 0),
        p[_ROPE_SCALE]: tirx.FloatImm("float32", 1.0),
        p[_ROPE_THETA]: tirx.FloatImm("float32", 1e4),
        p[_SM_SCALE]: tirx.FloatImm("float32", scale),
    })


def emit_paged_attention(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                         kv_scales=None):
    tokens, q_heads, head_dim = (q.ty.shape[0], int(q.ty.shape[1]), int(q.ty.shape[2]))
    kv_heads, page_size = int(k.ty.shape[1]), int(pages.ty.shape[3])
    dtype, scale = node.type.dtype, node.attrs["scale"]
    kv_dtype = pages.ty.dtype
    scheme = kv_scheme_for(kv_dtype)
    kind = ctx.target.attention
    if scheme is not None and kind != "kiln_cpu":
        raise KilnError(f"target {ctx.target.name}'s attention kernel ({kind}) reads only unquantised KV pages, "
                        f"not {scheme.name}")
    if scheme is None:
        append = ctx.add_kernel(tvm_llm._kv_cache_transpose_append(kv_heads, head_dim, dtype, page_size),
                                "kv_append")
        pages = ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty))
        scales = []
    else:
        append = ctx.add_kernel(quantized_kv_append(kv_heads, head_dim, page_size, dtype, scheme),
                                f"kv_append_{scheme.name}", scheduled=True)
        written = ctx.bb.emit(relax.call_tir_inplace(append, [pages, kv_scales, k, v, slots], [0, 1],
                                                     [pages.ty, kv_scales.ty]))
        pages = ctx.bb.emit(relax.TupleGetItem(written, 0))
        scales = [ctx.bb.emit(relax.TupleGetItem(written, 1))]
    out_ty = relax.TensorType((tokens, q_heads, head_dim), dtype)
    if kind == "kiln_cpu":
        attn = ctx.add_kernel(cpu_paged_attention(q_heads, kv_heads, head_dim, page_size, dtype, scale, kv_dtype),
                              "paged_attention", scheduled=True)
        return ctx.bb.emit(relax.call_tir(
            attn, [q, q_indptr, pages, page_indptr, page_values, last_page_len, *scales], out_ty))
    if kind == "tvm_prefill":
        attn = ctx.add_kernel(tvm_prefill_kernel(ctx.target, kv_heads, q_heads, head_dim, page_size, dtype, scale),
                              "paged_attention", scheduled=True)
        # The kernel's k_rope_pos_offset input is unused with rotary_mode 0; last_page_len fills the slot.
        out = ctx.bb.emit(relax.call_tir(
            attn, [q, q_indptr, pages, page_indptr, page_values, last_page_len, last_page_len, ctx.input("positions")],
            [out_ty, relax.TensorType((tokens, q_heads), "float32")]))
        return ctx.bb.emit(relax.TupleGetItem(out, 0))
    raise ValueError(f"target {ctx.target.name} names unknown attention kernel {kind!r}")
