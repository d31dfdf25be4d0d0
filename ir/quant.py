"""Quantisation schemes as data: each is a NumPy quantiser and its exact dequantiser.

The `format` attribute of the IR's linear, embed and moe_experts and the weight recipes ({"quantize": scheme, "of": param, "part": ...})
refer to schemes here by name; the scheme's name travels in the artifact manifest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from .types import numpy_dtype


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_dtype: str
    quantize: Callable[..., dict[str, np.ndarray]]                # (W [out, in], **options) -> parts
    dequantize: Callable[..., np.ndarray]                          # (parts, **options) -> float32 W
    scale_dtype: str = "float32"
    grouped: bool = False          # scales per group of inputs, stored [in / group, out]
    per_byte: int = 1              # levels a stored byte holds (q4: two 4-bit values)
    scale_rows: int = 1            # rows of the scale table per group (q4a: its scale, then its minimum)
    weighted: bool = False         # quantize takes importance= (one weight per input, from calibration)
    super_block: int = 0           # inputs per super-block whose own rows follow its groups' (q4k: 256)
    super_rows: int = 0            # those rows (q4k: two float16 factors, as bytes)

    def output_axis(self, part: str) -> int:
        """The axis of a stored part that runs over output features (grouped scales are [in / group, out])."""
        return 1 if self.grouped and part == "scale" else 0

    def table_rows(self, in_features: int, group_size: int) -> int:
        """Rows of a grouped scheme's scale table for `in_features` inputs."""
        supers = in_features // self.super_block * self.super_rows if self.super_block else 0
        return in_features // group_size * self.scale_rows + supers

    def holds(self, in_features: int, group_size: int) -> bool:
        """Whether this scheme's groups (and super-blocks) divide `in_features` inputs."""
        return in_features % max(group_size, self.super_block) == 0 if self.grouped else True

    def part_shapes(self, out_features: int, in_features: int, group_size: int = 0) -> dict[str, tuple]:
        q = (out_features, in_features // self.per_byte)
        if self.grouped:
            return {"q": q, "scale": (self.table_rows(in_features, group_size), out_features)}
        return {"q": q, "scale": (out_features,)}


def _q8_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """Symmetric int8 per output channel: w ≈ q * scale[:, None], |q| <= 127."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return {"q": q, "scale": scale}


def _q8_dequantize(parts: dict[str, np.ndarray]) -> np.ndarray:
    return parts["q"].astype(np.float32) * parts["scale"][:, None]


def _q8g_quantize(w: np.ndarray, group_size: int = 32) -> dict[str, np.ndarray]:
    """Symmetric int8 in groups of `group_size` inputs with a float16 scale each: GGUF's Q8_0 layout for
    groups of 32. The scale is float16(amax / 127), as llama.cpp's; the levels are rint(w / scale) with
    the scale as stored (clipped to ±127; 0 where it is 0), so each is the nearest to w of the values the
    format can hold, and ties go to even. (llama.cpp rounds w · 127 / amax half away from zero: on weights
    dequantised from another 4-bit format, whose values fall on half-levels in whole runs, that biases
    every tie outwards, and measured +0.5 % perplexity on SmolLM2's Q4_1 file.) Scales [in / group, out]."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    scale = (np.abs(groups).max(axis=-1) / np.float32(127)).astype(np.float16)
    wide = scale.astype(np.float32)[..., None]
    safe = np.where(wide == 0, np.float32(1), wide)
    q = np.where(wide == 0, np.float32(0), np.clip(np.rint(groups / safe), -127, 127))
    return {"q": q.astype(np.int8).reshape(n, k), "scale": np.ascontiguousarray(scale.T)}


def _q8g_dequantize(parts: dict[str, np.ndarray], group_size: int = 32) -> np.ndarray:
    return parts["q"].astype(np.float32) * np.repeat(parts["scale"].T.astype(np.float32), group_size, axis=1)


Q4_CANDIDATES = np.array([-(8 + 0.1 * i) for i in range(-9, 10)], np.float32)   # levels the peak is tried at


def _q4_quantize(w: np.ndarray, group_size: int = 32, importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """int4 in groups of `group_size` along the input axis, one float16 scale per group, q in [-8, 7].

    The scale is fitted, not taken from the peak alone: for each of the 19 Q4_CANDIDATES c (the peak
    mapped to level c, from -7.1 to -8.9), levels l = clip(rint(w · (c / peak)), -8, 7), then the
    least-squares scale for those levels, Σ u·l·w / Σ u·l², rounded to float32 then float16; the
    weights are re-levelled with it (0 where it is 0) and the first candidate with the least
    Σ u·(l·scale - w)² is kept. u is `importance` (one per input, the mean square of that input over
    calibration text: errors on inputs that are large cost more), 1 without it. Sums run in float64
    in order along the group. The peak is the group's first largest-magnitude value (1 if all are
    zero). Judged by a real model's perplexity, fitting beats both the peak's own scale (llama.cpp's
    Q4_0) and a search minimising unweighted error over shrunken peaks (docs/BENCHMARKS.md).
    q + 8 is stored in a nibble, two per byte along the input axis (even k in the low nibble); scales
    are stored [in / group, out] so that a kernel reading consecutive outputs reads consecutive scales.
    This is the reference; compile runs the same rule as a TVM kernel (codegen/quantizers.py), which
    tests hold to these exact bytes."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    u = (np.ones(k, np.float64) if importance is None else np.asarray(importance, np.float32).astype(np.float64))
    u = u.reshape(k // group_size, group_size)
    idx = np.abs(groups).argmax(axis=-1)
    peak = np.take_along_axis(groups, idx[..., None], axis=-1)[..., 0]
    peak = np.where(peak == 0, np.float32(1), peak)
    best_err = np.full(peak.shape, np.inf)
    best_scale = np.zeros(peak.shape, np.float32)
    for c in Q4_CANDIDATES:
        inverse = c / peak
        levels = np.clip(np.rint(groups * inverse[..., None]), -8, 7).astype(np.float64)
        num, den = np.zeros(peak.shape), np.zeros(peak.shape)
        for i in range(group_size):
            num += u[:, i] * levels[..., i] * groups[..., i]
            den += u[:, i] * levels[..., i] * levels[..., i]
        fitted = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
        scale = fitted.astype(np.float32).astype(np.float16).astype(np.float32)
        levels = _q4_levels(groups, scale)
        err = np.zeros(peak.shape)
        for i in range(group_size):
            err += u[:, i] * (levels[..., i] * scale - groups[..., i]).astype(np.float64) ** 2
        better = err < best_err
        best_err, best_scale = np.where(better, err, best_err), np.where(better, scale, best_scale)
    q = _q4_levels(groups, best_scale).astype(np.int8).reshape(n, k)
    nibbles = (q + 8).astype(np.uint8)
    return {"q": nibbles[:, 0::2] | (nibbles[:, 1::2] << 4),
            "scale": np.ascontiguousarray(best_scale.T.astype(np.float16))}


def _q4_levels(groups: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """clip(rint(groups / scale), -8, 7) in float32, 0 where the scale underflowed to 0."""
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    return np.where(scale[..., None] == 0, np.float32(0), np.clip(np.rint(groups / safe), -8, 7))


def _q4_dequantize(parts: dict[str, np.ndarray], group_size: int = 32) -> np.ndarray:
    packed, scale = parts["q"], parts["scale"]
    n = packed.shape[0]
    nibbles = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1).astype(np.float32) - 8
    return nibbles * np.repeat(scale.T.astype(np.float32), group_size, axis=1)


def _q4a_quantize(w: np.ndarray, group_size: int = 32, importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Asymmetric int4 in groups of `group_size` inputs: W ≈ level · scale + minimum, level in 0..15,
    a float16 scale and minimum per group (GGUF's Q4_1 layout for groups of 32). Without `importance`,
    minimum is the group's least value and scale (max - min) / 15, each rounded to float16 as stored
    (llama.cpp's Q4_1 rule). With it (one weight per input, as q4's), the pair is fitted as llama.cpp
    fits its K-quants': levels from the min/max rule and from 21 stretched ranges, each followed by the
    weighted least-squares scale and minimum for those levels; the pair (as float16) whose levels give
    the least Σ u·(level · scale + minimum - w)² is kept. The levels are rint((w - minimum) / scale)
    clipped to 0..15 (0 where the scale is 0). Nibbles as q4's (even k low); the scale table is
    [2 · in / group, out], group g's scale in row 2g and its minimum in 2g + 1."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    low = groups.min(axis=-1).astype(np.float16).astype(np.float32)
    scale = ((groups.max(axis=-1) - low) / np.float32(15)).astype(np.float16).astype(np.float32)
    if importance is not None:
        scale, low = _q4a_fit(groups, np.asarray(importance, np.float32).reshape(k // group_size, group_size),
                              scale, low)
    q = _q4a_levels(groups, scale, low)
    nibbles = q.astype(np.uint8).reshape(n, k)
    return {"q": nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), "scale": q4a_scale_table(scale, low)}


def _q4a_levels(groups: np.ndarray, scale: np.ndarray, low: np.ndarray) -> np.ndarray:
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    return np.where(scale[..., None] == 0, np.float32(0), np.clip(np.rint((groups - low[..., None]) / safe), 0, 15))


def _q4a_fit(groups: np.ndarray, u: np.ndarray, scale: np.ndarray, low: np.ndarray,
             through_zero: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The (scale, minimum) of least importance-weighted error Σ u·(level · scale + minimum - w)² among
    the min/max pair (`scale`, `low`, with its own levels) and, for 22 candidate ranges, the levels of
    that range with the weighted least-squares pair for them (llama.cpp's K-quant fit); each error is
    the candidate's own levels' (from the sums the fit makes), and the pair kept is rounded to float16.
    `through_zero` (q4k, whose minimums are depths below 0): every range reaches down to 0 at least,
    and a fitted minimum above 0 is 0, its scale fitted again without one."""
    su, sx = u.sum(-1).astype(np.float64), np.einsum("...i,...i->...", u, groups).astype(np.float64)
    sxx = np.einsum("...i,...i->...", u * groups, groups).astype(np.float64)

    def sums(levels):            # Σ u·l, Σ u·l², Σ u·l·w, in float64 beside the others
        ul = u * levels
        return (ul.sum(-1).astype(np.float64), np.einsum("...i,...i->...", ul, levels).astype(np.float64),
                np.einsum("...i,...i->...", ul, groups).astype(np.float64))

    def error(s, m, sl, sll, slx):           # Σ u·(l·s + m - w)², from the sums
        return s * s * sll + 2 * s * m * sl - 2 * s * slx + m * m * su - 2 * m * sx + sxx

    best_scale, best_low = scale.astype(np.float64), low.astype(np.float64)
    best_err = error(best_scale, best_low, *sums(_q4a_levels(groups, scale, low)))
    top, bottom = groups.max(-1), groups.min(-1)
    bottom = np.minimum(bottom, 0) if through_zero else bottom
    span = np.where(top > bottom, top - bottom, np.float32(1))
    levels = np.empty_like(groups)
    for stretch in (15, *(14 + 0.1 * i for i in range(21))):
        np.subtract(groups, bottom[..., None], out=levels)
        np.multiply(levels, (np.float32(stretch) / span)[..., None], out=levels)
        np.clip(np.rint(levels, out=levels), 0, 15, out=levels)
        sl, sll, slx = sums(levels)
        det = su * sll - sl * sl
        ok = det > 0
        safe = np.where(ok, det, 1)
        s = np.where(ok, (su * slx - sl * sx) / safe, scale)
        m = np.where(ok, (sll * sx - sl * slx) / safe, low)
        if through_zero:
            above = m > 0
            s = np.where(above, slx / np.where(sll > 0, sll, 1), s)
            m = np.where(above, 0, m)
        err = error(s, m, sl, sll, slx)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale, best_low = np.where(better, s, best_scale), np.where(better, m, best_low)
    return best_scale.astype(np.float16).astype(np.float32), best_low.astype(np.float16).astype(np.float32)


def q4a_scale_table(scale: np.ndarray, minimum: np.ndarray, dtype=np.float16) -> np.ndarray:
    """A q4a weight's scale table from its [out, groups] scales and minimums: f16 (or `dtype`) [2 · groups, out]."""
    table = np.stack([scale, minimum], axis=1)                      # [out, 2, groups]
    return np.ascontiguousarray(table.transpose(2, 1, 0).reshape(-1, scale.shape[0]).astype(dtype))


def _q4a_dequantize(parts: dict[str, np.ndarray], group_size: int = 32) -> np.ndarray:
    packed, table = parts["q"], parts["scale"].astype(np.float32)
    n = packed.shape[0]
    levels = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1).astype(np.float32)
    return (levels * np.repeat(table[0::2].T, group_size, axis=1)) + np.repeat(table[1::2].T, group_size, axis=1)


Q4K_SUPER, Q4K_GROUP = 256, 32        # llama.cpp's K-quant super-block and its sub-blocks (kiln's groups)
Q4K_GROUPS = Q4K_SUPER // Q4K_GROUP   # groups a super-block holds
Q4K_ROWS = 2 * Q4K_GROUPS + 4          # rows of the q4k table per super-block
Q4K_LEVELS = 63                       # a 6-bit sub-scale's or depth's largest level


def _q4k_quantize(w: np.ndarray, group_size: int = Q4K_GROUP,
                  importance: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Asymmetric int4 in super-blocks of 256 inputs, as GGUF's Q4_K: each group of 32 has a 6-bit
    sub-scale s and depth m, each super-block a float16 factor for each (d, dmin), and
    W = level · (d · s) - dmin · m, level in 0..15 (4.625 bits a weight as kiln stores it, the
    6-bit numbers a byte each).
    Each group's (scale, minimum) is fitted as q4a's with importances (_q4a_fit, the minimum at most
    0), each input weighed by u = importance · √(2·mean(x²) + x²) over its super-block (llama.cpp's
    rule with an importance matrix) or, without one, √mean(x²) + |x| (its rule without); then d is
    float16(largest scale / 63) and each s = rint(scale / d), dmin and m likewise for the depths
    -minimum; the levels are rounded again against the scales and minimums so made (q4a's rule).
    The table is uint8 [20 · in / 256, out]: for super-block b, rows 20b + 2g and 20b + 2g + 1 hold
    group g's s and m, rows 20b + 16, 17 the bytes of d (low first), 20b + 18, 19 those of -dmin."""
    if group_size != Q4K_GROUP:
        raise ValueError(f"q4k's groups are {Q4K_GROUP} inputs (its super-blocks {Q4K_SUPER}), not {group_size}")
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % Q4K_SUPER:
        raise ValueError(f"q4k needs inputs in whole super-blocks of {Q4K_SUPER}, not {k}")
    supers = w.reshape(n, k // Q4K_SUPER, Q4K_SUPER)
    mean_square = (supers * supers).mean(-1, keepdims=True)
    if importance is None:
        u = np.sqrt(mean_square) + np.abs(supers)
    else:
        u = (np.asarray(importance, np.float32).reshape(1, k // Q4K_SUPER, Q4K_SUPER)
             * np.sqrt(2 * mean_square + supers * supers))
    groups = w.reshape(n, k // group_size, group_size)
    low = np.minimum(groups.min(-1), 0).astype(np.float16).astype(np.float32)
    scale = ((groups.max(-1) - low) / np.float32(15)).astype(np.float16).astype(np.float32)
    scale, low = _q4a_fit(groups, u.reshape(groups.shape), scale, low, through_zero=True)
    d, sub_scale = _six_bit(scale.reshape(n, -1, Q4K_GROUPS))
    dmin, depth = _six_bit(-low.reshape(n, -1, Q4K_GROUPS))
    group_scale = (d[..., None] * sub_scale).reshape(n, -1)
    minimum = -(dmin[..., None] * depth).reshape(n, -1)
    nibbles = _q4a_levels(groups, group_scale, minimum).astype(np.uint8).reshape(n, k)
    return {"q": nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), "scale": q4k_scale_table(d, -dmin, sub_scale, depth)}


def _six_bit(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """values [..., 8] >= 0 as a float16 factor per super-block (float32) and 6-bit levels (float32)."""
    factor = (values.max(-1) / np.float32(Q4K_LEVELS)).astype(np.float16).astype(np.float32)
    safe = np.where(factor == 0, np.float32(1), factor)[..., None]
    return factor, np.where(factor[..., None] == 0, 0, np.clip(np.rint(values / safe), 0, Q4K_LEVELS))


def q4k_scale_table(d: np.ndarray, negative_dmin: np.ndarray, sub_scale: np.ndarray,
                    depth: np.ndarray) -> np.ndarray:
    """A q4k weight's table (_q4k_quantize) from [out, supers] factors and [out, supers, 8] levels."""
    n, supers = d.shape
    table = np.empty((n, supers, Q4K_ROWS), np.uint8)
    table[..., 0:2 * Q4K_GROUPS:2], table[..., 1:2 * Q4K_GROUPS:2] = sub_scale, depth
    for row, factor in ((2 * Q4K_GROUPS, d), (2 * Q4K_GROUPS + 2, negative_dmin)):
        table[..., row:row + 2] = np.ascontiguousarray(factor.astype(np.float16)).view(np.uint8).reshape(n, supers, 2)
    return np.ascontiguousarray(table.reshape(n, -1).T)


def group_scales(scheme: str, table: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A grouped scheme's table as float32 [groups, out] scales and minimums (None: it has none)."""
    if scheme == "q4k":
        rows = np.asarray(table).T.reshape(table.shape[1], -1, Q4K_ROWS)        # [out, supers, 20]
        factors = np.ascontiguousarray(rows[..., 2 * Q4K_GROUPS:]).view(np.float16).astype(np.float32)
        levels = rows[..., :2 * Q4K_GROUPS].astype(np.float32)
        scale = factors[..., 0:1] * levels[..., 0::2]
        minimum = factors[..., 1:2] * levels[..., 1::2]
        return scale.reshape(scale.shape[0], -1).T, minimum.reshape(minimum.shape[0], -1).T
    table = np.asarray(table, np.float32)
    return (table[0::2], table[1::2]) if scheme == "q4a" else (table, None)


def _q4k_dequantize(parts: dict[str, np.ndarray], group_size: int = Q4K_GROUP) -> np.ndarray:
    packed = parts["q"]
    scale, minimum = group_scales("q4k", parts["scale"], group_size)
    levels = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float32)
    return levels * np.repeat(scale.T, group_size, axis=1) + np.repeat(minimum.T, group_size, axis=1)


FP8_MAX = 448.0          # largest finite float8_e4m3fn


def _fp8_quantize(w: np.ndarray) -> dict[str, np.ndarray]:
    """float8 e4m3 per output channel: w ≈ q * scale[:, None], the channel's peak mapped to 448."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    return {"q": (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), "scale": scale}


SCHEMES = {
    "q8": Scheme("q8", "int8", _q8_quantize, _q8_dequantize),
    "fp8": Scheme("fp8", "float8_e4m3fn", _fp8_quantize, _q8_dequantize),
    "q4": Scheme("q4", "uint8", _q4_quantize, _q4_dequantize, scale_dtype="float16", grouped=True, per_byte=2,
                 weighted=True),
    # int8 in groups with float16 scales: GGUF's Q8_0 kept exactly (frontend/gguf_tensors.py)
    "q8g": Scheme("q8g", "int8", _q8g_quantize, _q8g_dequantize, scale_dtype="float16", grouped=True),
    # int4 with a minimum per group: GGUF's Q4_1 kept exactly, its Q4_K nearly (frontend/gguf_tensors.py)
    "q4a": Scheme("q4a", "uint8", _q4a_quantize, _q4a_dequantize, scale_dtype="float16", grouped=True, per_byte=2,
                  scale_rows=2, weighted=True),
    # int4 with 6-bit sub-scales and minimums in super-blocks: GGUF's Q4_K kept exactly
    "q4k": Scheme("q4k", "uint8", _q4k_quantize, _q4k_dequantize, scale_dtype="uint8", grouped=True, per_byte=2,
                  scale_rows=2, weighted=True, super_block=Q4K_SUPER, super_rows=4),
}
WEIGHT_FORMATS = ("none", *SCHEMES)      # a weight's `format` attribute: as stored, or a scheme's
INTEGER_LEVELS = ("q8", "q4", "q8g", "q4a", "q4k")   # schemes whose integer levels int8 activations multiply



def quantize_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 activations, as the q8/q4 linears with `act_block` read them: each row of x [rows, k]
    in blocks of `block` inputs, q = rint(x * (127 / amax)) with amax the block's largest |x| and
    scale = amax / 127, all in float32 (q = 0, scale = 0 for an all-zero block).
    Returns (q [rows, k / block, block] float32 integers in [-127, 127], scale [rows, k / block])."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.rint(blocks * inverse[..., None]), amax / np.float32(127)


def int8_activation_matmul(x: np.ndarray, w_int: np.ndarray, block_scale, block: int,
                           block_minimum=None) -> np.ndarray:
    """sum over blocks b, in order, of float32(xq_b · w_int_b) * (x_scale_b * block_scale(b)), then
    (q4a) + float32(Σ xq_b) * (x_scale_b * block_minimum(b)): x [rows, k] quantised by
    quantize_activations, w_int [out, k] integer weight levels, block_scale(b) None (one per block:
    none) or a float32 [out] factor for block b, block_minimum(b) likewise the group's minimum.
    The per-block integer dots are exact (|sum| < 2^24), so only the float sum is ordered."""
    q, x_scale = quantize_activations(x, block)
    w_blocks = np.asarray(w_int, np.float64).reshape(w_int.shape[0], -1, block)
    acc = np.zeros((x.shape[0], w_int.shape[0]), np.float32)
    for b in range(q.shape[1]):
        dots = (q[:, b].astype(np.float64) @ w_blocks[:, b].T).astype(np.float32)
        factor = x_scale[:, b, None] if block_scale is None else x_scale[:, b, None] * block_scale(b)[None, :]
        acc += dots * factor
        if block_minimum is not None:
            acc += q[:, b].sum(axis=-1, keepdims=True) * (x_scale[:, b, None] * block_minimum(b)[None, :])
    return acc

@dataclass(frozen=True)
class KVScheme:
    """A KV-cache storage format: each row (one token, one KV head, k or v) is stored as
    q = x / scale in `storage_dtype` with scale = max|x| / qmax (1 for an all-zero row)."""
    name: str
    storage_dtype: str
    qmax: float
    rounds: bool             # integer storage rounds to nearest (ties to even) and clips

    def quantize_rows(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [..., head_dim] -> (q [..., head_dim], scale [...] float32)."""
        x = np.asarray(x, np.float32)
        amax = np.abs(x).max(axis=-1)
        scale = np.where(amax > 0, amax / np.float32(self.qmax), np.float32(1)).astype(np.float32)
        q = x / scale[..., None]
        if self.rounds:
            q = np.clip(np.rint(q), -self.qmax, self.qmax)
        return q.astype(numpy_dtype(self.storage_dtype)), scale

    @staticmethod
    def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        return q.astype(np.float32) * scale[..., None]


KV_SCHEMES = {
    "int8": KVScheme("int8", "int8", 127.0, rounds=True),
    "fp8": KVScheme("fp8", "float8_e4m3fn", FP8_MAX, rounds=False),
}


def kv_scheme_for(storage_dtype: str) -> KVScheme | None:
    """The KV scheme stored as `storage_dtype`, or None for unquantised pages."""
    return next((s for s in KV_SCHEMES.values() if s.storage_dtype == storage_dtype), None)
