"""Rotary embedding applied while a kernel loads a q or k element (no separate rope kernel).

Same arithmetic as the `rope` op's kernel (codegen/lowering/elementwise.py emit_rope): rotate-half pairs
(d, d + R/2) over the first R = rotary_dim elements of a head (the rest pass through), the angle
positions[t] * inv_freq[d mod R/2] in float32, scaled by mscale, the result rounded to the model
dtype before use, as the separate op would store it.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T


@dataclass(frozen=True)
class RotaryLoad:
    """How a kernel rotates the heads (of head_dim) it loads: rotary_dim leading elements, scaled by mscale."""
    head_dim: int
    rotary_dim: int
    mscale: float = 1.0


def rope_angle(positions, inv_freq, t, f):
    """The angle of frequency f at row t's position, float32 (evaluated while a kernel is parsed)."""
    return T.Cast("float32", positions[t]) * inv_freq[f]


def computed_trig(table, *row):
    """trig for load_head_element: the (cos, sin) a kernel stored at table[*row, 0 / 1, f]."""
    return lambda f: (table[(*row, 0, f)], table[(*row, 1, f)])


def load_head_element(x, positions, inv_freq, t, base, d, dtype: str, rope: RotaryLoad | None, trig=None):
    """float32 value of element d of the head at columns [base, base + head_dim) of row t of x,
    rotated as `rope` says (None: as stored). `trig(f)`: the (cos, sin) of row t's angle of
    frequency f where the kernel computed them ahead, once for every head (rope_angle): else each
    element computes its own."""
    value = T.Cast("float32", x[t, base + d])
    if rope is None:
        return value
    half = rope.rotary_dim // 2
    if trig is None:
        angle = rope_angle(positions, inv_freq, t, d % half)
        cos, sin = T.cos(angle), T.sin(angle)
    else:
        cos, sin = trig(d % half)
    partner = T.if_then_else(d < half, -T.Cast("float32", x[t, base + d + half]),
                             T.Cast("float32", x[t, base + d - half]))
    turned = value * cos + partner * sin
    if rope.mscale != 1.0:
        turned = turned * T.float32(rope.mscale)
    rotated = T.Cast("float32", T.Cast(dtype, turned))
    return rotated if rope.rotary_dim == rope.head_dim else T.if_then_else(d < rope.rotary_dim, rotated, value)
