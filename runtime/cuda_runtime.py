"""The CUDA runtime library TVM's CUDA module links, found and called directly.

TVM's runtime exposes no events and no asynchronous copy to the host; runtime/launch.py takes them
from this library (the one TVM loaded: runtime/tvm_bridge.py's enable_cuda_runtime loads it first).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

from kiln.errors import KilnError

CUDART = "libcudart.so.13"


def cudart_candidates() -> list[str]:
    """Where the libcudart TVM's CUDA runtime links (the pinned wheel's: CUDA 13) may live: the
    loader's path first, then CUDA installs and NVIDIA's pip wheels. Another major version would
    load and leave TVM's library unresolved."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    found = [f for r in roots if r for pattern in ("lib*", "targets/*/lib")
             for f in sorted(glob.glob(f"{r}/{pattern}/{CUDART}*"))]
    for site in sys.path:
        found += sorted(glob.glob(f"{site}/nvidia/*/lib/{CUDART}*"))
    return [CUDART, *found]


DEVICE_TO_HOST, DEVICE_TO_DEVICE = 2, 3          # cudaMemcpyKind
DISABLE_TIMING = 2                               # cudaEventDisableTiming
LEGACY_STREAM = None                             # TVM's stream unless one is set: the legacy default


class CudaRuntime:
    """cudaMemcpyAsync and events on TVM's stream, through ctypes."""

    def __init__(self):
        for name in cudart_candidates():
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise KilnError(f"the CUDA runtime ({cudart_candidates()[0]}) cannot be loaded")
        v, size = ctypes.c_void_p, ctypes.c_size_t
        self._signatures({"cudaMemcpyAsync": (v, v, size, ctypes.c_int, v), "cudaEventRecord": (v, v),
                          "cudaEventCreateWithFlags": (ctypes.POINTER(v), ctypes.c_uint),
                          "cudaEventSynchronize": (v,)})

    def _signatures(self, table: dict) -> None:
        for name, argtypes in table.items():
            getattr(self.lib, name).argtypes = list(argtypes)
            getattr(self.lib, name).restype = ctypes.c_int

    def _check(self, code: int, what: str) -> None:
        if code:
            raise KilnError(f"CUDA {what} failed (cudaError {code})")

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, kind, LEGACY_STREAM), "cudaMemcpyAsync")

    def new_event(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(event), DISABLE_TIMING), "cudaEventCreate")
        return event

    def record(self, event) -> None:
        self._check(self.lib.cudaEventRecord(event, LEGACY_STREAM), "cudaEventRecord")

    def wait(self, event) -> None:
        self._check(self.lib.cudaEventSynchronize(event), "cudaEventSynchronize")
