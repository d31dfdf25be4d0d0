"""safetensors files written one tensor at a time, and read one tensor or one memory map at a time.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}}` with offsets relative to the data that
follows, then the data, with no holes. The `safetensors` package writes only from tensors held in
memory and reads through a map it keeps whole, so it can neither stream a model out nor say where a
tensor lies in the file; both are done here, and any safetensors reader can read what is written.

kiln aligns the data and every tensor in it to ALIGNMENT bytes, so that a memory map of the file can
be handed to TVM as it is (its kernels assume aligned buffers): the header is padded with spaces,
as the format allows, and each gap before a tensor is filled by a small uint8 tensor `__pad.N`.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kiln.dtypes import numpy_dtype
from kiln.errors import KilnError

ALIGNMENT = 64
PAD_PREFIX = "__pad."

# numpy dtype name -> safetensors dtype. float8 goes in as its bytes (U8) where a reader without
# float8 must read it back: the kiln manifest keeps the real dtype.
DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
          "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
NUMPY_NAMES = {st: name for name, st in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str                      # numpy name: float32, bfloat16, uint8, ...

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a file: absolute byte offsets `begin`..`end`."""
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _header(specs: list[TensorSpec], metadata: dict[str, str] | None,
            alignment: int) -> tuple[bytes, list[tuple[int, int]]]:
    """The padded header bytes (length prefix included) and each spec's (pad bytes before it, offset)."""
    entries: dict = {"__metadata__": {**({"alignment": str(alignment)} if alignment > 1 else {}),
                                      **(metadata or {})}}
    layout, offset = [], 0
    for i, spec in enumerate(specs):
        if spec.name.startswith(PAD_PREFIX) or spec.name == "__metadata__":
            raise KilnError(f"tensor name {spec.name!r} is reserved by the weights format")
        pad = -offset % alignment
        if pad:
            entries[f"{PAD_PREFIX}{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            offset += pad
        entries[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        layout.append((pad, offset))
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % max(alignment, 8))
    return struct.pack("<Q", len(text)) + text, layout


def write_safetensors(path: str | Path, specs: Iterable[TensorSpec], produce: Callable[[TensorSpec], np.ndarray],
                      metadata: dict[str, str] | None = None, hasher=None,
                      progress: Callable[[int, TensorSpec], None] | None = None, align: bool = True) -> None:
    """Write `path` holding `specs` in order, asking `produce(spec)` for each array only when its turn
    comes, so that one tensor is in memory at a time. `hasher` (hashlib-like) sees every byte written;
    `progress(i, spec)` is called before each tensor is produced. Without `align`, no padding tensor
    is written and the header is padded to 8 bytes only (a plain checkpoint, for tools that map
    every tensor name to a model weight)."""
    specs = list(specs)
    header, layout = _header(specs, metadata, ALIGNMENT if align else 1)
    with open(path, "wb") as f:
        f.write(header)
        if hasher is not None:
            hasher.update(header)
        for i, (spec, (pad, _)) in enumerate(zip(specs, layout)):
            if progress:
                progress(i, spec)
            arr = produce(spec)
            if tuple(arr.shape) != tuple(spec.shape) or arr.dtype != numpy_dtype(spec.dtype):
                raise KilnError(f"tensor {spec.name}: produced {arr.dtype}{list(arr.shape)}, "
                                f"the file declares {spec.dtype}{list(spec.shape)}")
            for chunk in (bytes(pad), np.ascontiguousarray(arr).reshape(-1).view(np.uint8)):
                f.write(chunk)
                if hasher is not None:
                    hasher.update(chunk)
            del arr


def read_header(path: str | Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of a safetensors file (absolute offsets, padding tensors left out) and its metadata."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} runs past the end of the file")
            raw = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise KilnError(f"{path}: cannot read safetensors header ({e})") from None
    metadata = raw.pop("__metadata__", None) or {}
    entries = {}
    for name, info in raw.items():
        if isinstance(info, dict) and info.get("dtype") not in NUMPY_NAMES:
            raise KilnError(f"{path}: tensor {name!r} has dtype {info.get('dtype')}, which kiln cannot read "
                            f"(it reads {', '.join(NUMPY_NAMES)})")
        try:
            begin, end = (8 + n + o for o in info["data_offsets"])
            dtype, shape = NUMPY_NAMES[info["dtype"]], tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise KilnError(f"{path}: tensor {name!r} has a malformed header entry ({e})") from None
        if not begin <= end <= size or end - begin != int(np.prod(shape, dtype=np.int64)) * numpy_dtype(dtype).itemsize:
            raise KilnError(f"{path}: tensor {name!r} does not fit its bytes {begin}..{end} of {size}")
        if not name.startswith(PAD_PREFIX):
            entries[name] = Entry(dtype, shape, begin, end)
    return entries, metadata


def read_tensor(path: str | Path, entry: Entry) -> np.ndarray:
    """One tensor read into a fresh array (no memory map is kept, so nothing stays resident)."""
    out = np.empty(entry.end - entry.begin, np.uint8)
    view, done = memoryview(out), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(entry.begin)
        while done < out.nbytes:                 # one read returns at most ~2 GiB
            n = f.readinto(view[done:])
            if not n:
                raise KilnError(f"{path}: file ends inside a tensor")
            done += n
    return out.view(numpy_dtype(entry.dtype)).reshape(entry.shape)


def map_file(path: str | Path):
    """A private, copy-on-write memory map of the whole file as a writable uint8 array: its pages are
    the page cache's until written, and nothing kiln does writes them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, np.uint8)
