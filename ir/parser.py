"""Graphs from the text form ir/printer.py writes: `parse_graph(print_graph(g))` is `g` (less its
free-form `meta`), so a test can state a pass's input and its expected output as text.

    graph attn(
        %x: f32[tokens, 8],
    ) {
      kv 0 = KVSpec(kind='full', kv_heads=2, ...)
      @l.qkv_proj.weight: f32[16, 8] = concat(@l.q_proj.weight, @l.k_proj.weight, @l.v_proj.weight, axis=0)
      %y = linear(%x, @l.qkv_proj.weight) : f32[tokens, 16]
      return %y
    }

A node's attributes left out take the op's defaults, as the printer leaves them out; `_` is an
absent optional input.
"""
from __future__ import annotations

import ast
import re

from kiln.interface import KVSpec

from .graph import Graph, Node, Param
from .opdef import OPS
from .types import SHORT_DTYPES, IRError, TensorType

DTYPES_BY_SHORT = {short: dtype for dtype, short in SHORT_DTYPES.items()}
_TYPE = re.compile(r"(\w+)\[(.*)\]$")
_NODE = re.compile(r"%(\S+) = (\w+)\((.*?)\)(?: (\{.*\}))? : (\S+\[.*\])$")
_PARAM = re.compile(r"@(\S+): (\S+\[[^\]]*\])(?: = (.*))?$")
_KV = re.compile(r"kv (\d+) = (KVSpec\(.*\))$")


def parse_type(text: str) -> TensorType:
    """`f32[tokens, 64]` -> TensorType(("tokens", 64), "float32")."""
    match = _TYPE.match(text.strip())
    if not match or match[1] not in DTYPES_BY_SHORT:
        raise IRError(f"bad type {text!r}: expected e.g. f32[tokens, 64] with a dtype of {', '.join(DTYPES_BY_SHORT)}")
    dims = [d.strip() for d in match[2].split(",") if d.strip()]
    return TensorType(tuple(int(d) if d.isdigit() else d for d in dims), DTYPES_BY_SHORT[match[1]])


def _call(text: str, names: bool = False) -> tuple[str, list, dict]:
    """`f(3, k=v)` -> ("f", positional arguments, keywords): Python literals, nested calls as (name,
    args, keywords). With `names`, @name and %name arguments too, as strings with their sigil."""
    def value(node):
        if isinstance(node, ast.Call):
            return (node.func.id, [value(a) for a in node.args], {k.arg: value(k.value) for k in node.keywords})
        return ast.literal_eval(node)
    if names:          # names may hold dots, '+' and '@': quoted, Python's parser reads them as strings
        text = re.sub(r"([@%][^,()\s]+)", lambda m: repr(m[1]), text)
    try:
        return value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, AttributeError) as e:
        raise IRError(f"cannot read {text!r}: {e}") from None


def _param_name(arg) -> str:
    if not (isinstance(arg, str) and arg.startswith("@")):
        raise IRError(f"expected a param (@name), got {arg!r}")
    return arg[1:]


def _recipe(text: str) -> dict:
    """The printer's recipe forms back into the recipe dicts of ir/weights.py."""
    if quantized := re.match(r"(\w+)\.(\w+)\((.*)\)$", text):          # q4.codes(@w, group_size=32)
        _, args, kw = _call(f"of({quantized[3]})", names=True)
        return {"quantize": quantized[1], "part": quantized[2], "of": _param_name(args[0]), **kw}
    name, args, kw = _call(text, names=True)
    if name == "stack":
        return {"stack": [[_param_name(a) for a in arg[1]] if isinstance(arg, tuple) else [_param_name(arg)]
                          for arg in args]}
    if name == "deinterleave":
        return {"deinterleave": kw["rows"], "of": _param_name(args[0])}
    if name.startswith("absorb_"):
        return {"absorb": name.removeprefix("absorb_"), "of": _param_name(args[0]), **kw}
    if name == "concat":
        return {"concat": [_param_name(a) for a in args], "axis": kw["axis"]}
    raise IRError(f"unknown recipe {text!r}")


def _node(line: str) -> Node:
    match = _NODE.match(line)
    if not match:
        raise IRError(f"bad node line {line!r}: expected %out = op(%a, @w, _) {{attr=value}} : type")
    output, op, args, attrs, ty = match.groups()
    if op not in OPS:
        raise IRError(f"unknown op {op!r} in {line!r}")
    inputs = []
    for arg in (a.strip() for a in args.split(",") if a.strip()):
        if arg == "_":
            inputs.append(None)
        elif arg[0] in "%@":
            inputs.append(arg[1:])
        else:
            raise IRError(f"bad input {arg!r} in {line!r}: expected %value, @param or _")
    given = _call(f"attrs({attrs[1:-1]})")[2] if attrs else {}
    return Node(op, inputs, {**OPS[op].attrs, **{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}},
                output, parse_type(ty))


def parse_graph(text: str) -> Graph:
    """A Graph from print_graph's text (see the module docstring)."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    header = re.match(r"graph (\S+)\($", lines[0]) if lines else None
    if not header:
        raise IRError(f"a graph's text starts with 'graph NAME(', not {lines[:1]}")
    graph = Graph(header[1])
    i = 1
    while lines[i].strip() != ") {":
        name, ty = lines[i].strip().rstrip(",").split(": ", 1)
        graph.inputs[name.removeprefix("%")] = parse_type(ty)
        i += 1
    for line in lines[i + 1:]:
        line = line.strip()
        if line == "}":
            break
        if line.startswith("return"):
            graph.outputs = [o.strip().removeprefix("%") for o in line.removeprefix("return").split(",") if o.strip()]
        elif kv := _KV.match(line):
            _, _, fields = _call(kv[2])
            graph.kv_specs[int(kv[1])] = KVSpec(**fields)
        elif param := _PARAM.match(line):
            graph.params[param[1]] = Param(param[1], parse_type(param[2]), _recipe(param[3]) if param[3] else None)
        else:
            graph.nodes.append(_node(line))
    return graph
