"""The host CPU through LLVM (x86-64 or AArch64), with kiln's packed-weight linear kernels (what the
CPU itself reports, and what an artifact needs of it: kiln/host_cpu.py)."""
from __future__ import annotations

from dataclasses import dataclass

import tvm

from kiln.host_cpu import (
    cpu_target,
    has_bf16_dot,
    has_pair_dot,
    has_quad_dot,
    has_tiles,
    host_cpu_features,
    host_llvm_target,
    missing_cpu_features,
    named_cpu_features,
)

from .base import Target


def host_cpu_target() -> tvm.target.Target:
    """LLVM's target for this machine's CPU (kiln/host_cpu.py). What is built for it lowers float32
    exp inline (targets/exp_lowering.py), not as libm calls."""
    from .exp_lowering import register_exp_lowering
    register_exp_lowering()
    return host_llvm_target()


def named_cpu_target(cpu: str) -> tvm.target.Target:
    """LLVM's target for the CPU model LLVM calls `cpu` (sapphirerapids, znver4, x86-64-v4, …), with
    every instruction set that model has: for building on one machine what runs on another."""
    from .exp_lowering import register_exp_lowering
    register_exp_lowering()
    return cpu_target(cpu, dict.fromkeys(named_cpu_features(cpu), True))


def _int8_dot(target: tvm.target.Target) -> str:
    """The integer dot kiln's int8-activation kernels use on `target`'s CPU: "vnni" (AVX-512 VNNI,
    codegen/kernels/cpu/vnni_linear.py), "avx2" (vpmaddwd, codegen/kernels/cpu/int8_gemm.py and int8_gemv.py), or "" (none:
    linears keep float activations)."""
    return "vnni" if has_quad_dot(target) else "avx2" if has_pair_dot(target) else ""


def _bf16_dot(target: tvm.target.Target) -> bool:
    """Whether `target`'s CPU multiplies bf16 pairs (AVX-512 BF16): bf16 linears then run
    codegen/kernels/cpu/bf16_linear.py."""
    return has_bf16_dot(target)


@dataclass
class CPUTarget(Target):
    name: str = "cpu"
    device: str = "cpu"
    default_dtype: str = "float32"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    kv_dtypes: tuple[str, ...] = ("int8", "fp8")
    decode_gemm_from: int = 8          # where the GEMM overtakes the GEMV: docs/BENCHMARKS.md
    mla_expanded_from: int = 32        # where kiln's CPU kernels make it faster: docs/BENCHMARKS.md
    # arch: the CPU model to build for, by LLVM's name (None: this machine's CPU, as CPUID reports it)
    int8_dot: str | None = None        # None: the CPU's, asked of LLVM (_int8_dot)
    bf16_dot: bool | None = None
    activation_block: int = -1         # llama.cpp's Q8_0 block where there is an int8 dot, else 0
    tiles: str | None = None           # None: "amx" where the CPU has AMX (and the dots it falls back on), else ""

    def __post_init__(self):
        if self.int8_dot is None or self.bf16_dot is None or self.tiles is None:
            target = self.tvm_target()
            self.int8_dot = _int8_dot(target) if self.int8_dot is None else self.int8_dot
            self.bf16_dot = _bf16_dot(target) if self.bf16_dot is None else self.bf16_dot
            if self.tiles is None:     # tile kernels fall back on these dots where the OS refuses tiles
                self.tiles = "amx" if has_tiles(target) and self.bf16_dot and self.int8_dot == "vnni" else ""
        if self.activation_block < 0:
            self.activation_block = 32 if self.int8_dot else 0

    @classmethod
    def as_planned(cls, arch: str | None, activation_block: int):
        # the passes read only the activation block; what the CPU's dot products are does not matter
        # (the weights' layouts are the manifest's), so LLVM is not asked
        return cls(arch=arch, int8_dot="", bf16_dot=False, activation_block=activation_block, tiles="")

    def cpu_features(self) -> list[str]:
        """The instruction sets the kernels may use: an artifact records them, and a CPU that lacks
        one refuses to load it (missing_cpu_features)."""
        return named_cpu_features(self.arch) if self.arch else host_cpu_features()

    def weight_quants(self):
        # fp8 is decoded in software here: for accuracy checks, not speed
        return ("q8", "q4", "fp8", "q8g", "q4a", "q4k")

    def tvm_target(self) -> tvm.target.Target:
        return named_cpu_target(self.arch) if self.arch else host_cpu_target()


TARGET_CLASS = CPUTarget


def make_target(arch: str | None) -> CPUTarget:
    if not arch:
        return CPUTarget()
    lacking = missing_cpu_features(named_cpu_features(arch))       # an unknown name is refused here
    return CPUTarget(arch=arch, runs_here=not lacking,
                     note=f"built for {arch}: this machine's CPU lacks {', '.join(lacking)}" if lacking else "")
