"""Persistent device buffers for a step's small inputs (tokens, positions, page tables, slots).

Each input gets one device buffer, reused step after step: a step writes its array into the
front of the buffer and passes a view of that length (offset 0, so the address never changes).
On a GPU the array goes through a pinned host buffer (cudaMallocHost), from which the copy to the
device is a plain DMA. A buffer grows (doubling) only when a step needs more; `fixed=True` buffers
never move, which a captured CUDA graph relies on: it replays the addresses it was captured with.
"""
from __future__ import annotations

import numpy as np

CUDA_HOST = 3          # DLPack's kDLCUDAHost: page-locked host memory


def pinned_device(device):
    """The pinned host device for a CUDA device, or None where TVM has none (CPU, other GPUs)."""
    import tvm
    if device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        return None
    return tvm.device(CUDA_HOST, 0) if tvm.get_global_func("device_api.cuda_host", allow_missing=True) else None


class StepBuffers:
    """One reusable device buffer (and pinned staging buffer) per step input name."""

    def __init__(self, device, capacities: dict[str, int] | None = None, fixed: bool = False):
        self.device, self.fixed = device, fixed
        self.pinned = pinned_device(device)
        self.buffers: dict[str, tuple] = {}        # name -> (device buffer, staging buffer or None)
        for name, capacity in (capacities or {}).items():
            self._allocate(name, capacity, "int32")

    def _allocate(self, name: str, capacity: int, dtype: str) -> None:
        import tvm
        staging = tvm.runtime.empty((capacity,), dtype, self.pinned) if self.pinned else None
        self.buffers[name] = (tvm.runtime.empty((capacity,), dtype, self.device), staging)

    def capacity(self, name: str) -> int:
        return int(self.buffers[name][0].shape[0]) if name in self.buffers else 0

    def put(self, name: str, array: np.ndarray, length: int | None = None):
        """Write `array` (1-D) into the buffer of `name`; return a device view of `length` elements
        (default: the array's). Elements past the array keep what they held."""
        length = len(array) if length is None else length
        need = max(length, len(array), 1)
        if self.capacity(name) < need:
            if self.fixed and name in self.buffers:
                raise ValueError(f"step input {name} needs {need} elements; its fixed buffer holds "
                                 f"{self.capacity(name)}")
            self._allocate(name, max(need, 2 * self.capacity(name)), str(array.dtype))
        device_buffer, staging = self.buffers[name]
        if len(array):
            source = array
            if staging is not None:
                staged = staging._create_view((len(array),), str(array.dtype))
                staged.copyfrom(array)
                source = staged
            device_buffer._create_view((len(array),), str(array.dtype)).copyfrom(source)
        return device_buffer._create_view((length,), str(array.dtype))
