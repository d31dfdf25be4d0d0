"""fuse_qkv: three projections of the same input become one GEMM whose output is sliced.

Rewrite:
    %q = linear(%x, @wq[, _, @bq])   %k = linear(%x, @wk[, _, @bk])   %v = linear(%x, @wv[, _, @bv])
  ->
    %qkv = linear(%x, @wqkv[, _, @bqkv])     @wqkv = concat(@wq, @wk, @wv, axis=0)
    %q = slice(%qkv) {begin=0, end=Nq}   %k = slice(%qkv) {…}   %v = slice(%qkv) {…}
Requires: exactly three linear users of %x, each with a plain (not derived, not quantised) weight param of the
  same dtype and input width, no residual, and all with a bias or none.
Leaves: the slices keep the old names, so every consumer is unchanged; the three weights become
  one param whose data is their concatenation, made when weights are loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node, TensorType, attrs_for, input_of, named_inputs, weight_format

from .graph_pass import GraphPass
from .pattern import GraphIndex, Pat, match
from .rewrite import concat_params, drop_unused_params, fresh_name

PLAIN_PROJECTION = Pat("linear", {"residual": None}, test=lambda node: weight_format(node) == "none")


def _sibling_linears(graph: Graph) -> list[list[Node]]:
    """Groups of exactly three plain projections of one value, with like weights and biases."""
    index = GraphIndex(graph)
    groups = []
    for value, nodes in index.readers.items():
        lin = [n for n in nodes if match(PLAIN_PROJECTION, n, index) and input_of(n, "x") == value]
        if len(lin) != 3:
            continue
        weights = [graph.params.get(input_of(n, "weight")) for n in lin]
        if any(w is None or w.recipe for w in weights):
            continue
        if len({(w.type.dtype, w.type.shape[1]) for w in weights}) != 1:
            continue
        has_bias = [input_of(n, "bias") is not None for n in lin]
        if len(set(has_bias)) != 1 or (has_bias[0] and any(graph.params.get(input_of(n, "bias")) is None for n in lin)):
            continue
        groups.append(lin)
    return groups


@dataclass(frozen=True)
class FuseQKV(GraphPass):
    name: ClassVar[str] = "fuse_qkv"

    def rewrite(self, graph: Graph) -> Graph:
        for group in _sibling_linears(graph):
            parts = ("q_proj", "k_proj", "v_proj")
            weight = concat_params(graph, [input_of(n, "weight") for n in group], parts, "qkv_proj")
            bias = (concat_params(graph, [input_of(n, "bias") for n in group], parts, "qkv_proj")
                    if input_of(group[0], "bias") is not None else None)
            inputs = named_inputs("linear", x=input_of(group[0], "x"), weight=weight, bias=bias)
            widths = [n.type.shape[-1] for n in group]
            fused_out = fresh_name(graph, "qkv")
            fused = Node("linear", inputs, attrs_for("linear"), fused_out,
                         TensorType(group[0].type.shape[:-1] + (sum(widths),), group[0].type.dtype))
            first = min(graph.nodes.index(n) for n in group)
            begin = 0
            for node, width in zip(group, widths):
                node.op, node.inputs, node.attrs = "slice", [fused_out], {"begin": begin, "end": begin + width}
                begin += width
            graph.nodes.insert(first, fused)
        return drop_unused_params(graph)
