"""LoRA adapters after a projection (ir/lora_ops.py): kiln's CPU kernel, or its CUDA kernel on GPUs, in
place on the projection's output (nothing else reads it: passes/add_lora.py renamed it for the lora op
alone)."""
from __future__ import annotations

from tvm import relax

from kiln.errors import KilnError
from kiln.ir import input_of

from ..kernels.cpu.lora import cpu_lora
from ..kernels.gpu.lora import lora_kernel


def emit_lora(ctx, node, y, x, a, b, slots):
    n_in, stacked, dtype = int(x.ty.shape[-1]), int(a.ty.shape[0]), node.type.dtype
    adapter_dtype = ctx.types[input_of(node, "a")].dtype
    rows, rank = tuple(node.attrs["rows"]), node.attrs["rank"]
    if ctx.target.device == "cuda":
        if adapter_dtype != dtype:
            raise KilnError(f"--lora-dtype {adapter_dtype}: the CUDA LoRA kernel takes adapters in the model's "
                            f"dtype, {dtype}")
        func, name = lora_kernel(n_in, rows, rank, stacked, dtype)
        kernel = ctx.add_kernel(func, name, scheduled=True)
    else:
        kernel = ctx.add_kernel(cpu_lora(n_in, rows, rank, stacked, dtype, adapter_dtype),
                                f"lora_{dtype}_{adapter_dtype}_{n_in}x{'_'.join(map(str, rows))}_r{rank}_s{stacked}",
                                scheduled=True)
    return ctx.bb.emit(relax.call_tir_inplace(kernel, [y, x, a, b, slots], [0], y.ty))
