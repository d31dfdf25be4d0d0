"""Paged attention: append the new K/V rows into the pages in place, then ragged causal attention.

The kernel that runs is the one select_kernels recorded for the function's step kind
(selection/attention.py says what each is), by its emitter in EMITTERS. kiln's CPU kernels
(codegen/kernels/cpu/kv_append.py, attention.py) read the fused qkv, apply rope as they load for
`paged_attention_fused`, and read int8 and float8 pages; TVM's kernels (codegen/kernels/tvm_kernels.py)
take q, k, v apart, after TVM's `_kv_cache_transpose_append`. All use kiln's page layout
[pages, 2, kv_heads, page_size, head_dim].
"""
from __future__ import annotations

import numpy as np
from tvm import relax

from kiln.errors import KilnError
from kiln.ir.quant import kv_scheme_for
from kiln.selection.choice import recorded

from ..kernels import tvm_kernels
from ..kernels.cpu.attention import cpu_paged_attention
from ..kernels.cpu.kv_append import cpu_kv_append
from ..kernels.gpu.attention import DECODE_SPLITS, append_kernel, attention_kernel
from ..kernels.gpu.attention_source import AttentionShape
from ..kernels.rope_load import RotaryLoad
from .flashinfer import emit_flashinfer


def _masking(window: int, softcap: float) -> str:
    """The part of a kiln attention kernel's name that says how its scores are masked and capped."""
    return f"{f'_window{window}' if window else ''}{'_softcap' if softcap else ''}"


