"""add_lora: the projections adapters may reach get a lora op after them, reading stacked adapter slots.

Rewrite (max_loras S, max_rank R; a fused projection of P parts stacks P·R rank rows):
    %qkv = linear(%x, @w.qkv[, ...])                     @w.qkv = concat(q, k, v)
  ->
    %qkv.base0 = linear(%x, @w.qkv[, ...])
    %qkv = lora(%qkv.base0, %x, %lora_a.<module>, %lora_b.<module>, %lora_slots)
           {modules=(…q_proj, …k_proj, …v_proj), rows=(Nq, Nk, Nv), rank=R}
    %lora_a.<module>: [S, P·R, in]   %lora_b.<module>: [S, R, out]   %lora_slots: i32[tokens]   (new inputs,
    the adapters in `dtype`, else the projection's)
The runtime writes each slot's rows from a PEFT adapter (runtime/lora.py) and each step's row slots.
Requires: the linear's weight is a checkpoint projection (q, k, v, o, gate, up, down: plain, or fused by
  fuse_qkv / fuse_gate_up, whose output the slices or the gated activation split in concat order). The
  LM head, embeddings, MoE experts and routers, MLA's projections and pre-fused checkpoints (Phi-3's
  qkv_proj) get no adapters.
Leaves: %qkv keeps its name and type, so consumers are unchanged; the linear's kernel, format and residual
  too (the lora term is added after any residual: the sum is the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.interface import LORA_SLOTS, LoRALayout, LoRASite, lora_input_names
from kiln.ir import Graph, Node, TensorType, attrs_for, input_of

from .graph_pass import GraphPass
from .rewrite import fresh_name, users
from .tensor_classes import PROJECTIONS, tensor_classes


def _part_rows(node: Node, parts: list[str], readers: list[Node]) -> tuple[int, ...] | None:
    """Each part's output rows of a (fused) projection, from how its output is split; None: unknown."""
    n_out = node.type.shape[-1]
    if len(parts) == 1:
        return (n_out,)
    if readers and all(r.op == "slice" for r in readers):
        spans = sorted((r.attrs["begin"], r.attrs["end"]) for r in readers)
        if len(spans) == len(parts) and spans[0][0] == 0 and spans[-1][1] == n_out and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return tuple(end - begin for begin, end in spans)
    if len(parts) == 2 and readers and all(r.op in ("swiglu", "geglu") for r in readers):
        return (n_out // 2, n_out // 2)
    return None


def is_adaptable(weight: str) -> bool:
    """A checkpoint weight adapters may target: a decoder layer's q/k/v/o/gate/up/down projection."""
    classes = tensor_classes(weight)
    return bool(classes) and classes[0] in PROJECTIONS.values() and ".layers." in weight


@dataclass(frozen=True)
class AddLoRA(GraphPass):
    name: ClassVar[str] = "add_lora"
    max_loras: int = 1
    max_rank: int = 16
    dtype: str | None = None      # the adapter slots' dtype (None: the projection's)

    def rewrite(self, graph: Graph) -> Graph:
        readers = users(graph)
        graph.inputs[LORA_SLOTS] = TensorType(("tokens",), "int32")
        for node in list(graph.nodes):
            weight = input_of(node, "weight") if node.op == "linear" else None
            if weight not in graph.params:
                continue
            parts = (graph.params[weight].recipe or {}).get("concat", [weight])
            rows = _part_rows(node, parts, readers[node.output])
            if rows is None or not all(is_adaptable(p) for p in parts):
                continue
            modules = tuple(p.removesuffix(".weight") for p in parts)
            a, b = lora_input_names(weight.removesuffix(".weight"))
            rank_rows, n_in = self.max_rank * len(parts), graph.value_types()[input_of(node, "x")].shape[-1]
            dtype = self.dtype or node.type.dtype
            graph.inputs[a] = TensorType((self.max_loras, rank_rows, n_in), dtype)
            graph.inputs[b] = TensorType((self.max_loras, self.max_rank, node.type.shape[-1]), dtype)
            out, node.output = node.output, fresh_name(graph, f"{node.output}.base")
            lora = Node("lora", [node.output, input_of(node, "x"), a, b, LORA_SLOTS],
                        attrs_for("lora", modules=modules, rows=rows, rank=self.max_rank), out, node.type)
            graph.nodes.insert(graph.nodes.index(node) + 1, lora)
        return graph


def lora_layout(graph: Graph) -> LoRALayout | None:
    """The adapter slots of a graph add_lora rewrote (None: it has none), as the manifest records them."""
    nodes = [n for n in graph.nodes if n.op == "lora"]
    if not nodes:
        return None
    a = graph.inputs[input_of(nodes[0], "a")]
    sites = tuple(LoRASite(input_of(n, "a"), input_of(n, "b"), tuple(n.attrs["modules"]), tuple(n.attrs["rows"]),
                           graph.inputs[input_of(n, "a")].shape[2]) for n in nodes)
    return LoRALayout(a.shape[0], nodes[0].attrs["rank"], a.dtype, sites)
