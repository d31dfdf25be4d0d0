"""Mixture-of-experts grouped GEMMs (moe_experts' gate_up and down, codegen/lowering/moe.py): what
each kernel takes. One kernel runs both GEMMs of a node.

  mma     CUDA's tensor cores (codegen/kernels/gpu/mma_gemm.py), weights as stored.
  packed  CPU weights packed in panels: kiln's packed-weight schedule.
  te      a TE kernel the target's pipeline (dlight on GPUs) schedules: any layout.
codegen/lowering/moe.py emits each by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.ir import Graph, input_of

from .formats import WeightFormat
from .layouts import packed_block
from .linear import linear_layout, mma_tiles


@dataclass(frozen=True)
class ExpertSite:
    """One moe_experts node as a kernel record sees it: each grouped GEMM's (n_out, n_in, layout)."""
    target: object
    dtype: str                       # the activations'
    weight_dtype: str                # the stored experts'
    fmt: WeightFormat
    gemms: tuple[tuple[int, int, str], ...]

    def tiles(self, n_out: int, n_in: int):
        return mma_tiles(self.target, self.dtype, self.weight_dtype, self.fmt, n_out, n_in)


@dataclass(frozen=True)
class ExpertKernel:
    name: str
    supports: Callable[[ExpertSite], bool]


EXPERT_KERNELS = {k.name: k for k in (
    ExpertKernel("mma", lambda s: all(packed_block(layout) is None and s.tiles(n_out, n_in)
                                      for n_out, n_in, layout in s.gemms)),
    ExpertKernel("packed", lambda s: all(packed_block(layout) is not None for _, _, layout in s.gemms)),
    ExpertKernel("te", lambda s: True),
)}


def expert_layout(target, experts_shape: tuple) -> str:
    """The layout an expert stack [E, out, in] is stored in: each expert packed as a linear's weight."""
    return linear_layout(target, *experts_shape[1:])


def expert_site(node, graph: Graph, target, types: dict) -> ExpertSite:
    gate_up, down = (types[input_of(node, name)] for name in ("gate_up", "down"))
    hidden, ffn = node.type.shape[1], gate_up.shape[1] // 2
    gemms = ((2 * ffn, hidden, expert_layout(target, gate_up.shape)), (hidden, ffn, expert_layout(target, down.shape)))
    return ExpertSite(target, node.type.dtype, gate_up.dtype, WeightFormat.of(node), gemms)
