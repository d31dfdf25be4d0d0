"""Open a GGUF model (one file, a directory holding one, or split files `-00001-of-0000N.gguf`): its
metadata as Python values and its tensors by name, as views of the mapped files (nothing is read until
a tensor is used).

The header is parsed here, by the layout llama.cpp's GGUF specification gives, rather than by gguf-py's
GGUFReader: that reader makes a NumPy view of every string of the vocabulary and takes ~15 s to open a
Llama 3 file (128k tokens, 280k merges); this takes about a second. gguf-py still names the tensor
types and their block sizes, and dequantises (frontend/gguf_tensors.py). A file that ends before its
tensors do, names a type gguf-py does not know, or is no GGUF file is refused here with its name."""
from __future__ import annotations

import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAGIC = b"GGUF"
VERSIONS = (2, 3)
# metadata value types: the fixed-size ones by their NumPy type; 8 is a string, 9 an array
SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
           12: "<f8"}
STRING, ARRAY, BOOL = 8, 9, 7


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF model: a .gguf file, or a directory with one and no config.json."""
    path = Path(path)
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def _first_file(path: Path) -> Path:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.gguf")
                       if not SPLIT.match(p.name) or SPLIT.match(p.name)["no"] == "00001")
        if len(files) != 1:
            raise KilnError(f"{path}: holds {len(files)} GGUF models ({', '.join(p.name for p in files)}); "
                            "name the file to compile")
        return files[0]
    if not path.exists():
        raise KilnError(f"{path} does not exist")
    return path


def shard_files(path: Path) -> list[Path]:
    """The files of the model `path` names: itself, or all N shards of a split model (any shard named)."""
    first = _first_file(path)
    m = SPLIT.match(first.name)
    if not m:
        return [first]
    count = int(m["count"])
    files = [first.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise KilnError(f"{first}: split model lacks {', '.join(missing)}")
    return files


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: object                  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]         # in NumPy order ([out, in] for a matrix)
    data: np.ndarray               # floats as stored, or a quantised type's blocks: uint8 [..., rows, bytes]
    span: tuple[object, int, int] | None = None     # (the file's mmap, first byte, bytes) for release()

    def release(self) -> None:
        """Drop this tensor's pages from the process (a compile reads each once: the mapped file would
        otherwise stay resident whole until the end). Reading it again pages it back in from the file."""
        if self.span is None:
            return
        mapping, begin, nbytes = self.span
        first = begin // mmap.PAGESIZE * mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, first, begin + nbytes - first)

    @property
    def type_name(self) -> str:
        return self.qtype.name


class _Header:
    """A cursor over one mapped file's header."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.blob = np.frombuffer(self.mapping, np.uint8)
        except (OSError, ValueError) as e:
            raise KilnError(f"{path}: cannot be read ({e})") from None
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.blob):
            raise KilnError(f"{self.path}: not a readable GGUF file, truncated or corrupt (its header runs past "
                            f"the end of the file at byte {len(self.blob)})")
        part = self.blob[self.pos:self.pos + n]
        self.pos += n
        return part

    def scalar(self, kind: int):
        dtype = np.dtype(SCALARS[kind])
        value = self.take(dtype.itemsize).view(dtype)[0].item()
        return bool(value) if kind == BOOL else value

    def string(self) -> str:
        return bytes(self.take(self.scalar(10))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.scalar(4), self.scalar(10)
            if item == STRING:
                return [self.string() for _ in range(count)]
            if item not in SCALARS:
                raise KilnError(f"{self.path}: metadata array of unknown type {item}: not a GGUF file kiln reads")
            dtype = np.dtype(SCALARS[item])
            values = self.take(count * dtype.itemsize).view(dtype).tolist()
            return [bool(v) for v in values] if item == BOOL else values
        if kind not in SCALARS:
            raise KilnError(f"{self.path}: metadata value of unknown type {kind}: not a GGUF file kiln reads")
        return self.scalar(kind)


def _read(path: Path) -> tuple[dict, dict[str, Tensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    h = _Header(path)
    if bytes(h.take(4)) != MAGIC:
        raise KilnError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    version = h.scalar(4)
    if version not in VERSIONS:
        raise KilnError(f"{path}: GGUF version {version} (kiln reads versions {', '.join(map(str, VERSIONS))})")
    tensor_count, kv_count = h.scalar(10), h.scalar(10)
    metadata = {}
    for _ in range(kv_count):
        key = h.string()
        metadata[key] = h.value(h.scalar(4))
    infos = []
    for _ in range(tensor_count):
        name = h.string()
        dims = [h.scalar(10) for _ in range(h.scalar(4))]
        infos.append((name, dims, h.scalar(4), h.scalar(10)))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-h.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise KilnError(f"{path}: tensor {name!r} has type id {type_id}, which gguf does not know") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        if dims[0] % block:
            raise KilnError(f"{path}: tensor {name!r} has rows of {dims[0]}, not a multiple of {qtype.name}'s "
                            f"blocks of {block}")
        row_bytes = dims[0] // block * type_size
        nbytes = row_bytes * int(np.prod(dims[1:], dtype=np.int64))
        begin = start + offset
        if begin + nbytes > len(h.blob):
            raise KilnError(f"{path}: truncated: tensor {name!r} ends at byte {begin + nbytes}, the file at "
                            f"{len(h.blob)}")
        data = h.blob[begin:begin + nbytes].reshape(*shape[:-1], row_bytes)
        if qtype.name in ("F32", "F16", "BF16"):
            data = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype.name])
        tensors[name] = Tensor(name, qtype, shape, data, (h.mapping, begin, nbytes))
    return metadata, tensors


@dataclass
class GGUFFile:
    """A GGUF model's metadata (from the first file) and tensors (from every shard)."""
    path: Path                      # the first (or only) file
    metadata: dict
    tensors: dict[str, Tensor]
    size: int                       # bytes of every file

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


def read_metadata(path: str | Path) -> dict:
    """One GGUF file's metadata (also a vocabulary-only file's)."""
    return _read(Path(path))[0]


def open_gguf(path: str | Path) -> GGUFFile:
    files = shard_files(Path(path))
    metadata, tensors = _read(files[0])
    for f in files[1:]:
        for name, t in _read(f)[1].items():
            if name in tensors:
                raise KilnError(f"{f}: tensor {name!r} appears twice in the model")
            tensors[name] = t
    if not tensors:
        raise KilnError(f"{files[0]}: holds no tensors (a vocabulary-only GGUF file?)")
    return GGUFFile(files[0], metadata, tensors, sum(f.stat().st_size for f in files))
