"""Rotary embedding applied while a kernel loads a q or k element (no separate rope kernel).

Same arithmetic as the `rope` op's kernel (codegen/elementwise.py emit_rope): rotate-half pairs
(d, d + D/2), the angle positions[t] * inv_freq[d mod D/2] in float32, the result rounded to the
model dtype before use, as the separate op would store it.
"""
from __future__ import annotations

from tvm.script import tirx as T


def load_head_element(x, positions, inv_freq, t, base, d, head_dim: int, dtype: str, rope: bool,
                      mscale: float = 1.0):
    """float32 value of element d of the head at columns [base, base + head_dim) of row t of x,
    rotated (and scaled by `mscale`) when `rope` is set."""
    value = T.Cast("float32", x[t, base + d])
    if not rope:
        return value
    half = head_dim // 2
    angle = T.Cast("float32", positions[t]) * inv_freq[d % half]
    partner = T.if_then_else(d < half, -T.Cast("float32", x[t, base + d + half]),
                             T.Cast("float32", x[t, base + d - half]))
    turned = value * T.cos(angle) + partner * T.sin(angle)
    return T.Cast("float32", T.Cast(dtype, turned * T.float32(mscale) if mscale != 1.0 else turned))
