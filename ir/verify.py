"""The verifier: every value defined once before use, every node's type equal to its op's type rule."""
from __future__ import annotations

from kiln.interface import pages_name, scales_name

from .graph import Graph
from .kv_spec import input_types
from .ops import APPEND_OPS, KV_OPS, LATENT_OPS, OPS
from .types import IRError


def verify(graph: Graph) -> Graph:
    """Check `graph` and return it; raise IRError naming the first node and rule that fail."""
    defined = dict(graph.inputs)
    for p in graph.params.values():
        if p.name in defined:
            raise IRError(f"param @{p.name} clashes with an input of the same name")
        defined[p.name] = p.type
    for node in graph.nodes:
        where = f"%{node.output} = {node.op}"
        if node.op not in OPS:
            raise IRError(f"{where}: unknown op {node.op!r}")
        for name in node.inputs:
            if name is not None and name not in defined:
                raise IRError(f"{where}: input %{name} is used before it is defined")
        opdef = OPS[node.op]
        attrs = opdef.complete_attrs(node.attrs, where)
        if attrs != node.attrs:
            raise IRError(f"{where}: attributes {node.attrs} differ from the op's declared set {sorted(opdef.attrs)}")
        expected = opdef.infer([None if i is None else defined[i] for i in node.inputs], node.attrs, where)
        if expected != node.type:
            raise IRError(f"{where}: declared type {node.type} but the type rule gives {expected}")
        if node.output in defined:
            raise IRError(f"{where}: %{node.output} is defined twice")
        defined[node.output] = node.type
    _verify_kv_caches(graph)
    for out in graph.outputs:
        if out not in defined:
            raise IRError(f"output %{out} is not defined")
    if not graph.outputs:
        raise IRError(f"graph {graph.name} has no outputs")
    return graph


def _verify_kv_caches(graph: Graph) -> None:
    """Each KV op reads its layer's declared cache, typed as that layer's KVSpec says: the pages
    themselves, or (paged_attend, mla_attend, latent_attend) the pages an append of the same layer
    has just written. Latent ops read latent specs only, the others anything else."""
    appended: dict[str, int] = {}                # kv_append result -> its layer
    for node in graph.nodes:
        if node.op not in KV_OPS:
            continue
        layer = node.attrs["layer"]
        where = f"%{node.output} = {node.op} {{layer={layer}}}"
        spec = graph.kv_specs.get(layer)
        if spec is None:
            raise IRError(f"{where}: layer {layer} has no KV spec (declare its cache with GraphBuilder.kv_cache)")
        cache = [pages_name(layer)] + ([scales_name(layer)] if spec.scales == "row" else [])
        reads = [OPS[node.op].input_of(node, name) for name in ("kv_pages", "kv_scales")]
        reads = [name for name in reads if name is not None]
        if (node.op in LATENT_OPS) != (spec.kind == "latent"):
            raise IRError(f"{where}: layer {layer}'s KV spec is {spec.kind}, which this op does not read")
        if node.op not in APPEND_OPS and appended.get(reads[0]) == layer:
            reads[0] = pages_name(layer)         # the layer's pages, as its append left them
        if reads != cache:
            raise IRError(f"{where}: reads KV inputs {reads}, its layer's cache is {cache}")
        if node.op in APPEND_OPS:
            appended[node.output] = layer
        elif node.attrs.get("window", 0) != (spec.window or 0):
            raise IRError(f"{where}: window {node.attrs['window']} differs from layer {layer}'s KV spec "
                          f"({spec.kind}{f', window {spec.window}' if spec.window else ''})")
        for name, ty in input_types(spec, layer).items():
            if graph.inputs.get(name) != ty:
                raise IRError(f"{where}: input %{name} is {graph.inputs.get(name)}, layer {layer}'s KV spec says {ty}")
