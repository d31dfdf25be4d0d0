"""Weight layouts: how a parameter is stored in the artifact for the kernels that read it.

A layout is a short string; `apply_layout` turns a [out, in] array into it (a 'panelsNB' table of
group scales: a [groups, out] array). The same functions run at compile time (writing weights) and
in tests.
"""
from __future__ import annotations

import re

import numpy as np

_PACKED = re.compile(r"packed(\d+)(?:x(\d+))?$")
_PANELS = re.compile(r"panels(\d+)$")


def packed_layout(nb: int, interleave: int = 1) -> str:
    """'packedNB', or 'packedNBxF' with F stored inputs per column side by side."""
    return f"packed{nb}" + (f"x{interleave}" if interleave > 1 else "")


def packed_block(layout: str) -> int | None:
    found = _PACKED.match(layout)
    return int(found[1]) if found else None


def interleave(layout: str) -> int:
    """Stored inputs per column side by side: 1, 2 ('packedNBx2') or 4 ('packedNBx4')."""
    found = _PACKED.match(layout)
    return int(found[2] or 1) if found else 1


def packed_index(layout: str, j, k):
    """The stored index of W[j, k] in a packed layout (j, k integers or TIR expressions)."""
    nb, f = packed_block(layout), interleave(layout)
    if f > 1:
        return j // nb, k // f, j % nb * f + k % f
    return j // nb, k, j % nb


def in_byte_quads(layout: str, act_block: int) -> bool:
    """Whether a linear with int8 activations in blocks of `act_block` (0: none) and weights in
    `layout` runs the VNNI kernel (codegen/vnni_linear.py): weights in byte quads, 'packedNBx4'."""
    return act_block > 0 and packed_block(layout) is not None and interleave(layout) == 4


def q4_scale_layout(weight_layout: str, act_block: int) -> str:
    """Where q4 group scales are stored for the kernel that reads them: by weight panel for the
    VNNI kernel, [groups, out] elsewhere."""
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


def apply_layout(layout: str, arr: np.ndarray) -> np.ndarray:
    """'nk': unchanged. 'packedNB': W[n, k] -> Wp[n // NB, k, NB], NB output columns contiguous
    (experts [E, n, k] -> [E, n // NB, k, NB], each expert packed on its own). 'packedNBxF': F
    inputs of a column side by side, Wp[n // NB, k // F, F NB] with W[j, k] at
    [j // NB, k // F, F (j % NB) + k % F]: the int16 pairs of vpmaddwd after one sign extension
    (F = 2), the byte quads of vpdpbusd (F = 4)."""
    if panels_block(layout):
        groups, n = arr.shape
        return np.ascontiguousarray(arr.reshape(groups, n // panels_block(layout), -1).swapaxes(0, 1))
    nb, f = packed_block(layout), interleave(layout)
    if nb is None:
        return arr
    *experts, n, k = arr.shape
    grouped = arr.reshape(*experts, n // nb, nb, k // f, f).swapaxes(-3, -2)
    return np.ascontiguousarray(grouped).reshape(*experts, n // nb, k // f, f * nb)
