"""Paged attention: append the new K/V rows into the pages in place, then ragged causal attention.

The target names its attention kernel (`Target.attention`):
  "kiln_cpu"      kiln's own CPU kernel (codegen/cpu_attention.py);
  "tvm_prefill"   TVM's paged prefill kernel factory, used as a library (GPU, already scheduled).
On the CPU, kiln's own append kernel (codegen/kv_append.py; it also writes int8/float8 pages)
and attention kernel both read the fused qkv projection, applying rope as they load for
`paged_attention_fused`. On GPUs the append kernel is TVM's `_kv_cache_transpose_append`.
All use kiln's page layout [pages, 2, kv_heads, page_size, head_dim].
"""
from __future__ import annotations

import numpy as np
from tvm import relax, tirx
from tvm.relax.frontend.nn.llm import kv_cache as tvm_llm

from kiln.errors import KilnError
from kiln.ir.quant import kv_scheme_for

from .cpu_attention import cpu_paged_attention
from .kv_append import cpu_kv_append

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


def _kiln_cpu_attention(ctx, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                        last_page_len, kv_scales, q_heads, kv_heads, head_dim, dtype, scale, rope):
    """kiln's CPU kernels over a fused qkv: append K/V (rope on k when `rope`), then attend."""
    tokens, page_size, kv_dtype = qkv.ty.shape[0], int(pages.ty.shape[3]), pages.ty.dtype
    scheme = kv_scheme_for(kv_dtype)
    suffix = f"_{scheme.name}" if scheme else ""
    append = ctx.add_kernel(cpu_kv_append(q_heads, kv_heads, head_dim, page_size, dtype, scheme, rope),
                            f"kv_append{suffix}{'_rope' if rope else ''}", scheduled=True)
    if scheme is None:
        pages = ctx.bb.emit(relax.call_tir_inplace(append, [pages, qkv, positions, inv_freq, slots], [0],
                                                   pages.ty))
        scales = []
    else:
        written = ctx.bb.emit(relax.call_tir_inplace(append, [pages, kv_scales, qkv, positions, inv_freq, slots],
                                                     [0, 1], [pages.ty, kv_scales.ty]))
        pages = ctx.bb.emit(relax.TupleGetItem(written, 0))
        scales = [ctx.bb.emit(relax.TupleGetItem(written, 1))]
    attn = ctx.add_kernel(cpu_paged_attention(q_heads, kv_heads, head_dim, page_size, dtype, scale, kv_dtype, rope),
                          f"paged_attention{suffix}{'_rope' if rope else ''}", scheduled=True)
    return ctx.bb.emit(relax.call_tir(
        attn, [qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, *scales],
        relax.TensorType((tokens, q_heads, head_dim), dtype)))


def emit_paged_attention_fused(ctx, node, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                               last_page_len, kv_scales=None):
    if ctx.target.attention != "kiln_cpu":
        raise KilnError(f"target {ctx.target.name} has no fused rope + attention kernel "
                        f"(disable the fuse_rope_attention pass)")
    a = node.attrs
    return _kiln_cpu_attention(ctx, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                               last_page_len, kv_scales, a["q_heads"], a["kv_heads"], a["head_dim"],
                               node.type.dtype, a["scale"], rope=True)


def emit_paged_attention(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                         kv_scales=None):
    tokens, q_heads, head_dim = (q.ty.shape[0], int(q.ty.shape[1]), int(q.ty.shape[2]))
    kv_heads, page_size = int(k.ty.shape[1]), int(pages.ty.shape[3])
    dtype, scale = node.type.dtype, node.attrs["scale"]
    kind = ctx.target.attention
    if kind == "kiln_cpu":
        # kiln's kernels read one fused qkv: join the three (only graphs without fuse_qkv get here).
        flat = [ctx.bb.emit(relax.op.reshape(t, (tokens, int(t.ty.shape[1]) * head_dim))) for t in (q, k, v)]
        qkv = ctx.bb.emit(relax.op.concat(flat, axis=1))
        no_positions = relax.const(np.zeros(1, np.int32))
        no_freq = relax.const(np.zeros(head_dim // 2, np.float32))
        return _kiln_cpu_attention(ctx, qkv, no_positions, no_freq, pages, slots, q_indptr, page_indptr, page_values,
                                   last_page_len, kv_scales, q_heads, kv_heads, head_dim, dtype, scale, rope=False)
    if kv_scheme_for(pages.ty.dtype) is not None:
        raise KilnError(f"target {ctx.target.name}'s attention kernel ({kind}) reads only unquantised KV pages, "
                        f"not {pages.ty.dtype}")
    append = ctx.add_kernel(tvm_llm._kv_cache_transpose_append(kv_heads, head_dim, dtype, page_size), "kv_append")
    pages = ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty))
    out_ty = relax.TensorType((tokens, q_heads, head_dim), dtype)
    if kind == "tvm_prefill":
        attn = ctx.add_kernel(tvm_prefill_kernel(ctx.target, kv_heads, q_heads, head_dim, page_size, dtype, scale),
                              "paged_attention", scheduled=True)
        # The kernel's k_rope_pos_offset input is unused with rotary_mode 0; last_page_len fills the slot.
        out = ctx.bb.emit(relax.call_tir(
            attn, [q, q_indptr, pages, page_indptr, page_values, last_page_len, last_page_len, ctx.input("positions")],
            [out_ty, relax.TensorType((tokens, q_heads), "float32")]))
        return ctx.bb.emit(relax.TupleGetItem(out, 0))
    raise ValueError(f"target {ctx.target.name} names unknown attention kernel {kind!r}")
