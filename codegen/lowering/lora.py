"""LoRA adapters after a projection (ir/lora_ops.py): kiln's CPU kernel, in place on the projection's
output (nothing else reads it: passes/add_lora.py renamed it for the lora op alone)."""
from __future__ import annotations

from tvm import relax

from ..kernels.cpu.lora import cpu_lora


def emit_lora(ctx, node, y, x, a, b, slots):
    n_in, stacked, dtype = int(x.ty.shape[-1]), int(a.ty.shape[0]), node.type.dtype
    rows, rank = tuple(node.attrs["rows"]), node.attrs["rank"]
    kernel = ctx.add_kernel(cpu_lora(n_in, rows, rank, stacked, dtype),
                            f"lora_{dtype}_{n_in}x{'_'.join(map(str, rows))}_r{rank}_s{stacked}", scheduled=True)
    return ctx.bb.emit(relax.call_tir_inplace(kernel, [y, x, a, b, slots], [0], y.ty))
