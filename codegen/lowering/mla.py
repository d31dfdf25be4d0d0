"""Lowering of Multi-head Latent Attention's ops (passes/specialize_mla.py) to the latent layer's
kernel family, as select_kernels recorded it (selection/latent.py): kiln's CPU kernels
(codegen/kernels/cpu/mla.py: kiln_latent, and kiln_expanded for the expanded prefill form), TVM's
MLA append and attention kernels (codegen/kernels/tvm_kernels.py: tvm_mla), or TVM's append and
FlashInfer's attention (lowering/flashinfer.py: flashinfer_mla). The per-head linear is
kiln's, built for the target's threads (codegen/kernels/gpu/head_linear.py on GPUs). Latent pages:
[num_pages, 1, 1, page_size, R + P] (kiln/interface.py KVSpec kind "latent"); TVM's kernels see them
as [num_pages, page_size, R + P], the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvm import relax

from kiln.ir.quant import kv_scheme_for
from kiln.selection.choice import recorded

from ..kernels import tvm_kernels
from ..kernels.cpu.mla import expanded_attend_kernel, latent_append_kernel, latent_attend_kernel, latent_gather_kernel
from ..kernels.cpu.mla import head_linear_kernel as cpu_head_linear
from ..kernels.gpu.head_linear import head_linear_kernel as gpu_head_linear
from .flashinfer import emit_flashinfer_mla


def _latent_rows(ctx, pages):
    """kiln's latent pages [P, 1, 1, S, W] as TVM's MLA kernels take them: [P, S, W], a view."""
    if len(pages.ty.shape) == 3:
        return pages
    num_pages, _, _, page_size, width = pages.ty.shape
    return ctx.bb.emit(relax.op.reshape(pages, [num_pages, page_size, width]))


def _tvm_append(ctx, node, c_kv, k_pe, pages, slots, scales):
    """TVM's append of the rows [c_kv | k_pe]."""
    rank, rope = int(c_kv.ty.shape[1]), int(k_pe.ty.shape[1])
    page_size, dtype = int(pages.ty.shape[3]), c_kv.ty.dtype
    rows = _latent_rows(ctx, pages)
    append = ctx.add_kernel(tvm_kernels.mla_append(rank + rope, dtype, page_size),
                            f"tvm_mla_append_{rank + rope}_{dtype}")
    data = ctx.bb.emit(relax.op.concat([c_kv, k_pe], axis=1))
    return ctx.bb.emit(relax.call_tir_inplace(append, [rows, data, slots], [0], rows.ty))


def _kiln_append(ctx, node, c_kv, k_pe, pages, slots, scales):
    rank, rope, dtype = int(c_kv.ty.shape[1]), int(k_pe.ty.shape[1]), c_kv.ty.dtype
    scheme = kv_scheme_for(pages.ty.dtype)
    suffix = f"_{scheme.name}" if scheme else ""
    kernel = ctx.add_kernel(latent_append_kernel(ctx.kv_spec(node), dtype),
                            f"latent_append{suffix}_{rank}x{rope}_{dtype}", scheduled=True)
    if scales is None:
        return ctx.bb.emit(relax.call_tir_inplace(kernel, [pages, c_kv, k_pe, slots], [0], pages.ty))
    return ctx.bb.emit(relax.call_tir_inplace(kernel, [pages, scales, c_kv, k_pe, slots], [0, 1],
                                              [pages.ty, scales.ty]))     # (pages, scales): the attention reads both


def _tvm_attend(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr, page_values, last_page_len, scales):
    heads, rank = int(q_latent.ty.shape[1]), int(q_latent.ty.shape[2])
    rope, dtype, scale = int(q_rope.ty.shape[2]), q_latent.ty.dtype, float(node.attrs["scale"])
    rows = _latent_rows(ctx, pages)
    page_size = int(rows.ty.shape[1])
    attend = ctx.add_kernel(tvm_kernels.mla_attention(ctx.target, heads, rank, rope, page_size, dtype, scale),
                            f"tvm_mla_attention_h{heads}_{rank}x{rope}_{dtype}")
    query = ctx.bb.emit(relax.op.concat([q_latent, q_rope], axis=2))
    out = ctx.bb.emit(relax.call_tir(attend, [query, q_indptr, rows, page_indptr, page_values, last_page_len],
                                     [relax.TensorType(q_latent.ty.shape, dtype),
                                      relax.TensorType((q_latent.ty.shape[0], heads), "float32")]))
    return ctx.bb.emit(relax.TupleGetItem(out, 0))


