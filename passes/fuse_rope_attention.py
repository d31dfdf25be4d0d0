"""fuse_rope_attention: attention reads q, k and v straight from the fused QKV projection and
applies rope itself, so no slice, rope or reshape kernel runs between the QKV GEMM and attention.

Rewrite (D = head_dim, Hq query heads, Hkv KV heads):
    %q = slice(%qkv) {begin=0, end=Hq·D}          %qr = rope(%q, %pos, @inv_freq) {head_dim=D}
    %k = slice(%qkv) {begin=Hq·D, end=(Hq+Hkv)·D} %kr = rope(%k, %pos, @inv_freq) {head_dim=D}
    %v = slice(%qkv) {begin=(Hq+Hkv)·D, end=…}
    %o = paged_attention(reshape(%qr), reshape(%kr), reshape(%v), %pages, …) {layer, scale, variant}
  ->
    %o = paged_attention_fused(%qkv, %pos, @inv_freq, %pages, …) {layer, scale, variant, q_heads=Hq,
                                                                  kv_heads=Hkv, head_dim=D}
Requires: q, k, v are those slices of one value, which is exactly [tokens, (Hq + 2 Hkv)·D]; q and k
  rotated with the same positions, frequencies and mscale; the reshapes only split heads.
Leaves: the attention output unchanged; the slices, ropes and reshapes are dropped once nothing
  else reads them.
"""
from __future__ import annotations

from kiln.ir import Graph, Node

from .rewrite import drop_dead_nodes, editable_copy


def _producer_chain(producers: dict[str, Node], name: str, ops: tuple[str, ...]) -> list[Node] | None:
    """The nodes producing `name` through exactly `ops` (outermost first), or None."""
    chain = []
    for op in ops:
        node = producers.get(name)
        if node is None or node.op != op:
            return None
        chain.append(node)
        name = node.inputs[0]
    return chain


def fuse_rope_attention(graph: Graph) -> Graph:
    graph = editable_copy(graph)
    producers = {n.output: n for n in graph.nodes}
    types = graph.value_types()
    for node in graph.nodes:
        if node.op != "paged_attention":
            continue
        q_chain = _producer_chain(producers, node.inputs[0], ("reshape", "rope", "slice"))
        k_chain = _producer_chain(producers, node.inputs[1], ("reshape", "rope", "slice"))
        v_chain = _producer_chain(producers, node.inputs[2], ("reshape", "slice"))
        if not (q_chain and k_chain and v_chain):
            continue
        q_rope, k_rope = q_chain[1], k_chain[1]
        slices = [q_chain[2], k_chain[2], v_chain[1]]
        source = slices[0].inputs[0]
        tokens, hq, d = types[node.inputs[0]].shape
        hkv = types[node.inputs[1]].shape[1]
        bounds = [(0, hq * d), (hq * d, (hq + hkv) * d), ((hq + hkv) * d, (hq + 2 * hkv) * d)]
        if any(s.inputs[0] != source or (s.attrs["begin"], s.attrs["end"]) != b for s, b in zip(slices, bounds)):
            continue
        if types[source].shape[1:] != ((hq + 2 * hkv) * d,) or q_rope.inputs[1:] != k_rope.inputs[1:] \
                or q_rope.attrs != k_rope.attrs or q_rope.attrs["head_dim"] != d:
            continue
        node.op = "paged_attention_fused"
        node.inputs = [source, *q_rope.inputs[1:], *node.inputs[3:]]
        node.attrs = {**node.attrs, "mscale": q_rope.attrs["mscale"], "rotary_dim": q_rope.attrs["rotary_dim"],
                      "q_heads": hq, "kv_heads": hkv, "head_dim": d}
    return drop_dead_nodes(graph)
