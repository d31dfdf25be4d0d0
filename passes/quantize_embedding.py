"""quantize_embedding: the embedding gather reads its table quantised with the weights' scheme.

Rewrite (mode q8; fp8 likewise with an e4m3 table; q4 adds {group_size}, with u8 packed nibbles
and f16 group scales):
    %h = embed(%ids, @t)
  ->
    %h = embed(%ids, @t.q8, @t.q8_scale) {format='q8', dtype='float32'}
        @t.q8 = q8.q(@t)   @t.q8_scale = q8.scale(@t)      (computed once, when weights are written)
The quantised params are named as `quantize` names those of a linear weight, so a tied table
whose LM head was quantised with the same scheme is one pair of params that the gather and the
LM head both read: the artifact stores the table once.
Requires: the table is a float param. Refuses (KilnError): q4 where group_size does not divide the width.
Leaves: %h keeps its name and type; the float table is dropped once no node reads it (a tied
  table whose LM head stays float is still read, and stored, for the head).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import KilnError
from kiln.ir import Graph, attrs_for, input_of, named_inputs, weight_format
from kiln.ir.quant import SCHEMES

from .graph_pass import GraphPass
from .quantize import add_quantized_params
from .rewrite import drop_unused_params


@dataclass(frozen=True)
class QuantizeEmbedding(GraphPass):
    name: ClassVar[str] = "quantize_embedding"
    mode: str = "q8"
    group_size: int = 32          # q4 only: hidden columns per scale

    def __post_init__(self):
        if self.mode not in SCHEMES:
            raise ValueError(f"unknown quantisation mode {self.mode!r} (known: {', '.join(SCHEMES)})")

    def rewrite(self, graph: Graph) -> Graph:
        grouped = SCHEMES[self.mode].grouped
        for node in graph.nodes:
            if node.op != "embed" or weight_format(node) != "none" or input_of(node, "table") not in graph.params:
                continue
            table = graph.params[input_of(node, "table")]
            if grouped and table.type.shape[1] % self.group_size:
                raise KilnError(f"{self.mode} in groups of {self.group_size} cannot hold the embedding table "
                                f"{table.name}: its width {table.type.shape[1]} is not a multiple of "
                                f"{self.group_size} (use --group-size 32, or --tensor-quant embedding=q8)")
            q, scale = add_quantized_params(graph, table, self.mode, self.group_size)
            node.inputs = named_inputs("embed", ids=input_of(node, "ids"), table=q, scale=scale)
            node.attrs = attrs_for("embed", format=self.mode, dtype=node.type.dtype,
                                   **({"group_size": self.group_size} if grouped else {}))
        return drop_unused_params(graph)
