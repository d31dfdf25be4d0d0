"""quantize: projections read int8 weights with per-channel scales (weight-only quantisation).

Rewrite (mode q8):
    %y = linear(%x, @w[, @b][, %r])
  ->
    %y = linear_q8(%x, @w.q8, @w.q8_scale[, @b][, %r])
        @w.q8 = q8.q(@w)   @w.q8_scale = q8.scale(@w)      (computed once, when weights are written)
Requires: the weight is a param (plain or fused); the LM head (the linear producing the graph's
  logits) only when `lm_head` is set. Embedding tables are never touched.
Leaves: %y keeps its name and type; the float weight param is dropped once no node reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Param, TensorType
from kiln.ir.quant import SCHEMES

from .rewrite import drop_unused_params, editable_copy


@dataclass
class Quantize:
    mode: str = "q8"
    lm_head: bool = True

    def __post_init__(self):
        if self.mode not in SCHEMES:
            raise ValueError(f"unknown quantisation mode {self.mode!r} (known: {', '.join(SCHEMES)})")

    def _lm_head_nodes(self, graph: Graph) -> set[str]:
        """The linear whose result becomes the logits (through casts only)."""
        producers = {n.output: n for n in graph.nodes}
        heads, todo = set(), list(graph.outputs)
        while todo:
            node = producers.get(todo.pop())
            if node is None:
                continue
            if node.op == "cast":
                todo.append(node.inputs[0])
            elif node.op == "linear":
                heads.add(node.output)
        return heads

    def __call__(self, graph: Graph) -> Graph:
        graph = editable_copy(graph)
        scheme = SCHEMES[self.mode]
        skip = set() if self.lm_head else self._lm_head_nodes(graph)
        for node in graph.nodes:
            if node.op != "linear" or node.output in skip or node.inputs[1] not in graph.params:
                continue
            w = graph.params[node.inputs[1]]
            q_name, s_name = f"{w.name}.{self.mode}", f"{w.name}.{self.mode}_scale"
            graph.params.setdefault(q_name, Param(q_name, TensorType(w.type.shape, scheme.weight_dtype),
                                                  {"quantize": self.mode, "of": w.name, "part": "q"}))
            graph.params.setdefault(s_name, Param(s_name, TensorType((w.type.shape[0],), "float32"),
                                                  {"quantize": self.mode, "of": w.name, "part": "scale"}))
            extras = node.inputs[2:]
            node.op, node.inputs = f"linear_{self.mode}", [node.inputs[0], q_name, s_name, *extras]
        return drop_unused_params(graph)
