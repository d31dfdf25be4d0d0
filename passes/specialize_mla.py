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
Requires: kv_b is a param (a weight the rewrite can split).
Leaves: the output keeps its name and type; kv_b itself is no longer read.
"""
from __future__ import annotations

from kiln.ir import Graph, Node, Param, TensorType

from .rewrite import drop_unused_params, editable_copy


def specialize_mla(graph: Graph) -> Graph:
    graph = editable_copy(graph)
    types = graph.value_types()
    nodes: list[Node] = []
    for node in graph.nodes:
        kv_b = node.inputs[3] if node.op == "mla_attend" else None
        if kv_b not in graph.params:
            nodes.append(node)
            continue
        q_nope, q_rope, pages, _, *rest = node.inputs
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
        nodes += [
            Node("head_linear", [q_nope, weights["k"]], {}, q_latent, latent),
            Node("latent_attend", [q_latent, q_rope, pages, *rest], dict(node.attrs), o_latent, latent),
            Node("head_linear", [o_latent, weights["v"]], {}, node.output, node.type),
        ]
        types.update({q_latent: latent, o_latent: latent})
    graph.nodes = nodes
    return drop_unused_params(graph)
