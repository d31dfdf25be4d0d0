"""An ONNX graph's weights as kiln's linears want them: MatMul's [in, out] initializers transposed to [out, in],
and MatMulNBits' 4-bit blocks (ONNX Runtime's contrib op) kept as they are where a kiln format holds them.

MatMulNBits stores B [N, K / block, block / 2] (element 2j of a block in byte j's low nibble), one scale per
(output, block) and optionally a zero point per (output, block), packed two to a byte, low first; without zero
points every block's is 8. Its value is (nibble - zero point) · scale. Symmetric blocks (zero point 8) are kiln's
q4: the same nibbles (q4 stores level + 8) and the scales, kept in float32 where the compile stores them so (CPU
targets: ONNXModel.default_options), else rounded to float16. Blocks with zero points are q4a: level = nibble,
minimum = -zero point · scale, likewise. Anything else is dequantised and, where the compile quantises,
requantised (the source record says which)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kiln.errors import KilnError


@dataclass
class NBitsMatrix:
    """One MatMulNBits weight as the file stores it, and what became of it (`record`, shared per model)."""
    name: str                      # the node's B initializer
    packed: np.ndarray             # uint8 [N, K / block, block / 2]
    scales: np.ndarray             # float [N, K / block]
    zero_points: np.ndarray | None  # uint8 [N, K / block] unpacked, or None (all 8)
    block: int
    record: dict
    scale_dtype: str = "float16"   # what kiln stores its scales in (float32: as a file's float32 ones are)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * self.block

    @property
    def ndim(self) -> int:
        return 2

    @property
    def row_values(self) -> int:
        return self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, start: int, stop: int) -> NBitsMatrix:
        zp = None if self.zero_points is None else self.zero_points[start:stop]
        return replace(self, packed=self.packed[start:stop], scales=self.scales[start:stop], zero_points=zp)

    def nibbles(self) -> np.ndarray:
        """uint8 [N, K]: each element's 4-bit value, in order."""
        p = self.packed.reshape(self.packed.shape[0], -1)
        out = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
        out[:, 0::2], out[:, 1::2] = p & 15, p >> 4
        return out

    def dequantize(self, then: str = "") -> np.ndarray:
        zp = np.float32(8) if self.zero_points is None else self.zero_points.astype(np.float32)
        per_block = self.nibbles().astype(np.float32).reshape(self.shape[0], -1, self.block)
        values = (per_block - np.asarray(zp)[..., None]) * self.scales.astype(np.float32)[..., None]
        self.record[self.name, f"int4 blocks of {self.block} dequantised" + (f", {then}" if then else "")] = True
        return values.reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        values = self.dequantize("to float")
        return values if dtype is None else values.astype(dtype)

    def release(self) -> None:
        pass

    def exact_parts(self, scheme: str, group_size: int = 0) -> dict[str, np.ndarray] | None:
        """The nibbles as kiln's q4 (symmetric blocks) or q4a (blocks with zero points) in groups of the same
        size; None where `scheme` or the group size differ."""
        symmetric = self.zero_points is None or bool(np.all(self.zero_points == 8))
        if group_size != self.block or scheme != ("q4" if symmetric else "q4a"):
            return None
        p = self.packed.reshape(self.packed.shape[0], -1)
        scales, stored = self.scales.astype(np.float32), np.dtype(self.scale_dtype)
        if symmetric:
            parts = {"q": np.ascontiguousarray(p), "scale": np.ascontiguousarray(scales.T.astype(stored))}
        else:
            from kiln.ir.quant import q4a_scale_table
            minimum = -self.zero_points.astype(np.float32) * scales
            parts = {"q": np.ascontiguousarray(p), "scale": q4a_scale_table(scales, minimum, stored)}
        if stored == np.float32:
            kept = "exactly" if symmetric else "nibbles and scales exactly, minimums -zero point · scale in float32"
        elif symmetric:
            kept = "exactly" if self.scales.dtype == np.float16 else "nibbles exactly, scales rounded to float16"
        else:
            kept = "nibbles exactly, scales and minimums rounded to float16"
        self.record[self.name, f"int4 blocks of {self.block} kept {kept} ({scheme} in groups of {self.block})"] = True
        return parts


def check_nbits(file, node, attrs: dict) -> tuple[str, int, int, int]:
    """(kiln scheme that holds it exactly, N, K, block) of a MatMulNBits node, from its attributes and the
    initializers' shapes (nothing read yet); refused, naming the node, where kiln cannot read its blocks."""
    where = f"{file.path}: node {node.name!r} (MatMulNBits)"
    bits, block, k, n = attrs.get("bits", 4), attrs.get("block_size", 0), attrs.get("K", 0), attrs.get("N", 0)
    if bits != 4:
        raise KilnError(f"{where} has {bits}-bit blocks; kiln reads 4-bit ones")
    names = list(node.input) + [""] * 6
    if names[4] or names[5]:
        raise KilnError(f"{where} has {'g_idx' if names[4] else 'bias'}, which kiln does not read")
    if not block or k % block:
        raise KilnError(f"{where}: K={k} is not a multiple of its block size {block}")
    if any(name not in file.initializers for name in names[1:4] if name):
        raise KilnError(f"{where}: its blocks, scales and zero points must be initializers")
    blocks = k // block
    if file.shape(names[1]) != (n, blocks, block // 2):
        raise KilnError(f"{where}: B is {list(file.shape(names[1]))}, expected {[n, blocks, block // 2]}")
    if int(np.prod(file.shape(names[2]))) != n * blocks:
        raise KilnError(f"{where}: {int(np.prod(file.shape(names[2])))} scales for {n} × {blocks} blocks")
    if names[3] and file.initializers[names[3]].data_type != 2:       # TensorProto.UINT8
        raise KilnError(f"{where}: zero points that are not packed uint8 (kiln reads those)")
    return ("q4a" if names[3] else "q4"), n, k, block


def gathered_blocks(file, node, attrs: dict, data: str, shape: tuple[int, ...], record: dict) -> NBitsMatrix:
    """The table of a GatherBlockQuantized node (4-bit blocks along its rows, as MatMulNBits' B): `data` the
    initializer its packed rows come from, viewed as `shape` [rows, values / 2]."""
    names = list(node.input) + [""] * 4
    rows, width = shape
    block = int(attrs.get("block_size", 128))
    zero_points = None
    if names[3]:
        zp = file.array(names[3]).reshape(rows, -1)
        zero_points = np.stack([zp & 15, zp >> 4], axis=-1).reshape(rows, -1)[:, :2 * width // block]
    packed = file.array(data).reshape(rows, 2 * width // block, block // 2)
    return NBitsMatrix(data, packed, file.array(names[2]).reshape(rows, -1), zero_points, block, record)


def nbits_matrix(file, node, attrs: dict, record: dict, scale_dtype: str = "float16") -> NBitsMatrix:
    """The weight of a MatMulNBits node (check_nbits has passed it), its arrays read now; its scales to be stored
    in `scale_dtype`."""
    names = list(node.input) + [""] * 6
    _, n, k, block = check_nbits(file, node, attrs)
    blocks = k // block
    zero_points = None
    if names[3]:
        zp = file.array(names[3]).reshape(n, -1)
        zero_points = np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    return NBitsMatrix(names[1], file.array(names[1]), file.array(names[2]).reshape(n, blocks), zero_points, block,
                       record, scale_dtype)
