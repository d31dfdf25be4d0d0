"""How a linear, embed or moe_experts node reads its stored weight: `WeightFormat` (float, q8, fp8,
q4 nibbles in groups, int8 activations in blocks), from the node's attributes. The kernel records
ask it what a site is; codegen's kernels read weights by it (codegen/kernels/weight_format.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightFormat:
    kind: str = "float"          # "float" | "q8", "fp8" (per-output scale) | "q4" (nibbles, group scales)
    #                              | "q8g" (int8 levels, group scales) | "q4a" (nibbles, group scales and minimums)
    group_size: int = 0
    act_block: int = 0           # > 0: x quantised to int8 in blocks of this many inputs (ir/ops.py)

    @classmethod
    def of(cls, node) -> WeightFormat:
        """The format a linear, embed or moe_experts node reads (its `format`, group_size, act_block)."""
        fmt = node.attrs.get("format", "none")
        return cls("float" if fmt == "none" else fmt, node.attrs.get("group_size", 0), node.attrs.get("act_block", 0))

    @property
    def nibbles(self) -> bool:
        """Two 4-bit levels per stored byte (q4, q4a)."""
        return self.kind in ("q4", "q4a")

    @property
    def level_offset(self) -> int:
        """What a stored nibble exceeds its level by: q4's are level + 8; q4a's are the levels (0..15)."""
        return 8 if self.kind == "q4" else 0

    @property
    def has_minimums(self) -> bool:
        """A float16 minimum per group beside its scale (q4a: W = level · scale + minimum)."""
        return self.kind == "q4a"

    def scale_row(self, group):
        """The row of the [rows, out] scale table holding a group's scale (q4a interleaves scale and
        minimum rows: 2·group and 2·group + 1)."""
        return 2 * group if self.has_minimums else group

    def minimum_row(self, group):
        return 2 * group + 1

    @property
    def grouped(self) -> bool:
        """Float16 scales per group of inputs, applied in the reduction (q4, q8g, q4a), not in the epilogue."""
        return self.kind in ("q4", "q8g", "q4a")

    @property
    def scale_rows(self) -> int:
        """Rows of the scale table per group of inputs: 2 for q4a (scale, minimum), else 1."""
        return 2 if self.has_minimums else 1

    @property
    def int8_levels(self) -> bool:
        """Integer levels int8 activations multiply (q8, q8g, q4, q4a)."""
        return self.kind in ("q8", "q8g", "q4", "q4a")

    @property
    def suffix(self) -> str:
        """A kernel-name suffix: "" for float, "_q8", "_q4g32", "_q4g32a32" (int8 x in blocks of 32), ..."""
        return "" if self.kind == "float" else (f"_{self.kind}" + (f"g{self.group_size}" if self.group_size else "")
                                                + (f"a{self.act_block}" if self.act_block else ""))
