"""Weight layouts: how a parameter is stored in the artifact for the kernels that read it.

A layout is a short string; `apply_layout` turns a [out, in] array into it.
The same functions run at compile time (writing weights) and in tests.
"""
from __future__ import annotations

import numpy as np


def packed_block(layout: str) -> int | None:
    return int(layout[len("packed"):]) if layout.startswith("packed") else None


def stored_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    nb = packed_block(layout)
    if nb is None:
        return tuple(shape)
    *experts, n, k = shape
    return (*experts, n // nb, k, nb)


def apply_layout(layout: str, arr: np.ndarray) -> np.ndarray:
    """'nk': unchanged. 'packedNB': W[n, k] -> Wp[n // NB, k, NB], NB output columns contiguous
    (experts [E, n, k] -> [E, n // NB, k, NB], each expert packed on its own)."""
    nb = packed_block(layout)
    if nb is None:
        return arr
    *experts, n, k = arr.shape
    packed = arr.reshape(*experts, n // nb, nb, k).swapaxes(-1, -2)
    return np.ascontiguousarray(packed)
