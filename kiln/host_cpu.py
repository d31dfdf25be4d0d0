"""This machine's CPU as LLVM sees it: its instruction sets, the LLVM target for it or for a CPU model
LLVM names, and what an artifact compiled elsewhere needs that this CPU lacks (kiln/cpu_features.py).
A leaf of the compiler's side: codegen (the quantiser's kernel) and the CPU target read it; the
runtime asks the same of runtime/tvm_bridge.py."""
from __future__ import annotations

import platform

import tvm

from kiln.cpu_features import ISA_PREFIXES, LLVM_HOST_FEATURES, isa_features, missing_features
from kiln.errors import KilnError


def named_cpu_features(cpu: str) -> list[str]:
    """The instruction sets of LLVM's CPU model `cpu`, sorted; an unknown name is refused."""
    plain = tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu"})
    known = [str(name) for name in tvm.target.codegen.llvm_get_cpu_archlist(plain)]
    if cpu not in known:
        raise KilnError(f"target cpu: LLVM knows no CPU named {cpu!r} (--arch takes one of: {', '.join(known)})")
    model = tvm.target.Target({"kind": "llvm", "mtriple": str(plain.attrs["mtriple"]), "mcpu": cpu})
    return sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(model) if str(f).startswith(ISA_PREFIXES))


def has_llvm() -> bool:
    """Whether this TVM has its compiler library (LLVM): a runtime-only TVM has not."""
    return tvm.get_global_func(LLVM_HOST_FEATURES, allow_missing=True) is not None


def reported_features() -> dict[str, bool]:
    """LLVM's feature map of this machine's CPU (CPUID): name -> present."""
    return dict(tvm.get_global_func(LLVM_HOST_FEATURES)().items())


def cpu_target(cpu: str, reported: dict[str, bool]) -> tvm.target.Target:
    """LLVM's target for CPU model `cpu` with each instruction set switched on or off as `reported`
    (name -> present): a VM may hide one the model implies (AMX on a Sapphire Rapids host,
    AVX-512 on a Zen 4 one), and kernels built with it would stop with SIGILL."""
    mattr = sorted(("+" if on else "-") + name for name, on in reported.items() if name.startswith(ISA_PREFIXES))
    return tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu",
                              "mcpu": cpu, "mattr": mattr})


def host_cpu_features() -> list[str]:
    """The instruction sets this machine's CPU reports (CPUID, as LLVM reads it), sorted."""
    return isa_features(reported_features())


def missing_cpu_features(built_on: list[str]) -> list[str]:
    """The instruction sets of the CPU an artifact was compiled on (its manifest's `cpu_features`)
    that this machine's CPU lacks (kiln/cpu_features.py)."""
    return missing_features(built_on, reported_features() if has_llvm() else None)


def host_llvm_target() -> tvm.target.Target:
    """LLVM's target for this machine's CPU, each instruction set on or off as CPUID reports it
    ("mcpu": "native" is ignored by TVM's LLVM: the CPU's name and features are asked instead)."""
    return cpu_target(tvm.target.codegen.llvm_get_system_cpu(), reported_features())


def x86_has(target: tvm.target.Target, features: list[str]) -> bool:
    """Whether an LLVM target is x86 with every one of `features`."""
    return ("x86" in str(target.attrs.get("mtriple", ""))
            and bool(tvm.target.codegen.llvm_cpu_has_features(features, target)))


def has_pair_dot(target: tvm.target.Target) -> bool:
    """AVX2's vpmaddwd: int16 pairs into int32 lanes (codegen/kernels/cpu/int8_gemm.py, int8_gemv.py)."""
    return x86_has(target, ["avx2"])


def has_quad_dot(target: tvm.target.Target) -> bool:
    """AVX-512 VNNI's vpdpbusd: byte quads into int32 lanes (codegen/kernels/cpu/vnni_linear.py)."""
    return x86_has(target, ["avx512vnni", "avx512bw"])


def has_tiles(target: tvm.target.Target) -> bool:
    """Intel AMX's tdpbf16ps and tdpbssd: bf16 and int8 tiles (codegen/kernels/cpu/tile_micro.py)."""
    return x86_has(target, ["amx-tile", "amx-bf16", "amx-int8"])


def has_bf16_dot(target: tvm.target.Target) -> bool:
    """AVX-512 BF16's vdpbf16ps: bf16 pairs into float32 lanes (codegen/kernels/cpu/bf16_micro.py)."""
    return x86_has(target, ["avx512bf16", "avx512f"])
