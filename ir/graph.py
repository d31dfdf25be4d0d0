"""The graph: named inputs, named parameters (weights), nodes in SSA order, outputs.

Every value has one name and one TensorType. A node has exactly one output.
Parameters are declared with their type only; their data is supplied from
outside (lazily, by the frontend's weight loader), so a graph stays small.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.interface import KVSpec

from .types import TensorType


@dataclass
class Node:
    op: str
    inputs: list[str]          # names of values (graph inputs, params or node outputs)
    attrs: dict
    output: str
    type: TensorType


@dataclass
class Param:
    """A weight. With a recipe it is derived from other weights when loaded, e.g. a fused
    projection: {"concat": ["a.weight", "b.weight"], "axis": 0}."""
    name: str
    type: TensorType
    recipe: dict | None = None


@dataclass
class Graph:
    name: str
    inputs: dict[str, TensorType] = field(default_factory=dict)
    params: dict[str, Param] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    kv_specs: dict[int, KVSpec] = field(default_factory=dict)   # layer -> how its KV cache is stored
    meta: dict = field(default_factory=dict)   # free-form facts for later stages

    def value_types(self) -> dict[str, TensorType]:
        types = dict(self.inputs)
        types.update({p.name: p.type for p in self.params.values()})
        types.update({n.output: n.type for n in self.nodes})
        return types

    def producer(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.output == name), None)
