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

from .fuse_qkv import _fused_param
from .graph_pass import GraphPass
from .rewrite import drop_unused_params, fresh_name, users



def _plain_linear(node: Node | None) -> bool:
    """A linear of float weights with no residual (what the fused GEMM + gate can take)."""
    return bool(node) and node.op == "linear" and weight_format(node) == "none" and input_of(node, "residual") is None


def _match(graph: Graph, mul: Node, use: dict):
    producers = {n.output: n for n in graph.nodes}
    for act_name, up_name in (mul.inputs, mul.inputs[::-1]):
        act, up = producers.get(act_name), producers.get(up_name)
        if not (act and act.op in GATED_OPS and _plain_linear(up)):
            continue
        gate = producers.get(act.inputs[0])
        if not (_plain_linear(gate) and input_of(gate, "x") == input_of(up, "x")):
            continue
        if len(use[gate.output]) != 1 or len(use[act.output]) != 1 or len(use[up.output]) != 1:
            continue
        wg, wu = graph.params.get(input_of(gate, "weight")), graph.params.get(input_of(up, "weight"))
        if not (wg and wu) or wg.recipe or wu.recipe or wg.type != wu.type:
            continue
        if (input_of(gate, "bias") is None) != (input_of(up, "bias") is None):
            continue
        return gate, up, act
    return None


@dataclass(frozen=True)
class FuseGateUp(GraphPass):
    name: ClassVar[str] = "fuse_gate_up"

    def rewrite(self, graph: Graph) -> Graph:
        use = users(graph)
        for mul in [n for n in graph.nodes if n.op == "mul"]:
            found = _match(graph, mul, use)
            if not found:
                continue
            gate, up, act = found
            parts = ("gate_proj", "up_proj")
            weight = _fused_param(graph, [input_of(gate, "weight"), input_of(up, "weight")], parts, "gate_up_proj")
            bias = (_fused_param(graph, [input_of(gate, "bias"), input_of(up, "bias")], parts, "gate_up_proj")
                    if input_of(gate, "bias") is not None else None)
            inputs = named_inputs("linear", x=input_of(gate, "x"), weight=weight, bias=bias)
            width = gate.type.shape[-1] * 2
            fused = Node("linear", inputs, attrs_for("linear"), fresh_name(graph, "gate_up"),
                         TensorType(gate.type.shape[:-1] + (width,), gate.type.dtype))
            first = min(graph.nodes.index(gate), graph.nodes.index(up))
            for dead in (gate, up, act):
                graph.nodes.remove(dead)
            graph.nodes.insert(first, fused)
            mul.op, mul.inputs, mul.attrs = GATED_OPS[act.op], [fused.output], {}
        return drop_unused_params(graph)
