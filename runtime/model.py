"""Open an artifact and run its compiled `forward`: weights and KV pages on the device, logits back.

Uses only TVM's runtime (no compiler) and NumPy. A CPU artifact's weights are the memory map of its
weights file, handed to TVM without a copy; a GPU artifact's are uploaded from that map one tensor at
a time. The files' checksums are checked in a background thread while this happens.
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from pathlib import Path

import numpy as np

from kiln.artifact import WEIGHTS, read_manifest, start_verify
from kiln.errors import KilnError

DEVICES = ("cpu", "cuda", "rocm", "metal")


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1.5g' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise KilnError(f"cannot read a memory size from {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def _cudart_candidates() -> list[str]:
    """Where libcudart may live: the loader's path first, then CUDA installs and NVIDIA's pip wheels."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    found = [f for r in roots if r for pattern in ("lib*", "targets/*/lib")
             for f in sorted(glob.glob(f"{r}/{pattern}/libcudart.so*"))]
    for site in sys.path:
        found += sorted(glob.glob(f"{site}/nvidia/*/lib/libcudart.so*"))
    return ["libcudart.so.13", "libcudart.so.12", *found]


def enable_cuda_runtime() -> None:
    """Load TVM's CUDA runtime module when TVM's package did not (a runtime-only TVM does not)."""
    import tvm
    if tvm.get_global_func("device_api.cuda", allow_missing=True) is not None:
        return
    from tvm.base import _LOADED_LIBS
    lib = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent / "libtvm_runtime_cuda.so"
    for cudart in _cudart_candidates():
        try:
            ctypes.CDLL(cudart, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise KilnError(f"TVM's CUDA runtime cannot be loaded ({e})") from None


class CompiledModel:
    """The compiled forward of one artifact, with its weights loaded on the device."""

    def __init__(self, artifact_dir: str | Path, verify: bool = True):
        import tvm
        from tvm.runtime.vm import VirtualMachine
        self.dir = Path(artifact_dir)
        self.manifest = m = read_manifest(self.dir, verify=False)
        verified = start_verify(self.dir, m) if verify else (lambda: None)
        device = m["target"]["device"]
        if device not in DEVICES:
            raise KilnError(f"artifact targets device {device!r}, which this runtime cannot drive")
        if device == "cuda":
            enable_cuda_runtime()
        self.device = tvm.device(device, 0)
        if not self.device.exist:
            raise KilnError(f"artifact is built for {m['target']['name']} ({m['target'].get('arch')}), "
                            f"but this machine has no {device} device")
        self.kv = m["kv"]
        self.page_size = self.kv["page_size"]
        self.vocab_size = m["vocab_size"]
        self.max_context = m["max_context"]
        lib = tvm.runtime.load_module(str(self.dir / m["library"]))
        self.vm = VirtualMachine(lib, self.device)
        self.forward_fn = self.vm[m["entry"]]
        self.weights = self._load_weights()
        verified()
        self.kv_tensors: dict = {}         # kv_pages{i} (and kv_scales{i} for a quantised cache)
        self.input_names = m["inputs"]

    def _load_weights(self) -> list:
        """The weights in argument order: views of the file's memory map on the CPU, uploads from it
        elsewhere. A tensor at an offset TVM cannot take as it is (artifacts written before weights
        were aligned) is copied instead."""
        import tvm
        from kiln.safetensors_io import ALIGNMENT, map_file, read_header
        path = self.dir / WEIGHTS
        entries, _ = read_header(path)
        mapped = map_file(path)
        on_host = self.maps_weights()
        tensors = []
        for w in self.manifest["weights"]:
            entry = entries.get(w["name"])
            if entry is None:
                raise KilnError(f"weight {w['name']} named in the manifest is not in {WEIGHTS}")
            float8_as_bytes = entry.dtype == "uint8" and w["dtype"].startswith("float8")
            if list(entry.shape) != w["shape"] or not (entry.dtype == w["dtype"] or float8_as_bytes):
                raise KilnError(f"weight {w['name']} is {entry.dtype}{list(entry.shape)} in {WEIGHTS}, "
                                f"the manifest says {w['dtype']}{w['shape']}")
            raw = mapped[entry.begin:entry.end]
            whole = tvm.runtime.tensor(np.array(raw)) if entry.begin % ALIGNMENT else tvm.runtime.from_dlpack(raw)
            host = whole._create_view(tuple(w["shape"]), w["dtype"])        # the view keeps `whole`'s bytes
            if on_host:
                tensors.append(host)
            else:
                tensors.append(tvm.runtime.empty(tuple(w["shape"]), w["dtype"], self.device))
                tensors[-1].copyfrom(host)
        return tensors

    def maps_weights(self) -> bool:
        """Whether the kernels read the weights where the file's memory map has them: the device is
        the host. Elsewhere each tensor is uploaded from the map."""
        return self.manifest["target"]["device"] == "cpu"

    @property
    def bytes_per_page(self) -> int:
        """KV bytes of one page over all layers: the rows, plus a float32 scale per row when quantised."""
        import tvm
        kv = self.kv
        rows = kv["num_layers"] * 2 * kv["num_kv_heads"] * self.page_size
        row_bytes = kv["head_dim"] * tvm.runtime.DataType(kv["dtype"]).bits // 8
        return rows * (row_bytes + (4 if kv.get("row_scales") else 0))

    def allocate_kv(self, kv_memory_bytes: int) -> int:
        """Allocate the KV page tensors (one per layer) within the budget; return the page count."""
        import tvm
        num_pages = kv_memory_bytes // self.bytes_per_page
        if num_pages < 1:
            raise KilnError(f"KV memory budget {kv_memory_bytes} bytes is below one page "
                            f"({self.bytes_per_page} bytes)")
        kv = self.kv
        shape = (num_pages, 2, kv["num_kv_heads"], self.page_size, kv["head_dim"])
        self.kv_tensors = {}
        for i in range(kv["num_layers"]):
            self.kv_tensors[f"kv_pages{i}"] = tvm.runtime.empty(shape, kv["dtype"], self.device)
            if kv.get("row_scales"):
                self.kv_tensors[f"kv_scales{i}"] = tvm.runtime.empty(shape[:4], "float32", self.device)
        return num_pages

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV pages (every layer, k and v, and row scales) from source to destination
        page: the copy-on-write of a shared page, done on the device through views."""
        for tensor in self.kv_tensors.values():
            page_shape = tuple(tensor.shape[1:])
            page_bytes = int(np.prod(page_shape)) * tensor.dtype.itemsize
            for src, dst in pairs:
                view = tensor._create_view((1, *page_shape), relative_byte_offset=dst * page_bytes)
                view.copyfrom(tensor._create_view((1, *page_shape), relative_byte_offset=src * page_bytes))

    def forward(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run one ragged step; return f32[seqs, vocab], the logits of each sequence's last new token."""
        import tvm
        if not self.kv_tensors:
            raise KilnError("allocate_kv must be called before forward")
        args = [self.kv_tensors[n] if n in self.kv_tensors else tvm.runtime.tensor(inputs[n], self.device)
                for n in self.input_names]
        out = self.forward_fn(*args, *self.weights)
        return out.numpy()
