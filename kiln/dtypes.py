"""The NumPy dtype of each dtype name kiln writes (the IR's, the manifest's, the weights files'): a
leaf, so the runtime reads an artifact's tensors without the IR."""
from __future__ import annotations

import ml_dtypes
import numpy as np


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a dtype name (bfloat16 and the float8 formats through ml_dtypes)."""
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return np.dtype(getattr(ml_dtypes, dtype))
    return np.dtype(dtype)
