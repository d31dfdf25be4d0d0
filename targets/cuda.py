"""NVIDIA GPUs through TVM's CUDA codegen and nvcc; kernels scheduled by dlight.

The artifact holds a real fatbin compiled here with nvcc. TVM only calls nvcc
when its CUDA runtime module loads, which needs a libcuda.so.1; on a build
machine without a driver kiln loads a stub library (cuda_stub.c) first.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.selection.order import CUDA_KERNELS, KernelOrder

from .base import GPUTarget

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
FP8_ARCHS = ("sm_89", "sm_90", "sm_90a")      # Ada and Hopper convert float8 e4m3 in hardware


def ensure_cuda_loader() -> None:
    """Make TVM's CUDA runtime loadable so codegen produces a fatbin; must run before `import tvm`."""
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    out = Path(tempfile.gettempdir()) / f"kiln-cuda-stub-{os.getuid()}" / "libcuda.so.1"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = Path(__file__).with_name("cuda_stub.c")
        cmd = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src), "-Wl,-soname,libcuda.so.1"]
        try:
            subprocess.run(cmd, check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise KilnError(f"cannot build the CUDA loader stub with gcc: {e}") from None
    ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)


@dataclass
class CUDATarget(GPUTarget):
    name: str = "cuda"
    arch: str | None = "sm_80"
    device: str = "cuda"
    graph_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    kernels: KernelOrder = CUDA_KERNELS
    decode_mma_from: int = 16           # not yet measured: bench/gemm_gpu.py's table will say
    kv_dtypes: tuple[str, ...] = ("int8", "fp8")
    ARCHS = ARCHS

    def tvm_target(self):
        import tvm
        return tvm.target.Target({"kind": "cuda", "arch": self.arch, "max_shared_memory_per_block": 49152,
                                  "max_threads_per_block": 1024, "thread_warp_size": 32,
                                  "host": {"kind": "llvm"}})

    def pass_config(self):
        # RewriteCUDAGraph (in TVM's CUDA pipeline) captures the decode_graph entry (codegen/lower.py)
        return {"relax.backend.use_cuda_graph": bool(self.graph_batches)}

    def weight_quants(self):
        nibbles = ("q4", "q4a", "q4k")       # the mma GEMM and the GEMV read each (codegen/kernels/gpu)
        return ("q8", *nibbles, "fp8") if self.arch in FP8_ARCHS else ("q8", *nibbles)

    def build(self, mod):
        import tvm
        from tvm.support import nvcc  # noqa: F401  (registers the nvcc compile callback)
        if tvm.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
            raise KilnError("TVM's CUDA runtime did not load, so no CUDA binary can be built "
                            "(kiln compiles CUDA in a fresh process: use the `kiln compile` command)")
        return super().build(mod)


TARGET_CLASS = CUDATarget


def make_target(arch: str | None) -> CUDATarget:
    target = CUDATarget(arch=arch or "sm_80")
    ensure_cuda_loader()       # before TVM is imported: TVM calls nvcc only if its CUDA runtime loads
    return target
