"""fuse_gate_up: the gate and up projections become one GEMM followed by swiglu (or geglu).

Rewrite:
    %g = linear(%x, @wg)   %u = linear(%x, @wu)   %s = silu(%g)   %y = mul(%s, %u)   (or mul(%u, %s))
  ->
    %gu = linear(%x, @wgu)   %y = swiglu(%gu)        @wgu = concat(@wg, @wu, axis=0)
and the same with gelu_tanh in place of silu, giving geglu.
Requires: %g and %s (the activation) used only on this path, both linears read %x with plain weight params of the
  same shape and dtype (not quantised), no residual, neither or both with a bias.
Leaves: %y keeps its name, so its consumers are unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node, TensorType, attrs_for, input_of, named_inputs, weight_format
from kiln.ir.ops import GATED_OPS

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules
from .rewrite import concat_params, drop_unused_params, fresh_name


def _plain_linear(node: Node) -> bool:
    """A linear of float weights with no residual (what the fused GEMM + gate can take)."""
    return weight_format(node) == "none" and input_of(node, "residual") is None


GATED_PROJECTIONS = Pat("mul", {
    "a": Pat(tuple(GATED_OPS), {"x": Pat("linear", {"x": "x"}, name="gate", sole=True, test=_plain_linear)},
             name="act", sole=True),
    "b": Pat("linear", {"x": "x"}, name="up", sole=True, test=_plain_linear)}, name="mul", either_order=True)


def _same_weights(graph: Graph, found: Match) -> bool:
    gate, up = found["gate"], found["up"]
    wg, wu = graph.params.get(input_of(gate, "weight")), graph.params.get(input_of(up, "weight"))
    if not (wg and wu) or wg.recipe or wu.recipe or wg.type != wu.type:
        return False
    return (input_of(gate, "bias") is None) == (input_of(up, "bias") is None)


def _fuse(graph: Graph, found: Match) -> None:
    gate, up, act, mul = found["gate"], found["up"], found["act"], found["mul"]
    parts = ("gate_proj", "up_proj")
    weight = concat_params(graph, [input_of(gate, "weight"), input_of(up, "weight")], parts, "gate_up_proj")
    bias = (concat_params(graph, [input_of(gate, "bias"), input_of(up, "bias")], parts, "gate_up_proj")
            if input_of(gate, "bias") is not None else None)
    inputs = named_inputs("linear", x=found["x"], weight=weight, bias=bias)
    width = gate.type.shape[-1] * 2
    fused = Node("linear", inputs, attrs_for("linear"), fresh_name(graph, "gate_up"),
                 TensorType(gate.type.shape[:-1] + (width,), gate.type.dtype))
    first = min(graph.nodes.index(gate), graph.nodes.index(up))
    for dead in (gate, up, act):
        graph.nodes.remove(dead)
    graph.nodes.insert(first, fused)
    mul.op, mul.inputs, mul.attrs = GATED_OPS[act.op], [fused.output], {}


@dataclass(frozen=True)
class FuseGateUp(GraphPass):
    name: ClassVar[str] = "fuse_gate_up"

    def rewrite(self, graph: Graph) -> Graph:
        apply_rules(graph, [Rule(GATED_PROJECTIONS, _fuse, where=_same_weights)])
        return drop_unused_params(graph)