def _kiln_attend(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr, page_values, last_page_len, scales):
    heads, rank = int(q_latent.ty.shape[1]), int(q_latent.ty.shape[2])
    rope, dtype, scale = int(q_rope.ty.shape[2]), q_latent.ty.dtype, float(node.attrs["scale"])
    kernel = ctx.add_kernel(latent_attend_kernel(heads, ctx.kv_spec(node), dtype, scale),
                            f"latent_attend_{pages.ty.dtype}_h{heads}_{rank}x{rope}_{dtype}", scheduled=True)
    args = [q_latent, q_rope, q_indptr, pages, page_indptr, page_values, last_page_len]
    return ctx.bb.emit(relax.call_tir(kernel, args + ([scales] if scales is not None else []),
                                      relax.TensorType(q_latent.ty.shape, dtype)))


@dataclass(frozen=True)
class LatentEmitters:
    append: Callable
    attend: Callable


# how each family of selection/latent.py's LATENT_KERNELS emits latent_append and latent_attend
EMITTERS = {"kiln_latent": LatentEmitters(_kiln_append, _kiln_attend),
            "tvm_mla": LatentEmitters(_tvm_append, _tvm_attend),
            "flashinfer_mla": LatentEmitters(_tvm_append, emit_flashinfer_mla)}     # the same pages as tvm_mla's


def emit_latent_append(ctx, node, c_kv, k_pe, pages, slots, scales=None):
    return EMITTERS[recorded(node, ctx.step)].append(ctx, node, c_kv, k_pe, pages, slots, scales)


def emit_latent_attend(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr, page_values, last_page_len,
                       scales=None):
    if not isinstance(pages.ty, relax.TensorType):                 # a quantised append's (pages, scales)
        pages, scales = (ctx.bb.emit(relax.TupleGetItem(pages, i)) for i in range(2))
    return EMITTERS[recorded(node, ctx.step)].attend(ctx, node, q_latent, q_rope, pages, q_indptr, page_indptr,
                                                    page_values, last_page_len, scales)


def emit_head_linear(ctx, node, x, w):
    heads, k_in, n_out = (int(d) for d in w.ty.shape)
    dtype = x.ty.dtype
    head_linear = gpu_head_linear if ctx.target.thread_blocks else cpu_head_linear
    kernel = ctx.add_kernel(head_linear(heads, k_in, n_out, dtype),
                            f"head_linear_h{heads}_{k_in}x{n_out}_{dtype}", scheduled=True)
    return ctx.bb.emit(relax.call_tir(kernel, [x, w], relax.TensorType((x.ty.shape[0], heads, n_out), dtype)))


# the expanded form's ops (latent_gather, expanded_attend) have one family of kernels, kiln_expanded:
# select_kernels records it, or refuses a target whose latent family has no expanded form

def emit_latent_gather(ctx, node, pages, slots, scales=None):
    if not isinstance(pages.ty, relax.TensorType):                 # a quantised append's (pages, scales)
        pages, scales = (ctx.bb.emit(relax.TupleGetItem(pages, i)) for i in range(2))
    width, dtype = int(pages.ty.shape[4]), node.attrs["dtype"]
    kernel = ctx.add_kernel(latent_gather_kernel(ctx.kv_spec(node), dtype),
                            f"latent_gather_{pages.ty.dtype}_{width}_{dtype}", scheduled=True)
    out_ty = relax.TensorType((slots.ty.shape[0], width), dtype)
    return ctx.bb.emit(relax.call_tir(kernel, [pages, slots] + ([scales] if scales is not None else []), out_ty))


def emit_expanded_attend(ctx, node, q_nope, q_rope, kv, rows, q_indptr, kv_indptr):
    heads, nope = int(q_nope.ty.shape[1]), int(q_nope.ty.shape[2])
    rope, width, dtype = int(q_rope.ty.shape[2]), int(rows.ty.shape[1]), q_nope.ty.dtype
    value = int(kv.ty.shape[1]) // heads - nope
    kernel = ctx.add_kernel(expanded_attend_kernel(heads, nope, rope, value, width, dtype, float(node.attrs["scale"])),
                            f"expanded_attend_h{heads}_{nope}x{rope}x{value}_{dtype}", scheduled=True)
    out_ty = relax.TensorType((q_nope.ty.shape[0], heads, value), dtype)
    return ctx.bb.emit(relax.call_tir(kernel, [q_nope, q_rope, kv, rows, q_indptr, kv_indptr], out_ty))
