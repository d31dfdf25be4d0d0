"""raise_patterns: the rewrites that bring a graph imported node by node (frontend/onnx_graph.py) to the form
kiln's fusions and kernels expect, which the HF and GGUF frontends give directly. First in every pipeline;
nothing to do on their graphs.

Rewrites (each result keeps the name of the node it replaces, so its readers are unchanged):
  SiLU       %s = sigmoid(%x)   %y = mul(%x, %s)                                   ->  %y = silu(%x)
             (%s read by nothing else)
  SwiGLU     %y = mul(silu(slice(%x)[0:N]), slice(%x)[N:2N])  (%x [.., 2N])     ->  %y = swiglu(%x)
             (a pre-fused gate/up projection split in two; the silu read by nothing else)
  RMSNorm    %q = mul(%x, %x)   %m = mean_last(%q)   %e = add_scalar(%m) {eps}   %r = sqrt(%e)
             %i = reciprocal(%r)   %n = bcast_mul(%x, %i)   %y = bcast_mul(%n, @w)  ->  %y = rms_norm(%x, @w) {eps}
  rope       %a = bcast_mul(%x, reshape(cos(%t)))   %h = concat(mul_scalar(slice(%x)[D/2:D]) {-1}, slice(%x)[0:D/2])
             %y = add(%a, bcast_mul(%h, reshape(sin(%t))))   with %t = concat(%f, %f),
             %f = bcast_mul(cast(reshape(%positions)), @inv), %x [tokens, H, D]
               ->  %y = reshape(rope(reshape(%x) [tokens, H·D], %positions, @inv) {head_dim=D}) [tokens, H, D]
  reshapes   %y = reshape(reshape(%x))  ->  %y = reshape(%x); a reshape to its input's own type is dropped
  rows       %n = rms_norm(%x, @w)   %r = take_rows(%n, %rows)  ->  %t = take_rows(%x, %rows)   %r = rms_norm(%t, @w)
             (%n read by nothing else: the final norm on the rows whose logits are wanted only)
Rules run until none fires. An op of ir/imported_ops.py still in the graph then has no kernel: it is refused,
named.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import KilnError
from kiln.ir import Graph, Node, TensorType, attrs_for
from kiln.ir.imported_ops import IMPORTED_OPS

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules
from .rewrite import drop_dead_nodes, fresh_name

SILU = Pat("mul", {"a": "x", "b": Pat("sigmoid", {"x": "x"}, name="sigmoid", sole=True)}, name="mul",
           either_order=True)
SWIGLU = Pat("mul", {"a": Pat("silu", {"x": Pat("slice", {"x": "x"}, name="gate")}, name="act", sole=True),
                     "b": Pat("slice", {"x": "x"}, name="up")}, name="out", either_order=True)
RMS_NORM = Pat("bcast_mul", {"a": Pat("bcast_mul", {"a": "x", "b": Pat("reciprocal", {"x": Pat("sqrt", {"x": Pat(
    "add_scalar", {"x": Pat("mean_last", {"x": Pat("mul", {"a": "x", "b": "x"})})}, name="eps")})})},
    either_order=True), "b": "weight"}, name="out")
_TURN = Pat("concat", {"a": Pat("mul_scalar", {"x": Pat("slice", {"x": "x"}, name="hi")}, name="neg"),
                       "b": Pat("slice", {"x": "x"}, name="lo")})
ROPE = Pat("add", {"a": Pat("bcast_mul", {"a": "x", "b": Pat("reshape", {"x": Pat("cos", {"x": "angles"})})}),
                   "b": Pat("bcast_mul", {"a": _TURN, "b": Pat("reshape", {"x": Pat("sin", {"x": "angles"})})})},
           name="out", either_order=True)
RESHAPE = Pat("reshape", {"x": "x"}, name="out")
ROWS_OF_NORM = Pat("take_rows", {"x": Pat("rms_norm", {"x": "x"}, name="norm", sole=True), "rows": "rows"},
                   name="take")


def _silu(graph: Graph, found: Match) -> None:
    mul = found["mul"]
    graph.nodes.remove(found["sigmoid"])
    mul.op, mul.inputs, mul.attrs = "silu", [found["x"]], {}


def _halves(graph: Graph, found: Match) -> bool:
    n = graph.value_types()[found["x"]].shape[-1] // 2
    return (found["gate"].attrs["begin"], found["gate"].attrs["end"], found["up"].attrs["begin"],
            found["up"].attrs["end"]) == (0, n, n, 2 * n)


def _swiglu(graph: Graph, found: Match) -> None:
    out = found["out"]
    graph.nodes.remove(found["act"])
    out.op, out.inputs, out.attrs = "swiglu", [found["x"]], {}


def _is_param(graph: Graph, found: Match) -> bool:
    return found["weight"] in graph.params and graph.params[found["weight"]].type.shape == \
        (graph.value_types()[found["x"]].shape[-1],)


def _rms_norm(graph: Graph, found: Match) -> None:
    out = found["out"]
    out.op, out.inputs = "rms_norm", [found["x"], found["weight"]]
    out.attrs = attrs_for("rms_norm", eps=float(found["eps"].attrs["value"]))


def _rope_angles(graph: Graph, found: Match) -> tuple[str, str] | None:
    """(positions, inverse frequencies) where %angles is concat(%f, %f), %f = bcast_mul(cast(reshape(%positions)),
    @inv) of the step's positions and a param."""
    producers = {n.output: n for n in graph.nodes}
    cat = producers.get(found["angles"])
    if cat is None or cat.op != "concat" or cat.inputs[0] != cat.inputs[1]:
        return None
    f = producers.get(cat.inputs[0])
    cast = producers.get(f.inputs[0]) if f is not None and f.op == "bcast_mul" else None
    shaped = producers.get(cast.inputs[0]) if cast is not None and cast.op == "cast" else None
    if shaped is None or shaped.op != "reshape" or shaped.inputs[0] != "positions" or f.inputs[1] not in graph.params:
        return None
    return "positions", f.inputs[1]


