"""specialize_mla: absorb kv_b_proj into the query and the output, so attention runs over the latent
cache itself instead of keys and values rebuilt from it.

Rewrite (H heads, N no-rope and P rope dims, V value dims, R = kv_lora_rank):
    %o = mla_attend(%q_nope, %q_rope, %pages, @kv_b, …) {layer, scale}       @kv_b: [H (N + V), R]
  ->
    %q_latent = head_linear(%q_nope, @kv_b.absorb_k)      @kv_b.absorb_k = W_UK [H, N, R]
    %o_latent = latent_attend(%q_latent, %q_rope, %pages, …) {layer, scale}
    %o        = head_linear(%o_latent, @kv_b.absorb_v)    @kv_b.absorb_v = W_UV [H, R, V]
W_UK and W_UV are kv_b's per-head key and value rows, split by "absorb" weight recipes
(ir/weights.py) when weights are written. q_nope · k_nope = (q_nope W_UK) · c for every stored c,
and the value mix Σ p (c W_UV) = (Σ p c) W_UV: attention becomes MQA with one R + P wide key row
and an R wide value per token, read once for every head, and the expanded K/V never exist.
In exact arithmetic the result is the same; rounding differs by where the products are rounded
(the literal form rounds k_nope and v, the absorbed form q_latent and o_latent).
With `expanded_from` = n (a target's choice: where its kernels make the expanded form cheaper),
prefill steps whose every sequence brings at least n new tokens run the expanded form instead:
    %rows       = latent_gather(%pages, %kv_slots) {layer, dtype}           every context row
    %kv         = linear(slice(%rows, 0:R), @kv_b)                          K_nope and V, rebuilt
    %o_expanded = expanded_attend(%q_nope, %q_rope, %kv, %rows, %q_indptr, %kv_indptr) {layer, scale}
    %o          = step_choice(%o_absorbed, %o_expanded, %q_indptr) {min_tokens=n}
(ir/step_forms.py; kv_slots and kv_indptr become graph inputs). Expanded, kv_b is applied once per
context row instead of twice per query token, and attention runs at N + P and V wide instead of
R + P and R: fewer operations once a chunk is long (docs/BENCHMARKS.md measures where).
Requires: kv_b is a param (a weight the rewrite can split).
Leaves: the output keeps its name and type; kv_b is no longer read unless the expanded form reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import KilnError
from kiln.ir import Graph, Node, Param, TensorType, attrs_for, input_of, named_inputs
from kiln.ir.mla_ops import PAGE_INDICES
from kiln.ir.step_forms import CONTEXT_INPUTS

from .graph_pass import GraphPass
from .rewrite import drop_unused_params


@dataclass(frozen=True)
class SpecializeMLA(GraphPass):
    name: ClassVar[str] = "specialize_mla"
    expanded_from: int = 0          # new tokens per sequence from which prefill steps run expanded (0: never)

    def __post_init__(self):
        if self.expanded_from == 1 or self.expanded_from < 0:
            raise KilnError(f"the expanded MLA form starts at 2 or more new tokens per sequence (0: never), "
                            f"not {self.expanded_from}: decode steps always run the absorbed form")

    def rewrite(self, graph: Graph) -> Graph:
        return _specialize(graph, self.expanded_from)


def _expanded(node: Node, types, rank: int) -> list[Node]:
    """The expanded form of one mla_attend, its result named o_expanded{layer}."""
    q_nope, q_rope, pages, kv_b, q_indptr = (input_of(node, name) for name in ("q_nope", "q_rope", "kv_pages",
                                                                                 "kv_b", "q_indptr"))
    layer, dtype = node.attrs["layer"], node.type.dtype
    width = types[pages].shape[4]
    rows, latent, kv = f"latent_rows{layer}", f"c_rows{layer}", f"kv_rows{layer}"
    return [
        Node("latent_gather", named_inputs("latent_gather", kv_pages=pages, kv_slots="kv_slots",
                                           kv_scales=input_of(node, "kv_scales")),
             attrs_for("latent_gather", layer=layer, dtype=dtype), rows, TensorType(("kv_tokens", width), dtype)),
        Node("slice", [rows], {"begin": 0, "end": rank}, latent, TensorType(("kv_tokens", rank), dtype)),
        Node("linear", [latent, kv_b], attrs_for("linear"), kv, TensorType(("kv_tokens", types[kv_b].shape[0]), dtype)),
        Node("expanded_attend", [q_nope, q_rope, kv, rows, q_indptr, "kv_indptr"],
             attrs_for("expanded_attend", layer=layer, scale=node.attrs["scale"]), f"o_expanded{layer}", node.type),
    ]


def _specialize(graph: Graph, expanded_from: int) -> Graph:
    types = graph.value_types()
    nodes: list[Node] = []
    for node in graph.nodes:
        kv_b = input_of(node, "kv_b") if node.op == "mla_attend" else None
        if kv_b not in graph.params:
            nodes.append(node)
            continue
        q_nope, q_rope = input_of(node, "q_nope"), input_of(node, "q_rope")
        paged = {name: input_of(node, name) for name in ("kv_pages", *PAGE_INDICES, "kv_scales")}
        heads, nope = types[q_nope].shape[1], types[q_nope].shape[2]
        rank, dtype = types[kv_b].shape[1], types[kv_b].dtype
        value = types[kv_b].shape[0] // heads - nope
        weights = {}
        for part, shape in (("k", (heads, nope, rank)), ("v", (heads, rank, value))):
            name = f"{kv_b}.absorb_{part}"
            graph.params[name] = Param(name, TensorType(shape, dtype),
                                       {"absorb": part, "of": kv_b, "heads": heads, "nope": nope})
            weights[part] = name
        tokens, layer = types[q_nope].shape[0], node.attrs["layer"]
        q_latent, o_latent = f"q_latent{layer}", f"o_latent{layer}"        # one mla_attend per layer
        latent = TensorType((tokens, heads, rank), dtype)
        absorbed = f"o_absorbed{layer}" if expanded_from else node.output
        nodes += [
            Node("head_linear", named_inputs("head_linear", x=q_nope, weight=weights["k"]), {}, q_latent, latent),
            Node("latent_attend", named_inputs("latent_attend", q_latent=q_latent, q_rope=q_rope, **paged),
                 attrs_for("latent_attend", **node.attrs), o_latent, latent),
            Node("head_linear", named_inputs("head_linear", x=o_latent, weight=weights["v"]), {}, absorbed, node.type),
        ]
        if expanded_from:
            expanded = _expanded(node, types, rank)
            choice = named_inputs("step_choice", default=absorbed, alternative=expanded[-1].output,
                                  q_indptr=paged["q_indptr"])
            nodes += expanded + [Node("step_choice", choice, {"min_tokens": expanded_from}, node.output, node.type)]
            graph.inputs.update(CONTEXT_INPUTS)
        types.update({q_latent: latent, o_latent: latent})
    graph.nodes = nodes
    return drop_unused_params(graph)
