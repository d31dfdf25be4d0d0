"""Reading a stored weight in a kernel (by its selection/formats.py WeightFormat) and the epilogue
every linear kernel applies: what the linear kernels share, below all of them."""
from __future__ import annotations

from tvm import tirx

from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import nibble_of


def weight_value(fmt: WeightFormat, load, scale, j, k, span: int = 0):
    """W[j, k] as float32: `load(j, kk)` reads the stored element for output j at stored input index
    kk; q4 bytes hold inputs `span` apart (selection/layouts.py: nibble_of); q4, q8g, q4a and q4k levels
    times their group scale (plus q4a's and q4k's group minimum)."""
    if fmt.grouped:
        group, read = k // fmt.group_size, lambda row: scale[row, j]         # noqa: E731
        value = weight_level(fmt, load, j, k, span).astype("float32") * group_scale(fmt, read, group)
        return value + group_minimum(fmt, read, group) if fmt.has_minimums else value
    return load(j, k).astype("float32")


def group_scale(fmt: WeightFormat, read, group, lanes: int = 1):
    """A group's scale as float32 (a vector of `lanes` outputs), `read(row)` giving a row's entry of
    the scale table for the outputs at hand: the float16 entry, or q4k's 6-bit sub-scale times its
    super-block's float16 factor."""
    if fmt.super_block:
        return _factor(read, fmt.factor_rows(group)[0], lanes) * _wide(read(fmt.scale_row(group)), lanes)
    return _wide(read(fmt.scale_row(group)), lanes)


def group_minimum(fmt: WeightFormat, read, group, lanes: int = 1):
    """A group's minimum (q4a, q4k) as group_scale gives its scale (q4k: its 6-bit depth times the
    super-block's negated dmin)."""
    if fmt.super_block:
        return _factor(read, fmt.factor_rows(group)[1], lanes) * _wide(read(fmt.minimum_row(group)), lanes)
    return _wide(read(fmt.minimum_row(group)), lanes)


def _wide(value, lanes: int):
    return tirx.Cast("float32" if lanes == 1 else f"float32x{lanes}", value)


def _factor(read, rows, lanes: int):
    """The float16 whose bytes (low, high) are in two rows, as float32."""
    wide = "uint16" if lanes == 1 else f"uint16x{lanes}"
    eight = tirx.const(8, "uint16") if lanes == 1 else tirx.Broadcast(tirx.const(8, "uint16"), lanes)
    bits = tirx.Cast(wide, read(rows[0])) | (tirx.Cast(wide, read(rows[1])) << eight)
    return _wide(tirx.reinterpret("float16" if lanes == 1 else f"float16x{lanes}", bits), lanes)


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
