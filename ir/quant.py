"""Quantisation schemes as data: each is a NumPy quantiser and its exact dequantiser.

The IR op `linear_q8` and the weight recipes ({"quantize": scheme, "of": param, "part": ...})
refer to schemes here by name; the scheme's name travels in the artifact manifest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_dtype: str
    quantize: Callable[[np.ndarray], dict[str, np.ndarray]]       # W [out, in] -> parts
    dequantize: Callable[[dict[str, np.ndarray]], np.ndarray]     # parts -> float32 W


def _q8_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """Symmetric int8 per output channel: w ≈ q * scale[:, None], |q| <= 127."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return {"q": q, "scale": scale}


def _q8_dequantize(parts: dict[str, np.ndarray]) -> np.ndarray:
    return parts["q"].astype(np.float32) * parts["scale"][:, None]


SCHEMES = {"q8": Scheme("q8", "int8", _q8_quantize, _q8_dequantize)}
