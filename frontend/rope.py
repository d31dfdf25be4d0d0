"""Rotary embeddings: one table of the rope variants kiln imports, each a reference of its own.

Every variant gives the inverse frequencies f32[rotary_dim / 2] and `mscale`, the factor
transformers folds into cos and sin (YaRN's and LongRoPE's attention factor; 1 elsewhere).
    default    theta^(-2i/d)
    linear     default / factor
    llama3     Llama 3.1's band-wise smoothing between scaled and unscaled frequencies
    yarn       YaRN: interpolated below the correction range, extrapolated above it, a linear
               ramp between; mscale from factor (and DeepSeek's mscale / mscale_all_dim)
    longrope   default / per-frequency factors: `short_factor` while a sequence fits the
               original context (the only set kiln uses: see `context_limit`)
    dynamic    dynamic NTK: the default frequencies up to max_position_embeddings
Computed in float32 the way transformers does, from the config at compile time.
"""
from __future__ import annotations

import math

import numpy as np

from kiln.errors import KilnError


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default(dim, theta, scaling, max_pos):
    return (np.float32(1.0) / (np.float32(theta) ** _exponents(dim))).astype(np.float32), 1.0


def _linear(dim, theta, scaling, max_pos):
    freq, _ = _default(dim, theta, scaling, max_pos)
    return (freq / np.float32(scaling["factor"])).astype(np.float32), 1.0


def _llama3(dim, theta, scaling, max_pos):
    freq, _ = _default(dim, theta, scaling, max_pos)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, freq / factor, freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim, theta, scaling, max_pos):
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_pos / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
        else:
            mscale = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):     # the dimension that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated = 1 - ramp.astype(np.float32)             # 1: keep the original frequency
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv_extra, inv_inter = np.float32(1.0) / pos_freqs, np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_inter * (1 - extrapolated) + inv_extra * extrapolated).astype(np.float32), float(mscale)


def _longrope(dim, theta, scaling, max_pos):
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_pos / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(scaling["short_factor"], np.float32)
    return (np.float32(1.0) / (ext * np.float32(theta) ** _exponents(dim))).astype(np.float32), float(mscale)


ROPE_TYPES = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope,
              "dynamic": _default}
SUPPORTED_ROPE_TYPES = tuple(ROPE_TYPES)


def rope_kind(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_parameters(dim: int, theta: float, scaling: dict | None, max_pos: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies f32[dim / 2], mscale) of the config's rope variant."""
    kind = rope_kind(scaling)
    if kind not in ROPE_TYPES:
        raise KilnError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return ROPE_TYPES[kind](dim, theta, scaling, max_pos)


def inv_freq(dim: int, theta: float, scaling: dict | None, max_pos: int = 0) -> np.ndarray:
    return rope_parameters(dim, theta, scaling, max_pos)[0]


def context_limit(scaling: dict | None, max_pos: int) -> int:
    """The longest sequence the rope variant is exact for with fixed frequencies: LongRoPE switches
    to its long factors past the original context, and transformers then rotates every earlier key
    again with them (a KV cache cannot); dynamic NTK rescales past max_position_embeddings. kiln
    stops sequences there rather than give other logits."""
    kind = rope_kind(scaling)
    if kind == "longrope":
        return min(max_pos, scaling["original_max_position_embeddings"])
    return max_pos
