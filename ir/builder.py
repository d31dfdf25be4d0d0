"""GraphBuilder: adds inputs, params and nodes, inferring each node's type from the op table."""
from __future__ import annotations

from kiln.interface import KVSpec, pages_name, scales_name

from .graph import Graph, Node, Param
from .kv_spec import input_types
from .ops import OPS
from .types import IRError, TensorType


class GraphBuilder:
    def __init__(self, name: str):
        self.graph = Graph(name)
        self._types: dict[str, TensorType] = {}
        self._counter: dict[str, int] = {}

    def _declare(self, name: str, ty: TensorType) -> str:
        if name in self._types:
            raise IRError(f"value %{name} is defined twice")
        self._types[name] = ty
        return name

    def input(self, name: str, shape, dtype: str) -> str:
        ty = TensorType(tuple(shape), dtype)
        self.graph.inputs[name] = ty
        return self._declare(name, ty)

    def param(self, name: str, shape, dtype: str, recipe: dict | None = None) -> str:
        """A weight: read by name from the checkpoint, or made from others by `recipe` (ir/weights.py)."""
        if name in self.graph.params:  # a weight used twice (tied embeddings) is declared once
            return name
        ty = TensorType(tuple(shape), dtype)
        self.graph.params[name] = Param(name, ty, recipe)
        return self._declare(name, ty)

    def kv_cache(self, layer: int, spec: KVSpec) -> tuple[str, str | None]:
        """Declare layer `layer`'s KV cache: record its spec and add the inputs that hold it; return
        the pages' name and the scales' (None for an unquantised cache)."""
        if layer in self.graph.kv_specs:
            raise IRError(f"layer {layer}'s KV cache is declared twice")
        self.graph.kv_specs[layer] = spec
        for name, ty in input_types(spec, layer).items():
            self.input(name, ty.shape, ty.dtype)
        return pages_name(layer), (scales_name(layer) if spec.scales == "row" else None)

    def type_of(self, name: str) -> TensorType:
        return self._types[name]

    def op(self, op: str, *inputs: str | None, name: str | None = None, **attrs) -> str:
        if op not in OPS:
            raise IRError(f"unknown op {op!r}")
        opdef = OPS[op]
        if name is None:
            k = self._counter.get(op, 0)
            self._counter[op] = k + 1
            name = f"{op}{k}"
        ins = list(inputs)
        while ins and ins[-1] is None and len(ins) > len([n for n in opdef.inputs if not n.endswith("?")]):
            ins.pop()                        # an absent trailing optional input is simply left out
        in_types = [None if i is None else self._types[i] for i in ins]
        full_attrs = opdef.complete_attrs(attrs, where=f"%{name}")
        ty = opdef.infer(in_types, full_attrs, where=f"%{name} = {op}")
        self.graph.nodes.append(Node(op, ins, full_attrs, name, ty))
        return self._declare(name, ty)

    def output(self, *names: str) -> Graph:
        self.graph.outputs = list(names)
        return self.graph
