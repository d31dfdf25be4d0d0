"""Apple-silicon Macs: Metal kernels through TVM's Metal codegen (dlight schedules), host code for arm64 macOS.

Built here, runs on a Mac's GPU. The library holds Metal Shading Language *source*: TVM's Metal
runtime compiles it with the Metal framework when the artifact is loaded on the Mac (no metallib
is made here; that needs Apple's toolchain). The host half (the VM's shape code and kernel
launches) is compiled by TVM's LLVM for arm64-apple-macos and linked into a Mach-O dylib with
LLVM's ld64.lld (Debian: lld-22, `make metal-deps`); its TVM runtime symbols bind when the Mac's
TVM loads it, as with TVM's own macOS builds (`-undefined dynamic_lookup`).
Running needs a TVM runtime built with USE_METAL=ON on the Mac; the Linux wheel has it off.
bfloat16 is stored as 16-bit integers and computed in float32 by TVM, so it needs no MSL `bfloat`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

from .base import GPUTarget

ARCHS = {"m1": "apple/m1-gpu", "m2": "apple/m2-gpu"}   # the TVM tag: Metal limits + the host CPU
MACOS_MIN = "11.0"                                      # the first macOS on Apple silicon
# A text stub of libSystem, so the dylib binds dyld's lazy-binding helper to it as a native link would.
LIBSYSTEM_TBD = """--- !tapi-tbd
tbd-version: 4
targets: [ arm64-macos ]
install-name: '/usr/lib/libSystem.B.dylib'
current-version: 1.0
exports:
  - targets: [ arm64-macos ]
    symbols: [ dyld_stub_binder ]
...
"""


def find_ld64() -> str | None:
    for name in ("ld64.lld-22", "ld64.lld", "/usr/lib/llvm-22/bin/ld64.lld"):
        if path := shutil.which(name):
            return path
    return None


def link_macos_dylib(output: str, objects: list[str], **_) -> None:
    """export_library's link step: Mach-O arm64 objects -> a dylib that the Mac's TVM can dlopen."""
    ld64 = find_ld64()
    with tempfile.TemporaryDirectory(prefix="kiln-metal-") as tmp:
        tbd = Path(tmp) / "libSystem.tbd"
        tbd.write_text(LIBSYSTEM_TBD)
        cmd = [ld64, "-dylib", "-arch", "arm64", "-platform_version", "macos", MACOS_MIN, MACOS_MIN,
               "-install_name", f"@rpath/{Path(output).name}", "-undefined", "dynamic_lookup",
               "-o", output, *objects, str(tbd)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnError(f"linking the macOS library with {ld64} failed:\n{proc.stdout}{proc.stderr}")


link_macos_dylib.object_format = "o"        # export_library: write the host module as an object file


@contextmanager
def _metal_intrinsics_only():
    """dlight's Metal matmul rule imports tvm.s_tir.tensor_intrin.metal, whose package __init__ first
    registers every target's tensor intrinsics (CUDA, x86, ARM, ...): ~40 s here against ~2 s for Metal's.
    Stand in an empty package while the pipeline runs, so that only the submodules asked for load."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    import tvm.s_tir
    stub = types.ModuleType(name)
    stub.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
    sys.modules[name] = stub
    try:
        yield
    finally:
        # A later import of the package runs its real __init__; submodules already loaded (metal)
        # stay in sys.modules and are not registered twice.
        if sys.modules.get(name) is stub:
            del sys.modules[name]


@dataclass
class MetalTarget(GPUTarget):
    name: str = "metal"
    arch: str | None = "m1"
    device: str = "metal"
    # the device sampler computes in float64, which Metal has not: logits go to the host
    device_sampling: bool = False
    note: str = ("kernels are Metal Shading Language source, compiled by the Metal framework when the "
                 "library is loaded on the Mac; host code is arm64 macOS")

    ARCHS = tuple(ARCHS)

    def tvm_target(self):
        import tvm
        # Metal: 32-wide SIMD groups, 32 KiB threadgroup memory, 1024 threads, 31 buffer arguments.
        return tvm.target.Target(ARCHS[self.arch])

    def relax_pipeline(self):
        import tvm
        from tvm import relax
        default = relax.get_default_pipeline(self.tvm_target())

        @tvm.transform.module_pass(opt_level=0, name="KilnMetalPipeline")
        def pipeline(mod, _ctx):
            with _metal_intrinsics_only():
                return default(mod)
        return pipeline

    def export_library(self, executable, path: str) -> None:
        require_tools()
        executable.export_library(path, fcompile=link_macos_dylib)


def require_tools() -> None:
    if find_ld64() is None:
        raise KilnError("cannot link the macOS library: ld64.lld is missing "
                        "(Debian: apt-get install lld-22, or `make metal-deps`)")


TARGET_CLASS = MetalTarget


def make_target(arch: str | None) -> MetalTarget:
    target = MetalTarget(arch=arch or "m1")
    require_tools()            # fail before the import and codegen phases, not after
    return target
