"""Reading a stored weight in a kernel (by its selection/formats.py WeightFormat) and the epilogue
every linear kernel applies: what the linear kernels share, below all of them."""
from __future__ import annotations

from tvm import tirx

from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import nibble_of


def weight_value(fmt: WeightFormat, load, scale, j, k, span: int = 0):
    """W[j, k] as float32: `load(j, kk)` reads the stored element for output j at stored input index
    kk; q4 bytes hold inputs `span` apart (selection/layouts.py: nibble_of); q4, q8g and q4a levels times
    their group scale (plus q4a's group minimum)."""
    if fmt.grouped:
        group = k // fmt.group_size
        value = weight_level(fmt, load, j, k, span).astype("float32") * scale[fmt.scale_row(group), j].astype("float32")
        return value + scale[fmt.minimum_row(group), j].astype("float32") if fmt.has_minimums else value
    return load(j, k).astype("float32")


def weight_level(fmt: WeightFormat, load, j, k, span: int = 0):
    """The integer level of W[j, k] (int32) for q8, q8g, q4 and q4a: the byte, or the nibble less its offset."""
    if fmt.nibbles:
        byte_k, high = nibble_of(k, span)
        nibble = (load(j, byte_k) >> (high * 4).astype("uint8")) & tirx.const(15, "uint8")
        return nibble.astype("int32") - fmt.level_offset
    return load(j, k).astype("int32")


def epilogue_scale(fmt: WeightFormat, scale):
    """The per-output scale the epilogue applies: q8's and fp8's (q4's group scales are applied in the sum)."""
    return scale if fmt.kind in ("q8", "fp8") else None


def epilogue(acc, scale, bias, residual, dtype):
    """The value a linear writes for acc[i, j] (float32): * scale, + bias, round, + residual, round."""
    def value(i, j):
        y = acc[i, j] if scale is None else acc[i, j] * scale[j]
        y = y if bias is None else y + bias[j].astype("float32")
        if residual is None:
            return y.astype(dtype)
        return (y.astype(dtype).astype("float32") + residual[i, j].astype("float32")).astype(dtype)
    return value
