"""The host CPU through LLVM (x86-64 or AArch64), with kiln's packed-weight linear kernels."""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import tvm

from kiln.codegen.layouts import packed_layout
from kiln.errors import KilnError

from .base import Target


# LLVM feature names of instruction sets (not tuning flags) a CPU artifact's kernels may use
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "gfni", "vaes", "vpclmulqdq", "neon", "sve",
                 "dotprod", "i8mm", "bf16")


def host_cpu_target() -> tvm.target.Target:
    # "mcpu": "native" is ignored by TVM's LLVM; ask LLVM for the host CPU's name and the features
    # CPUID reports instead. What is built for it lowers float32 exp inline
    # (codegen/exp_lowering.py), not as libm calls.
    from kiln.codegen.exp_lowering import register_exp_lowering
    register_exp_lowering()
    return cpu_target(tvm.target.codegen.llvm_get_system_cpu(), _reported_features())


def named_cpu_target(cpu: str) -> tvm.target.Target:
    """LLVM's target for the CPU model LLVM calls `cpu` (sapphirerapids, znver4, x86-64-v4, …), with
    every instruction set that model has: for building on one machine what runs on another."""
    from kiln.codegen.exp_lowering import register_exp_lowering
    register_exp_lowering()
    return cpu_target(cpu, dict.fromkeys(named_cpu_features(cpu), True))


def named_cpu_features(cpu: str) -> list[str]:
    """The instruction sets of LLVM's CPU model `cpu`, sorted; an unknown name is refused."""
    plain = tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu"})
    known = [str(name) for name in tvm.target.codegen.llvm_get_cpu_archlist(plain)]
    if cpu not in known:
        raise KilnError(f"target cpu: LLVM knows no CPU named {cpu!r} (--arch takes one of: {', '.join(known)})")
    model = tvm.target.Target({"kind": "llvm", "mtriple": str(plain.attrs["mtriple"]), "mcpu": cpu})
    return sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(model) if str(f).startswith(_ISA_PREFIXES))


LLVM_HOST_FEATURES = "tvm.codegen.llvm.GetHostCPUFeatures"     # TVM's compiler library registers it


def has_llvm() -> bool:
    """Whether this TVM has its compiler library (LLVM): a runtime-only TVM has not."""
    return tvm.get_global_func(LLVM_HOST_FEATURES, allow_missing=True) is not None


def _reported_features() -> dict[str, bool]:
    """LLVM's feature map of this machine's CPU (CPUID): name -> present."""
    return dict(tvm.get_global_func(LLVM_HOST_FEATURES)().items())


def cpu_target(cpu: str, reported: dict[str, bool]) -> tvm.target.Target:
    """LLVM's target for CPU model `cpu` with each instruction set switched on or off as `reported`
    (name -> present): a VM may hide one the model implies (AMX on a Sapphire Rapids host,
    AVX-512 on a Zen 4 one), and kernels built with it would stop with SIGILL."""
    mattr = sorted(("+" if on else "-") + name for name, on in reported.items() if name.startswith(_ISA_PREFIXES))
    return tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu",
                              "mcpu": cpu, "mattr": mattr})


def host_cpu_features() -> list[str]:
    """The instruction sets this machine's CPU reports (CPUID, as LLVM reads it), sorted."""
    return sorted(name for name, on in _reported_features().items() if on and name.startswith(_ISA_PREFIXES))


def missing_cpu_features(built_on: list[str]) -> list[str]:
    """The instruction sets of the CPU an artifact was compiled on (its manifest's `cpu_features`)
    that this machine's CPU lacks: kernels built there could stop with SIGILL here. A TVM without
    its compiler has no LLVM to ask: then the flags Linux lists in /proc/cpuinfo answer."""
    if not has_llvm():
        return missing_in_cpuinfo(built_on, cpuinfo_features())
    here = set(host_cpu_features())
    return [name for name in built_on if name not in here]


def missing_in_cpuinfo(built_on: list[str], flags: set[str]) -> list[str]:
    """The LLVM feature names in `built_on` that /proc/cpuinfo's `flags` (cpuinfo_features) lack."""
    return [name for name in built_on if _plain(_CPUINFO_NAMES.get(name, name)) not in flags]


# LLVM's feature names that /proc/cpuinfo spells otherwise (beyond "_", "-" and ".")
_CPUINFO_NAMES = {"bmi": "bmi1", "sse3": "pni", "neon": "asimd", "dotprod": "asimddp"}


def _plain(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(".", "")


def cpuinfo_features(path: str = "/proc/cpuinfo") -> set[str]:
    """The first processor's flags (x86) or features (Arm) in /proc/cpuinfo, spelt plainly."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise KilnError(f"cannot read this CPU's features from {path} ({e}) and TVM has no LLVM to ask") from None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return {_plain(flag) for flag in value.split()}
    raise KilnError(f"{path} lists no CPU flags and TVM has no LLVM to ask")


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
            from kiln.codegen.linear import WeightFormat
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
