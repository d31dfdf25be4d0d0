"""fuse_residual_add: a residual add after a projection moves into the projection's epilogue.

Rewrite:
    %t = linear(%x, @w[, @b])   %h = add(%r, %t)   (or add(%t, %r))
  ->
    %h = linear(%x, @w, _, @b or _, %r)      (a quantised linear keeps its scale and format)
Requires: %t is used only by the add, and the linear has no residual yet.
Leaves: %h keeps its name and position (after %r and %x are defined), so consumers are unchanged.
The numbers are the same: the linear rounds its product to the dtype before adding the residual.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, input_of, named_inputs

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules

PROJECTION_THEN_ADD = Pat("add", {"a": Pat("linear", {"residual": None}, name="proj", sole=True), "b": "residual"},
                          name="add", either_order=True)


def _into_epilogue(graph: Graph, found: Match) -> None:
    add, proj = found["add"], found["proj"]
    add.op, add.attrs = "linear", dict(proj.attrs)
    add.inputs = named_inputs("linear", x=input_of(proj, "x"), weight=input_of(proj, "weight"),
                              scale=input_of(proj, "scale"), bias=input_of(proj, "bias"), residual=found["residual"])
    graph.nodes.remove(proj)


@dataclass(frozen=True)
class FuseResidualAdd(GraphPass):
    name: ClassVar[str] = "fuse_residual_add"

    def rewrite(self, graph: Graph) -> Graph:
        apply_rules(graph, [Rule(PROJECTION_THEN_ADD, _into_epilogue)])
        return graph
