"""A readable text form of a graph, one node per line (ir/parser.py reads it back):

    %rms_norm0 = rms_norm(%embed0, @model.norm.weight) {eps=1e-05} : f32[tokens, 64]
"""
from __future__ import annotations

from .graph import Graph
from .opdef import OPS


def _attr(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _recipe(recipe: dict) -> str:
    if "quantize" in recipe:
        group = f", group_size={recipe['group_size']}" if "group_size" in recipe else ""
        return f"{recipe['quantize']}.{recipe['part']}(@{recipe['of']}{group})"
    if "stack" in recipe:
        def expert(parts):
            joined = ", ".join("@" + n for n in parts)
            return joined if len(parts) == 1 else f"concat({joined})"
        return f"stack({', '.join(expert(parts) for parts in recipe['stack'])})"
    if "deinterleave" in recipe:
        return f"deinterleave(@{recipe['of']}, rows={recipe['deinterleave']})"
    if "absorb" in recipe:
        return f"absorb_{recipe['absorb']}(@{recipe['of']}, heads={recipe['heads']}, nope={recipe['nope']})"
    return f"concat({', '.join('@' + n for n in recipe['concat'])}, axis={recipe['axis']})"


def _shown_attrs(node) -> dict:
    """A node's attributes less those at the op's default (a float linear prints none)."""
    declared = OPS[node.op].attrs if node.op in OPS else {}
    return {k: v for k, v in node.attrs.items() if k not in declared or declared[k] != v}


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name}("]
    lines += [f"    %{name}: {ty}," for name, ty in graph.inputs.items()]
    lines.append(") {")
    lines += [f"  kv {layer} = {spec!r}" for layer, spec in graph.kv_specs.items()]
    lines += [f"  @{p.name}: {p.type}" + (f" = {_recipe(p.recipe)}" if p.recipe else "")
              for p in graph.params.values()]
    for n in graph.nodes:
        args = ", ".join("_" if i is None else (f"@{i}" if i in graph.params else f"%{i}") for i in n.inputs)
        shown = _shown_attrs(n)
        attrs = " {" + ", ".join(f"{k}={_attr(v)}" for k, v in shown.items()) + "}" if shown else ""
        lines.append(f"  %{n.output} = {n.op}({args}){attrs} : {n.type}")
    lines.append(f"  return {', '.join('%' + o for o in graph.outputs)}")
    lines.append("}")
    return "\n".join(lines)
