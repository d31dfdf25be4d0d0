"""Hopper GEMMs (sm_90a): CUTLASS's warp-specialised TMA + wgmma GEMM for bf16/fp16 linears, compiled
at `kiln compile` and linked into a CUDA artifact's library.

One object per variant (activation dtype, weight format: float or q4; tile: selection/tiles.py
HopperTile), built by nvcc from hopper_gemm.cu with the variant as macros against nvidia-cutlass's
headers (a compile-time dependency, release CUTLASS_RELEASE; the runtime needs neither it nor nvcc).
Each object registers one global function, the variant's name, which a linear's TIR calls
(codegen/kernels/gpu/mma_gemm.py wgmma_linear_kernel). Objects are cached under kiln's cache
(KILN_CACHE_DIR, else ~/.cache/kiln) keyed by their source, flags, macros, nvcc and CUTLASS: a second
compile builds nothing, and the variants a compile lacks build in parallel, one per core.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.selection.tiles import HopperTile

from .cuda_objects import cache_dir, installed_release

CUTLASS_RELEASE = "4.2.0.0"      # nvidia-cutlass, whose headers hopper_gemm.cu is written against
SOURCE = Path(__file__).with_name("hopper_gemm.cu")
ELEMENTS = {"bfloat16": ("cutlass::bfloat16_t", "bf16"), "float16": ("cutlass::half_t", "f16")}
ARCH = "sm_90a"                  # wgmma and TMA are sm_90a's arch-specific instructions
# epilogue codes the function takes (hopper_gemm.cu): which of bias and residual are real
BIAS, RESIDUAL = 1, 2


@dataclass(frozen=True)
class HopperGemm:
    """One variant: the function `name`(x, w, y, bias, residual, epilogue) for one dtype, weight
    format and tile; q4's takes its scales and zeros after w (any group the tile's K divides)."""
    dtype: str
    tile: HopperTile
    weight: str = "float"          # or "q4"

    @property
    def name(self) -> str:
        form = "" if self.weight == "float" else f"_{self.weight}"
        return f"kiln_hopper_gemm_{ELEMENTS[self.dtype][1]}{form}_{self.tile.name}"

    def defines(self) -> list[str]:
        t = self.tile
        return [f"-DKILN_GEMM_NAME={self.name}", f"-DKILN_ELEMENT={ELEMENTS[self.dtype][0]}",
                f"-DKILN_TILE_M={t.m}", f"-DKILN_TILE_N={t.n}", f"-DKILN_TILE_K={t.k}",
                f"-DKILN_CLUSTER_M={t.cluster}", "-DKILN_CLUSTER_N=1", f"-DKILN_SCHEDULE={int(t.cooperative)}",
                f"-DKILN_Q4={int(self.weight == 'q4')}"]


def cutlass_include() -> Path:
    """nvidia-cutlass's header folder, where its release is CUTLASS_RELEASE."""
    install = f"pip install --no-deps nvidia-cutlass=={CUTLASS_RELEASE} (make setup does)"
    found = installed_release("nvidia-cutlass")
    if found is None:
        raise KilnError(f"sm_90 linears build CUTLASS's Hopper GEMMs, and nvidia-cutlass's headers are not "
                        f"installed: {install}")
    if found != CUTLASS_RELEASE:
        raise KilnError(f"sm_90 linears build against nvidia-cutlass {CUTLASS_RELEASE}; {found} is installed: "
                        f"{install}")
    import cutlass_library
    return Path(cutlass_library.__file__).parent / "source" / "include"


def nvcc() -> str:
    beside = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    found = shutil.which("nvcc") or (str(beside) if beside.exists() else None)
    if found is None:
        raise KilnError("sm_90 linears build CUTLASS's Hopper GEMMs with nvcc, which is not installed (CUDA 12.4+)")
    return found


@functools.cache
def _nvcc_version() -> str:
    return subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout


# -DNDEBUG: with CUTLASS's asserts in, ptxas serialises the wgmma pipeline (warning C7510). Host code
# at -O1: CUTLASS's host side is force-inlined templates, and -O3 only made gcc take 13 s, not 9.
FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC,-O1",
         f"-gencode=arch=compute_{ARCH[3:]},code={ARCH}")


def _command(variant: HopperGemm, out: Path) -> list[str]:
    import tvm_ffi.libinfo
    includes = [f"-I{cutlass_include()}", *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths())]
    return [nvcc(), *FLAGS, *includes, *variant.defines(), "-c", str(SOURCE), "-o", str(out)]


def object_path(variant: HopperGemm) -> Path:
    """Where the variant's object is cached: named by a digest of everything that makes it."""
    import tvm_ffi
    key = hashlib.sha256("\n".join([SOURCE.read_text(), *FLAGS, *variant.defines(), _nvcc_version(), CUTLASS_RELEASE,
                                    tvm_ffi.__version__]).encode()).hexdigest()[:16]
    return cache_dir() / "hopper_gemm" / f"{variant.name}-{key}.o"


def _build(variant: HopperGemm) -> Path:
    out = object_path(variant)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.partial.o")
    built = subprocess.run(_command(variant, partial), capture_output=True, text=True)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KilnError(f"building CUTLASS's Hopper GEMM {variant.name} failed: {built.stderr[-1500:]}")
    partial.replace(out)        # whole or absent: a parallel compile may build the same variant
    return out


def build_objects(variants) -> list[Path]:
    """The variants' objects, building the missing ones in parallel (one nvcc per core: each takes
    about a minute and 4 GB)."""
    variants = sorted(set(variants), key=lambda v: v.name)
    workers = max(1, min(len(variants), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_build, variants))


def static_libraries(variants) -> list:
    """The variants' objects as TVM static libraries, for the Relax build's external_mods (their
    functions register themselves globally when the library loads)."""
    import tvm
    return [tvm.runtime.load_static_library(str(o), func_names=[]) for o in build_objects(variants)]
