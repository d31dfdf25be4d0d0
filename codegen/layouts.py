"""Weight layouts: how a parameter is stored in the artifact for the kernels that read it.

A layout is a short string; `apply_layout` turns a [out, in] array into it.
The same functions run at compile time (writing weights) and in tests.
"""
from __future__ import annotations

import numpy as np


PAIRS = "x2"       # suffix of a packed layout whose inputs are interleaved in pairs


def packed_block(layout: str) -> int | None:
    return int(layout[len("packed"):].removesuffix(PAIRS)) if layout.startswith("packed") else None


def input_pairs(layout: str) -> bool:
    return layout.startswith("packed") and layout.endswith(PAIRS)


def packed_index(layout: str, j, k):
    """The stored index of W[j, k] in a packed layout (j, k integers or TIR expressions)."""
    nb = packed_block(layout)
    if input_pairs(layout):
        return j // nb, k // 2, j % nb * 2 + k % 2
    return j // nb, k, j % nb


def stored_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    nb = packed_block(layout)
    if nb is None:
        return tuple(shape)
    *experts, n, k = shape
    return (*experts, n // nb, k // 2, 2 * nb) if input_pairs(layout) else (*experts, n // nb, k, nb)


def apply_layout(layout: str, arr: np.ndarray) -> np.ndarray:
    """'nk': unchanged. 'packedNB': W[n, k] -> Wp[n // NB, k, NB], NB output columns contiguous
    (experts [E, n, k] -> [E, n // NB, k, NB], each expert packed on its own). 'packedNBx2': the
    inputs in pairs, Wp[n // NB, k // 2, 2 NB] with W[j, k] at [j // NB, k // 2, 2 (j % NB) + k % 2]:
    the int16 pairs of vpmaddwd after one sign extension (q8 with int8 activations)."""
    nb = packed_block(layout)
    if nb is None:
        return arr
    *experts, n, k = arr.shape
    if input_pairs(layout):
        paired = arr.reshape(*experts, n // nb, nb, k // 2, 2).swapaxes(-3, -2)
        return np.ascontiguousarray(paired).reshape(*experts, n // nb, k // 2, 2 * nb)
    packed = arr.reshape(*experts, n // nb, nb, k).swapaxes(-1, -2)
    return np.ascontiguousarray(packed)
