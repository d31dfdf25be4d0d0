"""Embedding gathers: float tables, and quantised tables decoded only in the rows a step reads.

A table that is also the LM head's weight (tied embeddings) is stored once, in the head's layout
('nk', 'packedNB', 'packedNBxF' or, q4 bytes of inputs S apart, 'packedNBx4nS': selection/layouts.py),
and the gather computes each row's address inside it: row r, stored column c of
Wp[vocab/NB, columns, NB] is Wp[r // NB, c, r % NB] (a q4 input's byte and nibble: layouts.nibble_of).
Its q4 group scales likewise take the head's layout ('nk' or 'panelsNB').
"""
from __future__ import annotations

from tvm import relax, te, tirx

from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import group_scales, nibble_span, packed_block, packed_index

from ..kernels.weight_format import epilogue_scale, weight_value


def gather_kernel(vocab: int, hidden: int, layout: str, dtype: str, fmt: WeightFormat, scale_layout: str = "nk"):
    """A TE function (ids, table[, scale]) -> out [tokens, hidden] in `dtype`: each output element
    reads one stored element (one byte of two nibbles for q4) and its row's scale, in float32."""
    def gather(ids, table, *scale):
        s = group_scales(scale[0], scale_layout) if scale else None

        def load(r, kk):                    # stored element at row r, stored column kk
            return table[packed_index(layout, r, kk)] if packed_block(layout) else table[r, kk]

        def out(t, c):
            r = tirx.max(tirx.min(ids[t].astype("int64"), tirx.const(vocab - 1, "int64")),
                         tirx.const(0, "int64"))                    # ids are clipped, like take(mode="clip")
            v = weight_value(fmt, load, s, r, c, nibble_span(layout))
            if epilogue_scale(fmt, s) is not None:                 # q8, fp8: one scale per row
                v = v * s[r]
            return v.astype(dtype)
        return te.compute((ids.shape[0], hidden), out, name="embed")
    return gather


def emit_embed(ctx, ids: relax.Expr, table: relax.Expr, scale: relax.Expr | None, layout: str, vocab: int,
               hidden: int, dtype: str, fmt: WeightFormat = WeightFormat(), scale_layout: str = "nk") -> relax.Expr:
    """Emit out[t] = row ids[t] of the table (dequantised to `dtype`) for a table stored in `layout`."""
    nb = packed_block(layout)
    if fmt.kind == "float" and nb is None:
        return ctx.bb.emit(relax.op.take(table, ids, axis=0, mode="clip"))
    name = "embed" + ("" if fmt.kind == "float" else f"_{fmt.kind}") + (f"_{layout}" if nb else "")
    args = [ids, table] + ([scale] if scale is not None else [])
    return ctx.bb.emit_te(gather_kernel(vocab, hidden, layout, dtype, fmt, scale_layout), *args,
                          primfunc_name_hint=name)
