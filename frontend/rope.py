"""Rotary-embedding inverse frequencies, with the rope_scaling variants kiln supports."""
from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """f32[head_dim / 2], computed in float32 the way transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return freq
    if kind == "linear":
        return (freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = (2 * math.pi / freq).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, freq / factor, freq).astype(np.float32)
        smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise KilnError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
