"""The host CPU through LLVM (x86-64 or AArch64), with kiln's packed-weight linear kernels (what the
CPU itself reports, and what an artifact needs of it: kiln/host_cpu.py)."""
from __future__ import annotations

from dataclasses import dataclass

import tvm

from kiln.codegen.layouts import packed_layout
from kiln.host_cpu import cpu_target, host_cpu_features, host_llvm_target, missing_cpu_features, named_cpu_features

from .base import Target


def host_cpu_target() -> tvm.target.Target:
    """LLVM's target for this machine's CPU (kiln/host_cpu.py). What is built for it lowers float32
    exp inline (codegen/exp_lowering.py), not as libm calls."""
    from kiln.codegen.exp_lowering import register_exp_lowering
    register_exp_lowering()
    return host_llvm_target()


def named_cpu_target(cpu: str) -> tvm.target.Target:
    """LLVM's target for the CPU model LLVM calls `cpu` (sapphirerapids, znver4, x86-64-v4, …), with
    every instruction set that model has: for building on one machine what runs on another."""
    from kiln.codegen.exp_lowering import register_exp_lowering
    register_exp_lowering()
    return cpu_target(cpu, dict.fromkeys(named_cpu_features(cpu), True))


def _int8_dot(target: tvm.target.Target) -> str:
    """The integer dot kiln's int8-activation kernels use on `target`'s CPU: "vnni" (AVX-512 VNNI,
    codegen/vnni_linear.py), "avx2" (vpmaddwd, codegen/int8_gemm.py and int8_gemv.py), or "" (none:
    linears keep float activations)."""
    from kiln.codegen.int8_gemm import has_pair_dot
    from kiln.codegen.vnni_linear import has_quad_dot
    return "vnni" if has_quad_dot(target) else "avx2" if has_pair_dot(target) else ""


def _bf16_dot(target: tvm.target.Target) -> bool:
    """Whether `target`'s CPU multiplies bf16 pairs (AVX-512 BF16): bf16 linears then run
    codegen/bf16_linear.py."""
    from kiln.codegen.bf16_micro import has_bf16_dot
    return has_bf16_dot(target)


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
    # arch: the CPU model to build for, by LLVM's name (None: this machine's CPU, as CPUID reports it)
    int8_dot: str | None = None        # None: the CPU's, asked of LLVM (_int8_dot)
    bf16_dot: bool | None = None
    activation_block: int = -1         # llama.cpp's Q8_0 block where there is an int8 dot, else 0

    def __post_init__(self):
        if self.int8_dot is None or self.bf16_dot is None:
            target = self.tvm_target()
            self.int8_dot = _int8_dot(target) if self.int8_dot is None else self.int8_dot
            self.bf16_dot = _bf16_dot(target) if self.bf16_dot is None else self.bf16_dot
        if self.activation_block < 0:
            self.activation_block = 32 if self.int8_dot else 0

    @classmethod
    def as_planned(cls, arch: str | None, activation_block: int):
        # the passes read only the activation block; what the CPU's dot products are does not matter
        # (the weights' layouts are the manifest's), so LLVM is not asked
        return cls(arch=arch, int8_dot="", bf16_dot=False, activation_block=activation_block)

    def cpu_features(self) -> list[str]:
        """The instruction sets the kernels may use: an artifact records them, and a CPU that lacks
        one refuses to load it (missing_cpu_features)."""
        return named_cpu_features(self.arch) if self.arch else host_cpu_features()

    def weight_quants(self):
        return ("q8", "q4", "fp8")      # fp8 is decoded in software here: for accuracy checks, not speed

    def tvm_target(self) -> tvm.target.Target:
        return named_cpu_target(self.arch) if self.arch else host_cpu_target()

    def linear_layout(self, n_out, n_in, operands=None, act_block=0):
        # Pack nb output columns contiguously so the kernel accumulates nb lanes in registers; for
        # a dot product put the inputs it multiplies at once side by side.
        nb = next((nb for nb in (64, 32, 16, 8) if n_out % nb == 0), None)
        if nb is None:
            return "nk"
        if operands == "bf16":
            return packed_layout(nb, 2) if self.bf16_dot and nb % 16 == 0 and n_in % 2 == 0 else packed_layout(nb)
        if operands in ("q8", "q4") and self.int8_dot == "vnni" and act_block > 0:
            from kiln.codegen.weight_format import WeightFormat
            from kiln.codegen.vnni_linear import supports
            inputs = n_in * (2 if operands == "q4" else 1)           # a q4 weight is stored as bytes of two
            if supports(n_out, inputs, nb, WeightFormat(operands, act_block=act_block)):
                # vpdpbusd's byte quads; a q4 byte's nibbles from two activation blocks
                return packed_layout(nb, 4, act_block if operands == "q4" else 0)
        if operands == "q8" and n_in % 2 == 0:
            return packed_layout(nb, 2)                  # vpmaddwd's pairs (a q4 byte is one already)
        return packed_layout(nb)

    def relax_pipeline(self):
        # TVM's CPU pipeline (legalize, fuse elementwise chains, lower to the VM), with the kernels
        # it legalised scheduled after fusion (codegen/cpu_schedule.py); kiln's own kernels are
        # opaque (op_pattern 8) and keep their schedules.
        from tvm.relax.backend.cpu_generic import pipeline as cpu_generic
        from kiln.codegen.cpu_schedule import schedule_cpu_kernels
        target = self.tvm_target()

        @tvm.transform.module_pass(opt_level=0)
        def pipeline(mod, _ctx):
            with target:
                return tvm.transform.Sequential(
                    cpu_generic.library_dispatch_passes(target) + cpu_generic.legalize_passes(target)
                    + [schedule_cpu_kernels()] + cpu_generic.dataflow_lower_passes(target)
                    + cpu_generic.finalize_passes(target))(mod)
        return pipeline


TARGET_CLASS = CPUTarget


def make_target(arch: str | None) -> CPUTarget:
    if not arch:
        return CPUTarget()
    lacking = missing_cpu_features(named_cpu_features(arch))       # an unknown name is refused here
    return CPUTarget(arch=arch, runs_here=not lacking,
                     note=f"built for {arch}: this machine's CPU lacks {', '.join(lacking)}" if lacking else "")
