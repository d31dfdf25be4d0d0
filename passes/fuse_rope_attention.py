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
With RMSNorm on q and k before rope (Qwen3, Gemma 3: per head, over reshapes to [tokens, H, D];
OLMo 2: over all heads), the norms become one qk_norm over the fused projection, and attention
reads its output:
    %qn = rms_norm(reshape(%q), @q_norm)   %kn = rms_norm(reshape(%k), @k_norm)   (then rope, …)
  ->
    %qkvn = qk_norm(%qkv, @q_norm, @k_norm) {per_head=True, …}
    %o = paged_attention_fused(%qkvn, %pos, @inv_freq, %pages, …) {…}
Requires: q, k, v are those slices of one value, which is exactly [tokens, (Hq + 2 Hkv)·D]; q and k
  rotated with the same positions, frequencies and mscale, and normed (if at all) alike; the
  reshapes only split heads.
Leaves: the attention output unchanged; the slices, ropes and reshapes are dropped once nothing
  else reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node

from .graph_pass import GraphPass
from .rewrite import drop_dead_nodes, fresh_name

NORM_CHAINS = {          # how rope's input reaches the slice: none, per-head norm, all-head norm
    None: ("slice",), True: ("reshape", "rms_norm", "reshape", "slice"), False: ("rms_norm", "slice")}


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


def _rotated_part(producers, name: str):
    """(rope node, its norm or None, per_head, slice) when `name` is reshape(rope(…)) over a slice,
    directly or through an RMSNorm."""
    for per_head, chain in NORM_CHAINS.items():
        nodes = _producer_chain(producers, name, ("reshape", "rope", *chain))
        if nodes:
            norm = next((n for n in nodes[2:] if n.op == "rms_norm"), None)
            return nodes[1], norm, per_head, nodes[-1]
    return None


@dataclass(frozen=True)
class FuseRopeAttention(GraphPass):
    name: ClassVar[str] = "fuse_rope_attention"

    def rewrite(self, graph: Graph) -> Graph:
        producers = {n.output: n for n in graph.nodes}
        types = graph.value_types()
        for node in list(graph.nodes):
            if node.op != "paged_attention":
                continue
            q_part, k_part = _rotated_part(producers, node.inputs[0]), _rotated_part(producers, node.inputs[1])
            v_chain = _producer_chain(producers, node.inputs[2], ("reshape", "slice"))
            if not (q_part and k_part and v_chain):
                continue
            (q_rope, q_norm, per_head, q_slice), (k_rope, k_norm, k_per_head, k_slice) = q_part, k_part
            if per_head != k_per_head or (q_norm and q_norm.attrs != k_norm.attrs):
                continue
            slices = [q_slice, k_slice, v_chain[1]]
            source = slices[0].inputs[0]
            tokens, hq, d = types[node.inputs[0]].shape
            hkv = types[node.inputs[1]].shape[1]
            bounds = [(0, hq * d), (hq * d, (hq + hkv) * d), ((hq + hkv) * d, (hq + 2 * hkv) * d)]
            if any(s.inputs[0] != source or (s.attrs["begin"], s.attrs["end"]) != b for s, b in zip(slices, bounds)):
                continue
            if types[source].shape[1:] != ((hq + 2 * hkv) * d,) or q_rope.inputs[1:] != k_rope.inputs[1:] \
                    or q_rope.attrs != k_rope.attrs or q_rope.attrs["head_dim"] != d:
                continue
            if q_norm:
                widths = ((d,), (d,)) if per_head else ((hq * d,), (hkv * d,))
                if (types[q_norm.inputs[1]].shape, types[k_norm.inputs[1]].shape) != widths:
                    continue
                normed = Node("qk_norm", [source, q_norm.inputs[1], k_norm.inputs[1]],
                              {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "per_head": per_head, **q_norm.attrs},
                              fresh_name(graph, "qk_norm"), types[source])
                graph.nodes.insert(graph.nodes.index(node), normed)
                source = normed.output
            node.op = "paged_attention_fused"
            node.inputs = [source, *q_rope.inputs[1:], *node.inputs[3:]]
            node.attrs = {**node.attrs, "mscale": q_rope.attrs["mscale"], "rotary_dim": q_rope.attrs["rotary_dim"],
                          "q_heads": hq, "kv_heads": hkv, "head_dim": d}
        return drop_dead_nodes(graph)
