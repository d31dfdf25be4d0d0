"""This machine's CPU as LLVM sees it: its instruction sets, the LLVM target for it or for a CPU model
LLVM names, and what an artifact compiled elsewhere needs that this CPU lacks. A leaf: the runtime
(the check before it loads a CPU artifact), codegen (the quantiser's kernel) and the CPU target all
read it, and it imports nothing of kiln's but its errors. A TVM without its compiler has no LLVM to
ask: then /proc/cpuinfo answers."""
from __future__ import annotations

import platform
from pathlib import Path

import tvm

from kiln.errors import KilnError

# LLVM feature names of instruction sets (not tuning flags) a CPU artifact's kernels may use
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "gfni", "vaes", "vpclmulqdq", "neon", "sve",
                 "dotprod", "i8mm", "bf16")


def named_cpu_features(cpu: str) -> list[str]:
    """The instruction sets of LLVM's CPU model `cpu`, sorted; an unknown name is refused."""
    plain = tvm.target.Target({"kind": "llvm", "mtriple": f"{platform.machine()}-unknown-linux-gnu"})
    known = [str(name) for name in tvm.target.codegen.llvm_get_cpu_archlist(plain)]
    if cpu not in known:
        raise KilnError(f"target cpu: LLVM knows no CPU named {cpu!r} (--arch takes one of: {', '.join(known)})")
    model = tvm.target.Target({"kind": "llvm", "mtriple": str(plain.attrs["mtriple"]), "mcpu": cpu})
    return sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(model) if str(f).startswith(ISA_PREFIXES))


LLVM_HOST_FEATURES = "tvm.codegen.llvm.GetHostCPUFeatures"     # TVM's compiler library registers it


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
    return sorted(name for name, on in reported_features().items() if on and name.startswith(ISA_PREFIXES))


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


def has_bf16_dot(target: tvm.target.Target) -> bool:
    """AVX-512 BF16's vdpbf16ps: bf16 pairs into float32 lanes (codegen/kernels/cpu/bf16_micro.py)."""
    return x86_has(target, ["avx512bf16", "avx512f"])
