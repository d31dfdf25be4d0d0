"""The runtime's one door to TVM: devices, the compiled module's VM, tensors, pinned host memory, the
CPU thread pool and the CPU's instruction sets (as LLVM, through TVM, names them). The rest of runtime/ asks this module for them and imports no TVM.

TVM is imported when a function here first runs, not when kiln.runtime is: a CUDA artifact's
runtime library must be loaded first (`enable_cuda_runtime`), and kiln's commands that run no
model start without TVM. Only TVM's runtime is used, never its compiler.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from kiln.cpu_features import LLVM_HOST_FEATURES, missing_features
from kiln.errors import KilnError

from .cuda_runtime import cudart_candidates

CUDA_HOST = 3          # DLPack's kDLCUDAHost: page-locked host memory


def enable_cuda_runtime() -> None:
    """Load TVM's CUDA runtime module when TVM's package did not (a runtime-only TVM does not)."""
    import tvm
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    from tvm.base import _LOADED_LIBS
    lib = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent / "libtvm_runtime_cuda.so"
    for cudart in cudart_candidates():
        try:
            ctypes.CDLL(cudart, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise KilnError(f"TVM's CUDA runtime cannot be loaded ({e})") from None


def missing_cpu_features(built_on: list[str]) -> list[str]:
    """The instruction sets an artifact's kernels use (its manifest's `cpu_features`) that this CPU
    lacks: by TVM's LLVM where TVM has its compiler, else by /proc/cpuinfo (kiln/cpu_features.py)."""
    import tvm
    reported = tvm.get_global_func(LLVM_HOST_FEATURES, allow_missing=True)
    return missing_features(built_on, dict(reported().items()) if reported is not None else None)


def device(kind: str):
    """TVM's device 0 of `kind` ("cpu", "cuda", "rocm", "metal")."""
    import tvm
    return tvm.device(kind, 0)


def load_vm(library: Path, on_device):
    """The compiled library's Relax VM, its functions run on `on_device`."""
    import tvm
    from tvm.runtime.vm import VirtualMachine
    return VirtualMachine(tvm.runtime.load_module(str(library)), on_device)


def library_function(library: Path, name: str):
    """The function `name` a compiled library exports (its linked objects' included)."""
    import tvm
    return tvm.runtime.load_module(str(library)).get_function(name, query_imports=True)


def host_tensor(array: np.ndarray):
    """A CPU tensor holding a copy of `array`."""
    import tvm
    return tvm.runtime.tensor(np.ascontiguousarray(array))


def empty(shape, dtype: str, on_device):
    """An uninitialised tensor on `on_device`."""
    import tvm
    return tvm.runtime.empty(tuple(shape), dtype, on_device)


def host_bytes(raw, copy: bool):
    """A CPU tensor over the bytes `raw` (a uint8 memoryview or array), shared without a copy unless
    `copy` (TVM takes only aligned memory as it is)."""
    import tvm
    return tvm.runtime.tensor(np.array(raw)) if copy else tvm.runtime.from_dlpack(raw)


def pinned_device(on_device):
    """The pinned host device for a CUDA device, or None where TVM has none (CPU, other GPUs)."""
    import tvm
    if on_device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        return None
    return tvm.device(CUDA_HOST, 0) if tvm.get_global_func("device_api.cuda_host", allow_missing=True) else None


def configure_threadpool(big_cores: int, threads: int) -> None:
    """TVM's CPU thread pool: `threads` workers (where this TVM can be told)."""
    import tvm
    configure = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if configure is not None:
        configure(big_cores, threads)
