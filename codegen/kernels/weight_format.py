"""How a linear reads its stored weight (`WeightFormat`: float, q8, fp8, q4 nibbles, int8 activations)
and the epilogue every linear kernel applies: what the linear kernels share, below all of them."""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx

from .layouts import nibble_of


@dataclass(frozen=True)
class WeightFormat:
    """How to read W[j, k] as float32 from the stored weight (and its scales)."""
    kind: str = "float"          # "float" | "q8", "fp8" (per-output scale) | "q4" (nibbles, group scales)
    group_size: int = 0
    act_block: int = 0           # > 0: x quantised to int8 in blocks of this many inputs (ir/ops.py)

    @classmethod
    def of(cls, node) -> WeightFormat:
        """The format a linear, embed or moe_experts node reads (its `format`, group_size, act_block)."""
        fmt = node.attrs.get("format", "none")
        return cls("float" if fmt == "none" else fmt, node.attrs.get("group_size", 0), node.attrs.get("act_block", 0))

    @property
    def suffix(self) -> str:
        """A kernel-name suffix: "" for float, "_q8", "_q4g32", "_q4g32a32" (int8 x in blocks of 32), ..."""
        return "" if self.kind == "float" else (f"_{self.kind}" + (f"g{self.group_size}" if self.group_size else "")
                                                + (f"a{self.act_block}" if self.act_block else ""))

    def value(self, load, scale, j, k, span: int = 0):
        """`load(j, kk)` reads the stored element for output j at stored input index kk; q4 bytes
        hold inputs `span` apart (codegen/kernels/layouts.py: nibble_of)."""
        if self.kind == "q4":
            return self.level(load, j, k, span).astype("float32") * scale[k // self.group_size, j].astype("float32")
        return load(j, k).astype("float32")

    def level(self, load, j, k, span: int = 0):
        """The integer level of W[j, k] (int32) for q8 and q4: the byte, or the nibble - 8."""
        if self.kind == "q4":
            byte_k, high = nibble_of(k, span)
            nibble = (load(j, byte_k) >> (high * 4).astype("uint8")) & tirx.const(15, "uint8")
            return nibble.astype("int32") - 8
        return load(j, k).astype("int32")

    def epilogue_scale(self, scale):
        return scale if self.kind in ("q8", "fp8") else None


def epilogue(acc, scale, bias, residual, dtype):
    """The value a linear writes for acc[i, j] (float32): * scale, + bias, round, + residual, round."""
    def value(i, j):
        y = acc[i, j] if scale is None else acc[i, j] * scale[j]
        y = y if bias is None else y + bias[j].astype("float32")
        if residual is None:
            return y.astype(dtype)
        return (y.astype(dtype).astype("float32") + residual[i, j].astype("float32")).astype(dtype)
    return value