def _is_rope(graph: Graph, found: Match) -> bool:
    x = graph.value_types()[found["x"]]
    d = x.shape[-1]
    hi, lo, neg = found["hi"].attrs, found["lo"].attrs, found["neg"].attrs
    halves = (lo["begin"], lo["end"], hi["begin"], hi["end"]) == (0, d // 2, d // 2, d)
    return x.rank == 3 and halves and neg["value"] == -1.0 and _rope_angles(graph, found) is not None


def _rope(graph: Graph, found: Match) -> None:
    out, x = found["out"], found["x"]
    tokens, heads, d = graph.value_types()[x].shape
    positions, inv = _rope_angles(graph, found)
    flat = TensorType((tokens, heads * d), out.type.dtype)
    rows = Node("reshape", [x], {"shape": flat.shape}, fresh_name(graph, "heads_flat"), flat)
    turned = Node("rope", [rows.output, positions, inv], attrs_for("rope", head_dim=d), fresh_name(graph, "rope"),
                  flat)
    index = graph.nodes.index(out)
    graph.nodes[index:index] = [rows, turned]
    out.op, out.inputs, out.attrs = "reshape", [turned.output], {"shape": out.type.shape}


def _inner(graph: Graph, value: str) -> Node | None:
    node = next((n for n in graph.nodes if n.output == value), None)
    return node if node is not None and node.op == "reshape" else None


def _needless(graph: Graph, found: Match) -> bool:
    return graph.value_types()[found["x"]] == found["out"].type or _inner(graph, found["x"]) is not None


def _reshapes(graph: Graph, found: Match) -> None:
    out, x = found["out"], found["x"]
    if graph.value_types()[x] != out.type:
        out.inputs = [_inner(graph, x).inputs[0]]
        return
    graph.nodes.remove(out)                  # a view of x as x is: its readers read x
    for node in graph.nodes:
        node.inputs = [x if i == out.output else i for i in node.inputs]
    graph.outputs = [x if o == out.output else o for o in graph.outputs]


def _rows_first(graph: Graph, found: Match) -> None:
    norm, take = found["norm"], found["take"]
    rows = Node("take_rows", [found["x"], found["rows"]], {}, fresh_name(graph, "rows"),
                TensorType(take.type.shape, norm.type.dtype))
    index = graph.nodes.index(norm)
    graph.nodes.insert(index, rows)
    graph.nodes.remove(norm)
    norm.inputs = [rows.output, *norm.inputs[1:]]
    norm.output, norm.type = take.output, take.type
    graph.nodes[graph.nodes.index(take)] = norm


RULES = [Rule(SILU, _silu), Rule(SWIGLU, _swiglu, where=_halves), Rule(RMS_NORM, _rms_norm, where=_is_param),
         Rule(ROPE, _rope, where=_is_rope), Rule(RESHAPE, _reshapes, where=_needless),
         Rule(ROWS_OF_NORM, _rows_first)]


@dataclass(frozen=True)
class RaisePatterns(GraphPass):
    name: ClassVar[str] = "raise_patterns"

    def rewrite(self, graph: Graph) -> Graph:
        while apply_rules(graph, RULES):
            drop_dead_nodes(graph)
        graph = drop_dead_nodes(graph)
        left = next((n for n in graph.nodes if n.op in IMPORTED_OPS), None)
        if left is not None:
            args = ", ".join(f"%{i}" for i in left.inputs)
            raise KilnError(f"%{left.output} = {left.op}({args}) is part of no pattern kiln raises (its "
                            f"{'SiLU, ' if left.op == 'sigmoid' else ''}RMSNorm or rotary embedding); no target "
                            "lowers it")
        return graph

