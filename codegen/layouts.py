"""Weight layouts: how a parameter is stored in the artifact for the kernels that read it.

A layout is a short string; `apply_layout` turns a [out, in] array into it.
The same functions run at compile time (writing weights) and in tests.
"""
from __future__ import annotations

import re

import numpy as np

_PACKED = re.compile(r"packed(\d+)(?:x(\d+))?$")


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


def stored_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
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
    nb, f = packed_block(layout), interleave(layout)
    if nb is None:
        return arr
    *experts, n, k = arr.shape
    grouped = arr.reshape(*experts, n // nb, nb, k // f, f).swapaxes(-3, -2)
    return np.ascontiguousarray(grouped).reshape(*experts, n // nb, k // f, f * nb)
