"""LoRA adapters on a projection: rows of one step use different adapters (or none).

`lora` adds to a linear's output y [tokens, out] each row's adapter term: for the adapter in slot
s = slots[t] (-1: none, y's row unchanged), with h = x[t] · a[s]ᵀ,
    y[t, n] + Σ_r h[j·R + r] · b[s, r, n]      for each output column n of module j
with a [slots, P·R, in] the stacked down-projections (PEFT's lora_A) of the P modules whose rows y
holds (`modules`, `rows` columns each: a fused qkv or gate/up; one for a plain projection) and
b [slots, R, out] their up-projections (lora_B transposed, each module's in its own columns, already
times the adapter's scale: alpha / r, or alpha / √r for rsLoRA). Adapters of lower rank than R, or
without a module, have zero rows there. The shrink and the expand are in float32; the result is
rounded to y's dtype once.
"""
from __future__ import annotations

import numpy as np

from .opdef import as_type, f32, need_float, op


@op("lora", ["y", "x", "a", "b", "slots"], {"modules": (), "rows": (), "rank": 0})
def _lora():
    """y + each module's part of (x · a[slots]ᵀ) times b[slots] in its columns, per row (slot -1: y);
    modules/rows: the checkpoint modules whose output columns y holds, in order (PEFT's names), and how
    many each; rank: R per module."""
    def rule(types, attrs, fail):
        y, x, a, b, slots = types
        for t, what in ((y, "y"), (x, "x"), (a, "a"), (b, "b")):
            need_float(t, what, fail)
        if a.dtype != b.dtype:
            fail(f"a and b must have one dtype, got {a.dtype} and {b.dtype}")
        if y.rank != 2 or x.rank != 2 or y.shape[0] != x.shape[0]:
            fail(f"y and x must be [tokens, out] and [tokens, in], got {y} and {x}")
        if a.rank != 3 or b.rank != 3 or a.shape[0] != b.shape[0] or b.shape[1] != attrs["rank"]:
            fail(f"a and b must be [slots, modules · rank, in] and [slots, rank, out], got {a} and {b}")
        if a.shape[2] != x.shape[1] or b.shape[2] != y.shape[1]:
            fail(f"a [slots, rank, {x.shape[1]}] and b [slots, rank, {y.shape[1]}] must fit x and y, got {a}, {b}")
        if slots.rank != 1 or slots.dtype != "int32" or slots.shape[0] != y.shape[0]:
            fail(f"slots must be i32[tokens], got {slots}")
        modules, rows = attrs["modules"], attrs["rows"]
        if not modules or len(modules) != len(rows) or (isinstance(y.shape[1], int) and sum(rows) != y.shape[1]):
            fail(f"rows {rows} of modules {modules} must add up to y's {y.shape[1]} columns")
        if attrs["rank"] * len(modules) != a.shape[1]:
            fail(f"a's {a.shape[1]} rows must be rank {attrs['rank']} for each of {len(modules)} modules")
        return y

    def ref(v, at, ty, dims):
        y, x, a, b, slots = v
        out, rank, ends = f32(y).copy(), at["rank"], np.cumsum([0, *at["rows"]])
        for s in np.unique(slots[slots >= 0]):
            rows = slots == s
            h = f32(x[rows]) @ f32(a[s]).T
            for j, (lo, hi) in enumerate(zip(ends[:-1], ends[1:])):
                out[rows, lo:hi] += h[:, j * rank:(j + 1) * rank] @ f32(b[s][:, lo:hi])
        return as_type(out, ty)
    return rule, ref
