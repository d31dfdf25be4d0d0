"""A CPU's instruction sets by LLVM's names, and which of those an artifact needs that a CPU lacks.
TVM-free: the runtime (through runtime/tvm_bridge.py, which asks TVM's LLVM for the host's features)
and the compiler (kiln/host_cpu.py) both read it. Where TVM has no LLVM to ask (a runtime-only
TVM), the flags Linux lists in /proc/cpuinfo answer."""
from __future__ import annotations

from pathlib import Path

from kiln.cpu_tiles import TILE_ISA
from kiln.errors import KilnError

# LLVM feature names of instruction sets (not tuning flags) a CPU artifact's kernels may use
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "ssse", "gfni", "vaes", "vpclmulqdq", "neon", "sve",
                 "dotprod", "i8mm", "bf16")

LLVM_HOST_FEATURES = "tvm.codegen.llvm.GetHostCPUFeatures"     # TVM's compiler library registers it


def isa_features(reported: dict[str, bool]) -> list[str]:
    """The instruction sets present in LLVM's feature map (name -> present), sorted."""
    return sorted(name for name, on in reported.items() if on and name.startswith(ISA_PREFIXES))


def missing_features(built_on: list[str], reported: dict[str, bool] | None) -> list[str]:
    """The instruction sets of the CPU an artifact was compiled on (its manifest's `cpu_features`)
    that this machine's CPU lacks, by LLVM's feature map of it (`reported`), or where there is none
    (no LLVM), by /proc/cpuinfo: kernels built there could stop with SIGILL here. AMX's are not
    needed: kiln's tile kernels ask the OS for tiles first and run without them (kiln/cpu_tiles.py)."""
    if reported is None:
        return missing_in_cpuinfo(built_on, cpuinfo_features())
    here = set(isa_features(reported))
    return [name for name in built_on if name not in here and not name.startswith(TILE_ISA)]


def missing_in_cpuinfo(built_on: list[str], flags: set[str]) -> list[str]:
    """The LLVM feature names in `built_on` that /proc/cpuinfo's `flags` (cpuinfo_features) lack
    (AMX's not needed, as in missing_features)."""
    return [name for name in built_on
            if _plain(_CPUINFO_NAMES.get(name, name)) not in flags and not name.startswith(TILE_ISA)]


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
