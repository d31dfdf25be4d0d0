"""How a linear, embed or moe_experts node reads its stored weight: `WeightFormat` (float, q8, fp8,
q4 nibbles in groups, int8 activations in blocks), from the node's attributes. The kernel records
ask it what a site is; codegen's kernels read weights by it (codegen/kernels/weight_format.py)."""
from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.quant import INTEGER_LEVELS, SCHEMES


@dataclass(frozen=True)
class WeightFormat:
    kind: str = "float"          # "float" | "q8", "fp8" (per-output scale) | "q4" (nibbles, group scales)
    #                              | "q8g" (int8 levels, group scales) | "q4a" (nibbles, group scales and minimums)
    #                              | "q4k" (q4a's, its scales and minimums 6-bit numbers times super-block factors)
    group_size: int = 0
    act_block: int = 0           # > 0: x quantised to int8 in blocks of this many inputs (ir/ops.py)
    scale_dtype: str = ""        # "float32": a grouped format's scale table in float32, not its scheme's float16

    @classmethod
    def of(cls, node) -> WeightFormat:
        """The format a linear, embed or moe_experts node reads (its `format`, group_size, act_block,
        scale_dtype)."""
        fmt = node.attrs.get("format", "none")
        return cls("float" if fmt == "none" else fmt, node.attrs.get("group_size", 0), node.attrs.get("act_block", 0),
                   node.attrs.get("scale_dtype", ""))

    @property
    def nibbles(self) -> bool:
        """Two 4-bit levels per stored byte (q4, q4a, q4k)."""
        return self.kind in ("q4", "q4a", "q4k")

    @property
    def level_offset(self) -> int:
        """What a stored nibble exceeds its level by: q4's are level + 8; q4a's and q4k's are the levels (0..15)."""
        return 8 if self.kind == "q4" else 0

    @property
    def has_minimums(self) -> bool:
        """A minimum per group beside its scale (q4a, q4k: W = level · scale + minimum)."""
        return self.kind in ("q4a", "q4k")

    @property
    def super_block(self) -> int:
        """Inputs per super-block whose float16 factors scale its groups' 6-bit numbers (q4k), else 0."""
        return SCHEMES[self.kind].super_block if self.kind in SCHEMES else 0

    def scale_row(self, group):
        """The row of the scale table holding a group's scale (q4a interleaves scale and minimum rows:
        2·group and 2·group + 1; q4k does within each super-block, whose factors' rows follow)."""
        if self.super_block:
            per_super = self.super_block // self.group_size
            return group // per_super * self.super_rows + group % per_super * 2
        return 2 * group if self.has_minimums else group

    def minimum_row(self, group):
        return self.scale_row(group) + 1

    def factor_rows(self, group) -> tuple:
        """q4k: the rows of the bytes (low, high) of the float16 factors of a group's super-block:
        its scale's, then its minimum's."""
        per_super = self.super_block // self.group_size
        first = group // per_super * self.super_rows + 2 * per_super
        return (first, first + 1), (first + 2, first + 3)

    @property
    def super_rows(self) -> int:
        """Rows of the scale table per super-block (q4k), its groups' and its factors'."""
        return SCHEMES[self.kind].table_rows(self.super_block, self.group_size)

    def table_rows(self, n_in: int) -> int:
        """Rows of a grouped format's scale table over n_in inputs."""
        return SCHEMES[self.kind].table_rows(n_in, self.group_size)

    @property
    def table_dtype(self) -> str:
        """The scale table's dtype: float16 for the grouped formats but q4k (bytes; float32 where the node's
        scale_dtype says), else float32."""
        return (self.scale_dtype or SCHEMES[self.kind].scale_dtype) if self.grouped else "float32"

    @property
    def grouped(self) -> bool:
        """Scales per group of inputs, applied in the reduction (q4, q8g, q4a, q4k), not in the epilogue."""
        return self.kind in SCHEMES and SCHEMES[self.kind].grouped

    @property
    def int8_levels(self) -> bool:
        """Integer levels int8 activations multiply (q8, q8g, q4, q4a, q4k)."""
        return self.kind in INTEGER_LEVELS

    @property
    def suffix(self) -> str:
        """A kernel-name suffix: "" for float, "_q8", "_q4g32", "_q4g32a32" (int8 x in blocks of 32),
        "_q4g32a32f32" (float32 scales), ..."""
        return "" if self.kind == "float" else (f"_{self.kind}" + (f"g{self.group_size}" if self.group_size else "")
                                                + (f"a{self.act_block}" if self.act_block else "")
                                                + ("f32" if self.scale_dtype == "float32" else ""))