def _kiln_cpu_attention(ctx, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                        last_page_len, kv_scales, q_heads, spec, dtype, scale, rope, window, softcap):
    """kiln's CPU kernels over a fused qkv: append K/V (rope on k as `rope` says, if given), then attend."""
    tokens, scheme = qkv.ty.shape[0], kv_scheme_for(spec.dtype)
    suffix = f"_{scheme.name}" if scheme else ""
    append = ctx.add_kernel(cpu_kv_append(q_heads, spec, dtype, rope),
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
    attn = ctx.add_kernel(cpu_paged_attention(q_heads, spec, dtype, scale, rope, window, softcap),
                          f"paged_attention{suffix}{'_rope' if rope else ''}{_masking(window, softcap)}", scheduled=True)
    return ctx.bb.emit(relax.call_tir(
        attn, [qkv, positions, inv_freq, q_indptr, pages, page_indptr, page_values, last_page_len, *scales],
        relax.TensorType((tokens, q_heads, spec.head_dim), dtype)))


def emit_paged_attention_fused(ctx, node, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                               last_page_len, kv_scales=None):
    kernel = recorded(node, ctx.step)
    if kernel != "kiln_cpu":
        raise KilnError(f"attention kernel {kernel} has no fused rope + attention form "
                        f"(disable the fuse_rope_attention pass)")
    a = node.attrs
    return _kiln_cpu_attention(ctx, qkv, positions, inv_freq, pages, slots, q_indptr, page_indptr, page_values,
                               last_page_len, kv_scales, a["q_heads"], ctx.kv_spec(node),
                               node.type.dtype, a["scale"], window=a["window"], softcap=a["softcap"],
                               rope=RotaryLoad(a["head_dim"], a["rotary_dim"] or a["head_dim"], a["mscale"]))


def _joined_qkv(ctx, q, k, v):
    """kiln's kernels read one fused qkv: the three joined (already rotated), with no positions or
    frequencies to rotate by."""
    tokens, head_dim = q.ty.shape[0], int(q.ty.shape[2])
    flat = [ctx.bb.emit(relax.op.reshape(t, (tokens, int(t.ty.shape[1]) * head_dim))) for t in (q, k, v)]
    return (ctx.bb.emit(relax.op.concat(flat, axis=1)), relax.const(np.zeros(1, np.int32)),
            relax.const(np.zeros(head_dim // 2, np.float32)))


def _kiln_cpu(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len, kv_scales):
    # only graphs without fuse_rope_attention get here
    return _kiln_cpu_attention(ctx, *_joined_qkv(ctx, q, k, v), pages, slots, q_indptr, page_indptr, page_values,
                               last_page_len, kv_scales, int(q.ty.shape[1]), ctx.kv_spec(node), node.type.dtype,
                               node.attrs["scale"], rope=None, window=node.attrs["window"],
                               softcap=node.attrs["softcap"])


def _tvm_append(ctx, node, k, v, pages, slots):
    """TVM's append of the step's K/V rows into the pages, in place."""
    spec = ctx.kv_spec(node)
    append = ctx.add_kernel(tvm_kernels.kv_append(spec.kv_heads, spec.head_dim, node.type.dtype, spec.page_size),
                            "kv_append")
    return ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty))


def _tvm_outputs(q, dtype):
    """TVM's attention kernels return the output and each row's log-sum-exp."""
    tokens, q_heads, head_dim = q.ty.shape[0], int(q.ty.shape[1]), int(q.ty.shape[2])
    return [relax.TensorType((tokens, q_heads, head_dim), dtype), relax.TensorType((tokens, q_heads), "float32")]


def _tvm_paged(ctx, pages, page_indptr, page_values, last_page_len):
    # Rope is applied before attention (rotary_mode 0): the kernels' k_rope_pos_offset input is
    # unused, and last_page_len fills its slot.
    return [pages, page_indptr, page_values, last_page_len, last_page_len, ctx.input("positions")]


def _tvm_attention(ctx, node, q, k, v, pages, slots, page_indptr, page_values, last_page_len, factory, name: str,
                   leading: list):
    """TVM's append, then one of its paged attention kernels (`factory`) on `leading` + the pages."""
    pages = _tvm_append(ctx, node, k, v, pages, slots)
    spec, dtype = ctx.kv_spec(node), node.type.dtype
    attn = ctx.add_kernel(factory(ctx.target, spec.kv_heads, int(q.ty.shape[1]), spec.head_dim, spec.page_size, dtype,
                                  node.attrs["scale"]), name, scheduled=True)
    out = ctx.bb.emit(relax.call_tir(attn, [*leading, *_tvm_paged(ctx, pages, page_indptr, page_values, last_page_len)],
                                     _tvm_outputs(q, dtype)))
    return ctx.bb.emit(relax.TupleGetItem(out, 0))


def _tvm_prefill(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len, kv_scales):
    return _tvm_attention(ctx, node, q, k, v, pages, slots, page_indptr, page_values, last_page_len,
                          tvm_kernels.prefill_attention, "paged_attention", [q, q_indptr])


def _tvm_decode(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len, kv_scales):
    return _tvm_attention(ctx, node, q, k, v, pages, slots, page_indptr, page_values, last_page_len,
                          tvm_kernels.decode_attention, "paged_decode_attention", [q])


def _kiln_gpu_fallback(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                       kv_scales):
    """kiln's attention, a thread block per (sequence, KV head), after TVM's append: windows and
    soft-capping on GPUs."""
    pages = _tvm_append(ctx, node, k, v, pages, slots)
    a = node.attrs
    fallback = cpu_paged_attention(int(q.ty.shape[1]), ctx.kv_spec(node), node.type.dtype, a["scale"], None,
                                   a["window"], a["softcap"], gpu=True)
    attn = ctx.add_kernel(fallback, f"paged_attention_fallback{_masking(a['window'], a['softcap'])}", scheduled=True)
    qkv, no_positions, no_freq = _joined_qkv(ctx, q, k, v)
    return ctx.bb.emit(relax.call_tir(attn, [qkv, no_positions, no_freq, q_indptr, pages, page_indptr, page_values,
                                             last_page_len], _tvm_outputs(q, node.type.dtype)[0]))


def emit_paged_attention(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                         kv_scales=None):
    """paged_attention with the kernel recorded for the step, by its emitter."""
    return EMITTERS[recorded(node, ctx.step)](ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values,
                                              last_page_len, kv_scales)


def _kiln_gpu_attention(ctx, node, q, k, v, pages, slots, q_indptr, page_indptr, page_values, last_page_len,
                        kv_scales, splits: int = 1):
    """kiln's CUDA attention: the new rows appended (quantised by kiln's append into int8/float8
    pages, else by TVM's), then attention; each token's keys split over `splits` blocks."""
    tokens, q_heads, dtype = q.ty.shape[0], int(q.ty.shape[1]), node.type.dtype
    spec = ctx.kv_spec(node)
    kv_heads, head_dim, page_size, kv_dtype = spec.kv_heads, spec.head_dim, spec.page_size, spec.dtype
    shape = AttentionShape(q_heads, kv_heads, head_dim, page_size, str(dtype), kv_dtype)
    if shape.problem():
        raise KilnError(f"kiln's GPU attention cannot run layer {node.attrs['layer']}: {shape.problem()}")
    if shape.kv_code:
        append = ctx.add_kernel(append_kernel(shape), f"kv_append_{kv_scheme_for(kv_dtype).name}", scheduled=True)
        written = ctx.bb.emit(relax.call_tir_inplace(append, [pages, kv_scales, k, v, slots], [0, 1],
                                                     [pages.ty, kv_scales.ty]))
        pages, scales = ctx.bb.emit(relax.TupleGetItem(written, 0)), [ctx.bb.emit(relax.TupleGetItem(written, 1))]
    else:
        append = ctx.add_kernel(tvm_kernels.kv_append(kv_heads, head_dim, dtype, page_size), "kv_append")
        pages, scales = ctx.bb.emit(relax.call_tir_inplace(append, [pages, k, v, slots], [0], pages.ty)), []
    a = node.attrs
    func = attention_kernel(shape, splits, a["scale"], a["softcap"], a["window"])
    name = "kiln_paged_attention" + ("_decode" if splits > 1 else "") + _masking(a["window"], a["softcap"])
    attn = ctx.add_kernel(func, name + (f"_{kv_scheme_for(kv_dtype).name}" if shape.kv_code else ""),
                          scheduled=True)
    out = relax.TensorType((tokens, q_heads, head_dim), dtype)
    shares = [relax.TensorType((tokens, q_heads, splits, head_dim), "float32"),
              relax.TensorType((tokens, q_heads, splits), "float32")] if splits > 1 else []
    args = [q, pages, *scales, q_indptr, page_indptr, page_values, last_page_len]
    result = ctx.bb.emit(relax.call_tir(attn, args, [out, *shares] if shares else out))
    return ctx.bb.emit(relax.TupleGetItem(result, 0)) if shares else result


def _kiln_gpu_decode(*args):
    return _kiln_gpu_attention(*args, splits=DECODE_SPLITS)


# how each kernel of selection/attention.py's ATTENTION_KERNELS is emitted for paged_attention
EMITTERS = {"kiln_cpu": _kiln_cpu, "tvm_prefill": _tvm_prefill, "tvm_decode": _tvm_decode,
            "kiln_gpu": _kiln_gpu_attention, "kiln_gpu_decode": _kiln_gpu_decode, "kiln_gpu_fallback": _kiln_gpu_fallback,
            "flashinfer": emit_flashinfer}
