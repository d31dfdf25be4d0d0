"""Weight layouts: how a parameter is stored in the artifact for the kernel chosen to read it.

A layout is a short string; `apply_layout` turns a [out, in] array into it (a 'panelsNB' table of
group scales: a [groups, out] array). The kernel records (selection/linear.py) read layouts to say
what they take, codegen's kernels index them, and compile (writing weights) and tests apply them.
"""
from __future__ import annotations

import re

import numpy as np

_PACKED = re.compile(r"packed(\d+)(?:x(\d+))?(?:n(\d+))?$")
_PANELS = re.compile(r"panels(\d+)$")


def packed_layout(nb: int, interleave: int = 1, nibble_span: int = 0) -> str:
    """'packedNB', or 'packedNBxF' with F stored inputs per column side by side; a suffix 'nS' on
    an array of q4 bytes pairs its nibbles S inputs apart (see `nibble_of`)."""
    return f"packed{nb}" + (f"x{interleave}" if interleave > 1 else "") + (f"n{nibble_span}" if nibble_span else "")


def packed_block(layout: str) -> int | None:
    found = _PACKED.match(layout)
    return int(found[1]) if found else None


def interleave(layout: str) -> int:
    """Stored inputs per column side by side: 1, 2 ('packedNBx2') or 4 ('packedNBx4')."""
    found = _PACKED.match(layout)
    return int(found[2] or 1) if found else 1


def nibble_span(layout: str) -> int:
    """How far apart the two inputs of a stored q4 byte are: 0 for neighbours (k, k + 1), S for
    'packed...nS' (k and k + S, of two consecutive runs of S inputs)."""
    found = _PACKED.match(layout)
    return int(found[3] or 0) if found else 0


def nibble_of(k, span: int):
    """(byte, high nibble?) of input k among a row's q4 bytes: neighbours share a byte (span 0), or
    input i of each run of 2S sits in byte S·(k // 2S) + i % S, the second run in high nibbles."""
    if not span:
        return k // 2, k % 2
    return k // (2 * span) * span + k % span, k % (2 * span) // span


def packed_index(layout: str, j, k):
    """The stored index of W[j, k] in a packed layout (j, k integers or TIR expressions)."""
    nb, f = packed_block(layout), interleave(layout)
    if f > 1:
        return j // nb, k // f, j % nb * f + k % f
    return j // nb, k, j % nb


def in_byte_quads(layout: str, act_block: int) -> bool:
    """Whether a linear with int8 activations in blocks of `act_block` (0: none) and weights in
    `layout` runs the VNNI kernel (codegen/kernels/cpu/vnni_linear.py): weights in byte quads, 'packedNBx4'."""
    return act_block > 0 and packed_block(layout) is not None and interleave(layout) == 4


def group_scale_layout(weight_layout: str, act_block: int) -> str:
    """Where q4's and q8g's group scales are stored for the kernel that reads them: by weight panel for
    the VNNI kernel, [groups, out] elsewhere."""
    return panels_layout(packed_block(weight_layout)) if in_byte_quads(weight_layout, act_block) else "nk"


def panels_layout(nb: int) -> str:
    """'panelsNB': group scales [groups, out] stored by weight panel, [out / NB, groups, NB], so the
    scales of the NB columns a kernel task reads lie in one run beside its weights' run."""
    return f"panels{nb}"


def panels_block(layout: str) -> int | None:
    found = _PANELS.match(layout)
    return int(found[1]) if found else None


