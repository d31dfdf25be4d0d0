"""The host CPU through LLVM (x86-64 or AArch64), with kiln's packed-weight linear kernels."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field

import tvm
from tvm import relax

from kiln.codegen.layouts import PAIRS
from kiln.errors import KilnError

from .base import Target


def host_cpu_target() -> tvm.target.Target:
    # "mcpu": "native" is ignored by TVM's LLVM; ask LLVM for the host CPU's name instead.
    return tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu",
                              "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _int8_activation_block() -> int:
    """llama.cpp's Q8_0 block where the CPU has kiln's integer pair-dot kernel (AVX2), else none."""
    from kiln.codegen.int8_gemm import has_pair_dot
    return 32 if has_pair_dot(host_cpu_target()) else 0


@dataclass
class CPUTarget(Target):
    name: str = "cpu"
    device: str = "cpu"
    default_dtype: str = "float32"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("int8", "fp8")
    chunk_gemm: bool = True
    decode_gemm_from: int = 8          # where the GEMM overtakes the GEMV: docs/BENCHMARKS.md
    mla_expanded_from: int = 32        # where kiln's CPU kernels make it faster: docs/BENCHMARKS.md
    activation_block: int = field(default_factory=lambda: _int8_activation_block())

    def weight_quants(self):
        return ("q8", "q4", "fp8")      # fp8 is decoded in software here: for accuracy checks, not speed

    def tvm_target(self) -> tvm.target.Target:
        return host_cpu_target()

    def linear_layout(self, n_out, n_in, input_pairs=False):
        # Pack nb output columns contiguously so the kernel accumulates nb lanes in registers.
        for nb in (64, 32, 16, 8):
            if n_out % nb == 0:
                return f"packed{nb}" + (PAIRS if input_pairs and n_in % 2 == 0 else "")
        return "nk"

    def relax_pipeline(self):
        # TVM's CPU pipeline: legalize, fuse elementwise chains (FuseOps/FuseTIR), lower to the VM.
        # kiln's own kernels are opaque (op_pattern 8) and keep their schedules.
        return relax.get_default_pipeline(self.tvm_target())


TARGET_CLASS = CPUTarget


def make_target(arch: str | None) -> CPUTarget:
    if arch:
        raise KilnError("target cpu takes no --arch (it compiles for this machine's CPU)")
    return CPUTarget()
