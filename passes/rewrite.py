"""Small helpers the passes share: who uses a value, fresh names, dropping params no node reads."""
from __future__ import annotations

import copy
from collections import defaultdict

from kiln.ir import Graph, Node, Param, TensorType
from kiln.ir.ops import OPS
from kiln.ir.weights import recipe_sources


def editable_copy(graph: Graph) -> Graph:
    """Passes rewrite a copy: the graph they were given stays as it was (tests compare the two)."""
    return copy.deepcopy(graph)


def users(graph: Graph) -> dict[str, list[Node]]:
    """value name -> the nodes that read it (graph outputs count as a user with op 'return')."""
    out: dict[str, list[Node]] = defaultdict(list)
    for node in graph.nodes:
        for name in node.inputs:
            if name is not None:
                out[name].append(node)
    for name in graph.outputs:
        out[name].append(Node("return", [name], {}, "", None))
    return out


def fresh_name(graph: Graph, base: str) -> str:
    taken = set(graph.value_types())
    k = 0
    while f"{base}{k}" in taken:
        k += 1
    return f"{base}{k}"


def drop_unused_params(graph: Graph) -> Graph:
    """Keep the params some node reads, and the derived params their recipes are made from
    (plain weights need no entry: the loader reads them from the checkpoint by name)."""
    keep = {name for node in graph.nodes for name in node.inputs}
    todo = [n for n in keep if n in graph.params]
    while todo:
        recipe = graph.params[todo.pop()].recipe or {}
        for source in recipe_sources(recipe):
            if source in graph.params and graph.params[source].recipe and source not in keep:
                keep.add(source)
                todo.append(source)
    graph.params = {k: p for k, p in graph.params.items() if k in keep}
    return graph


def fused_param_name(names: list[str], parts: tuple[str, ...], fused: str) -> str:
    """Name of a param concatenated from `names`: '…q_proj.weight' (+k, v) -> '…qkv_proj.weight'
    when the names follow that pattern, else the names joined with '+'."""
    if parts[0] in names[0] and all(n == names[0].replace(parts[0], p) for n, p in zip(names, parts)):
        return names[0].replace(parts[0], fused)
    return "+".join(names)


def concat_params(graph: Graph, names: list[str], parts: tuple[str, ...], fused: str) -> str:
    """Add the param whose data is `names` concatenated on axis 0 (made when weights load); its name."""
    params = [graph.params[n] for n in names]
    name = fused_param_name(names, parts, fused)
    shape = (sum(p.type.shape[0] for p in params),) + params[0].type.shape[1:]
    graph.params[name] = Param(name, TensorType(shape, params[0].type.dtype), {"concat": names, "axis": 0})
    return name


def drop_dead_nodes(graph: Graph) -> Graph:
    """Remove nodes whose result nothing reads (a node that writes an input in place stays)."""
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if node.output in live or OPS[node.op].mutates:
            kept.append(node)
            live.update(i for i in node.inputs if i is not None)
    graph.nodes = kept[::-1]
    return graph
