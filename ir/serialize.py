"""JSON round trip of a graph (weights are not part of it)."""
from __future__ import annotations

import json

from kiln.interface import KVSpec

from .graph import Graph, Node, Param
from .types import TensorType


def graph_to_json(graph: Graph) -> str:
    return json.dumps({
        "name": graph.name,
        "inputs": {k: t.to_json() for k, t in graph.inputs.items()},
        "params": {k: {**p.type.to_json(), **({"recipe": p.recipe} if p.recipe else {})}
                   for k, p in graph.params.items()},
        "nodes": [{"op": n.op, "inputs": n.inputs, "attrs": n.attrs, "output": n.output,
                   "type": n.type.to_json()} for n in graph.nodes],
        "outputs": graph.outputs,
        "kv_specs": {str(layer): spec.to_json() for layer, spec in graph.kv_specs.items()},
        "meta": graph.meta,
    }, indent=1)


def _tuplify(attrs: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}


def graph_from_json(text: str) -> Graph:
    d = json.loads(text)
    return Graph(
        name=d["name"],
        inputs={k: TensorType.from_json(t) for k, t in d["inputs"].items()},
        params={k: Param(k, TensorType.from_json(t), t.get("recipe")) for k, t in d["params"].items()},
        nodes=[Node(n["op"], n["inputs"], _tuplify(n["attrs"]), n["output"], TensorType.from_json(n["type"]))
               for n in d["nodes"]],
        outputs=d["outputs"],
        kv_specs={int(layer): KVSpec.from_json(spec) for layer, spec in d.get("kv_specs", {}).items()},
        meta=d.get("meta", {}),
    )
