"""A GPU decode step's linear scheduled by dlight's low-batch GEMV rule (TVM's), for the formats and
shapes kiln's own GEMV (gemv.py) does not take."""
from __future__ import annotations

from tvm import relax, tirx
from tvm.s_tir import dlight as dl

from ..te_linear import own_kernel

DECODE_ROWS = 4       # GPU decode GEMV: sequences a thread block multiplies per read of its weight tile


def decode_kernel(target, kernel, args: list[relax.Expr]) -> tuple[tirx.PrimFunc, bool]:
    """A GPU decode step's linear as a kernel of its own, and whether it is scheduled: by dlight's
    low-batch GEMV rule where that takes it, else left to the default pipeline. Left to it, the
    kernel every step shares is scheduled as a GEMM over a symbolic row count: 64-column tiles of
    32 padded rows, so a batch-1 step of a 2048-wide output runs 32 thread blocks, each walking the
    whole reduction (measured on an H200: a 2048x8192 bf16 decode linear at 54 GB/s). Kept out of
    fusion either way: grouped with the elementwise ops between the GEMVs, a linear the rule does
    not take (the 1-wide shared-expert gate of Qwen2-MoE) makes a function dlight's GEMV rule
    fails on."""
    func = own_kernel(kernel, args)
    sch = dl.gpu.LowBatchGEMV(DECODE_ROWS).apply(func, target.tvm_target(), False)
    return (sch.mod["main"], True) if sch is not None else (func, False)
