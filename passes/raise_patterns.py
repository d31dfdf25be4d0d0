"""raise_patterns: the rewrites that bring a graph imported node by node (frontend/onnx_graph.py) to the form
kiln's fusions and kernels expect, which the HF and GGUF frontends give directly. First in every pipeline;
nothing to do on their graphs.

Rewrites:
    %s = sigmoid(%x)   %y = mul(%x, %s)   (or mul(%s, %x))          ->   %y = silu(%x)
  SiLU as exporters spell it; requires %s to have no other reader.
    %n = rms_norm(%x, @w)   %r = take_rows(%n, %rows)   ->   %t = take_rows(%x, %rows)   %r = rms_norm(%t, @w)
  the final norm on the rows whose logits are wanted only (ONNX graphs norm every token); requires %n to have no
  other reader.
Leaves: each rewritten node's output keeps its name, so its readers are unchanged. A sigmoid no rule raised is
refused (no target lowers one), naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import KilnError
from kiln.ir import Graph, Node, TensorType

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules
from .rewrite import drop_dead_nodes, fresh_name

SILU = Pat("mul", {"a": "x", "b": Pat("sigmoid", {"x": "x"}, name="sigmoid", sole=True)}, name="mul",
           either_order=True)
ROWS_OF_NORM = Pat("take_rows", {"x": Pat("rms_norm", {"x": "x"}, name="norm", sole=True), "rows": "rows"},
                   name="take")


def _silu(graph: Graph, found: Match) -> None:
    mul = found["mul"]
    graph.nodes.remove(found["sigmoid"])
    mul.op, mul.inputs, mul.attrs = "silu", [found["x"]], {}


def _rows_first(graph: Graph, found: Match) -> None:
    norm, take = found["norm"], found["take"]
    rows = Node("take_rows", [found["x"], found["rows"]], {}, fresh_name(graph, "rows"),
                TensorType(take.type.shape, norm.type.dtype))
    index = graph.nodes.index(norm)
    graph.nodes.insert(index, rows)
    graph.nodes.remove(norm)
    norm.inputs = [rows.output, *norm.inputs[1:]]
    norm.output, norm.type = take.output, take.type
    graph.nodes[graph.nodes.index(take)] = norm


@dataclass(frozen=True)
class RaisePatterns(GraphPass):
    name: ClassVar[str] = "raise_patterns"

    def rewrite(self, graph: Graph) -> Graph:
        apply_rules(graph, [Rule(SILU, _silu), Rule(ROWS_OF_NORM, _rows_first)])
        left = next((n for n in graph.nodes if n.op == "sigmoid"), None)
        if left is not None:
            raise KilnError(f"%{left.output} = sigmoid(%{left.inputs[0]}) is not part of a SiLU (x · sigmoid(x)); "
                            "kiln raises no other sigmoid")
        return drop_dead_nodes(graph)

