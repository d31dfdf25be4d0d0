"""Persistent device buffers for a step's small inputs (tokens, positions, page tables, slots).

Each input gets one device buffer, reused step after step: a step writes its array into the
front of the buffer and passes a view of that length (offset 0, so the address never changes).
On a GPU the array goes through a pinned host buffer (cudaMallocHost), from which the copy to the
device is a plain DMA. On the CPU numpy writes the buffer itself, and the views handed out are
kept by length (a decode step's inputs have the same lengths step after step): a step's inputs
then cost no call into TVM. A buffer grows (doubling) only when a step needs more; `fixed=True` buffers
never move, which a captured CUDA graph relies on: it replays the addresses it was captured with.

No upload waits for the GPU. TVM's copy from a numpy array synchronises the stream, so it would
wait for the step already running (and the one-step-ahead engine, runtime/overlap.py, would
launch nothing ahead). Instead numpy writes the pinned buffer itself and TVM's copy between
tensors, queued on the stream behind the running step, takes it to the device. Each input has
STAGING_SLOTS pinned buffers used in turn: a step's copy may still be queued when the host writes
the next step's inputs. That suffices because an input is put at most once a step and the engine
reads a step's results back before it launches the step after next.
"""
from __future__ import annotations

import ctypes

import numpy as np

from .tvm_bridge import empty, pinned_device

STAGING_SLOTS = 2


def host_array(tensor, count: int, dtype) -> np.ndarray:
    """A numpy array over the first `count` elements of a host tensor's memory (pinned or CPU):
    writing it is a plain store, with no call into TVM and no stream synchronisation."""
    nbytes = count * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(tensor.data_ptr()), dtype)


class StepBuffers:
    """One reusable device buffer (and its pinned staging buffers) per step input name."""

    def __init__(self, device, capacities: dict[str, int] | None = None, fixed: bool = False,
                 staging_device=None):
        """`staging_device`: where the staging buffers live; default the pinned host memory of a
        CUDA device, none elsewhere (a CPU's buffers take the array directly)."""
        self.device, self.fixed = device, fixed
        self.pinned = staging_device if staging_device is not None else pinned_device(device)
        self.buffers: dict[str, tuple] = {}        # name -> (device buffer, [(staging buffer, its bytes)] or None)
        self.turns: dict[str, int] = {}            # name -> puts so far, to pick its staging slot
        self.on_host = not self.pinned and device.dlpack_device_type() == 1     # kDLCPU: numpy writes it
        self.host: dict[str, np.ndarray] = {}      # name -> the CPU buffer's bytes, as numpy sees them
        self.views: dict[tuple, object] = {}       # (name, length, dtype) -> a view handed out before
        for name, capacity in (capacities or {}).items():
            self._allocate(name, capacity, "int32")

    def _allocate(self, name: str, capacity: int, dtype: str) -> None:
        """The device buffer, and its staging buffers each with a byte view numpy writes through
        (made once here: no per-step wrapping of the pinned memory)."""
        staging = None
        if self.pinned:
            slots = [empty((capacity,), dtype, self.pinned) for _ in range(STAGING_SLOTS)]
            staging = [(slot, host_array(slot, capacity * np.dtype(dtype).itemsize, np.uint8)) for slot in slots]
        self.buffers[name] = (empty((capacity,), dtype, self.device), staging)
        if self.on_host:
            self.host[name] = host_array(self.buffers[name][0], capacity * np.dtype(dtype).itemsize, np.uint8)
        self.views = {key: view for key, view in self.views.items() if key[0] != name}

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
        if self.on_host:
            self.host[name][:array.nbytes] = np.ascontiguousarray(array).view(np.uint8)
            key = (name, length, array.dtype)
            view = self.views.get(key)
            if view is None:
                view = self.views[key] = device_buffer._create_view((length,), str(array.dtype))
            return view
        if len(array):
            target = device_buffer._create_view((len(array),), str(array.dtype))
            if staging is None:
                target.copyfrom(array)
            else:
                turn = self.turns.get(name, 0)
                self.turns[name] = turn + 1
                slot, memory = staging[turn % STAGING_SLOTS]
                memory[:array.nbytes] = np.ascontiguousarray(array).view(np.uint8)
                target.copyfrom(slot._create_view((len(array),), str(array.dtype)))
        return device_buffer._create_view((length,), str(array.dtype))