class PanelScales:
    """A 'panelsNB' table read as [group, column], as the kernels that take 'nk' scales index it."""

    def __init__(self, table, nb: int):
        self.table, self.nb = table, nb

    def __getitem__(self, index):
        group, column = index
        return self.table[column // self.nb, group, column % self.nb]


def group_scales(table, layout: str):
    """The scale table as [group, column], whichever way it is stored."""
    nb = panels_block(layout)
    return PanelScales(table, nb) if nb else table


def stored_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if panels_block(layout):
        groups, n = shape
        return (n // panels_block(layout), groups, panels_block(layout))
    nb, f = packed_block(layout), interleave(layout)
    if nb is None:
        return tuple(shape)
    *experts, n, k = shape
    return (*experts, n // nb, k // f, f * nb)


GATED, GATED_COLUMNS = "gated", "gatedcols"
# q4 scales again as CUTLASS's zeros (the Hopper GEMM, codegen/kernels/gpu/hopper_gemm.cu): -8 x scale,
# exact in float16, so level x scale + zero is kiln's (nibble - 8) x scale; a gated gate/up's in the
# order of its scales' columns ('gatedcols')
Q4_ZEROS, Q4_ZEROS_GATED = "q4zeros", "q4zerosgated"


def apply_layout(layout: str, arr: np.ndarray) -> np.ndarray:
    """'nk': unchanged. 'packedNB': W[n, k] -> Wp[n // NB, k, NB], NB output columns contiguous
    (experts [E, n, k] -> [E, n // NB, k, NB], each expert packed on its own). 'packedNBxF': F
    inputs of a column side by side, Wp[n // NB, k // F, F NB] with W[j, k] at
    [j // NB, k // F, F (j % NB) + k % F]: the int16 pairs of vpmaddwd after one sign extension
    (F = 2), the byte quads of vpdpbusd (F = 4). 'nS' first re-pairs the nibbles of q4 bytes (two
    neighbouring inputs a byte, the even one low) S inputs apart. 'gated' / 'gatedcols': a gated
    MLP's gate and up halves interleaved, by row of the weight / by column of its scales. 'q4zeros':
    q4 scales times -8 (Q4_ZEROS); 'q4zerosgated': the same of 'gatedcols' scales."""
    if layout == Q4_ZEROS_GATED:
        return apply_layout(Q4_ZEROS, apply_layout(GATED_COLUMNS, arr))
    if layout == Q4_ZEROS:
        return (arr * np.asarray(-8, arr.dtype)).astype(arr.dtype)
    if layout in (GATED, GATED_COLUMNS):
        # a gated MLP's gate/up rows [.., 2F, K] (or their scales' columns [.., 2F]) interleaved:
        # gate 0, up 0, gate 1, ..., so one thread's two neighbouring outputs are a pair (codegen/kernels/gpu/mma_gemm.py)
        axis = arr.ndim - (2 if layout == GATED else 1)
        halves = arr.reshape(*arr.shape[:axis], 2, arr.shape[axis] // 2, *arr.shape[axis + 1:])
        return np.ascontiguousarray(np.swapaxes(halves, axis, axis + 1)).reshape(arr.shape)
    if panels_block(layout):
        groups, n = arr.shape
        return np.ascontiguousarray(arr.reshape(groups, n // panels_block(layout), -1).swapaxes(0, 1))
    nb, f, span = packed_block(layout), interleave(layout), nibble_span(layout)
    if nb is None:
        return arr
    if span:
        arr = _pair_nibbles(arr, span)
    *experts, n, k = arr.shape
    grouped = arr.reshape(*experts, n // nb, nb, k // f, f).swapaxes(-3, -2)
    return np.ascontiguousarray(grouped).reshape(*experts, n // nb, k // f, f * nb)


def _pair_nibbles(arr: np.ndarray, span: int) -> np.ndarray:
    """q4 bytes [..., k / 2] of neighbouring inputs -> bytes holding inputs S apart (`nibble_of`):
    in each run of S bytes, the first half's bytes hold the run's low inputs, the second half's
    the high ones; byte 2t takes the low nibbles of bytes t of both halves, byte 2t + 1 the high."""
    runs = arr.reshape(*arr.shape[:-1], -1, 2, span // 2)
    first, second = runs[..., 0, :], runs[..., 1, :]
    paired = np.empty(runs.shape[:-2] + (span // 2, 2), np.uint8)
    paired[..., 0] = (first & 15) | (second << 4)
    paired[..., 1] = (first >> 4) | (second & 0xF0)
    return paired.reshape(arr.shape)
