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
from .rewrite import users


@dataclass(frozen=True)
class FuseResidualAdd(GraphPass):
    name: ClassVar[str] = "fuse_residual_add"

    def rewrite(self, graph: Graph) -> Graph:
        use = users(graph)
        producers = {n.output: n for n in graph.nodes}
        for add in [n for n in graph.nodes if n.op == "add"]:
            for proj_name, residual in (add.inputs, add.inputs[::-1]):
                proj = producers.get(proj_name)
                if not proj or proj.op != "linear" or len(use[proj_name]) != 1 or input_of(proj, "residual"):
                    continue
                add.op, add.attrs = "linear", dict(proj.attrs)
                add.inputs = named_inputs("linear", x=input_of(proj, "x"), weight=input_of(proj, "weight"),
                                          scale=input_of(proj, "scale"), bias=input_of(proj, "bias"), residual=residual)
                graph.nodes.remove(proj)
                break
        return graph
