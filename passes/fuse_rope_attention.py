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

from kiln.ir import Graph, Node, input_of, named_inputs

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules
from .rewrite import drop_dead_nodes, fresh_name


def _head_part(part: str, per_head: bool | None) -> Pat:
    """reshape(rope(…)) of q or k, where rope's input is the slice of `source` directly
    (per_head None), through a per-head RMSNorm over head reshapes (True), or through an RMSNorm
    over all heads (False)."""
    piece = Pat("slice", {"x": "source"}, name=f"{part}_slice")
    if per_head is not None:
        if per_head:
            piece = Pat("reshape", {"x": piece})
        piece = Pat("rms_norm", {"x": piece}, name=f"{part}_norm")
        if per_head:
            piece = Pat("reshape", {"x": piece})
    rope = Pat("rope", {"x": piece, "positions": "positions", "inv_freq": "inv_freq"}, name=f"{part}_rope")
    return Pat("reshape", {"x": rope})


def _attention_over(per_head: bool | None) -> Pat:
    return Pat("paged_attention", {"q": _head_part("q", per_head), "k": _head_part("k", per_head),
                                   "v": Pat("reshape", {"x": Pat("slice", {"x": "source"}, name="v_slice")})},
               name="attention")


def _heads(graph: Graph, found: Match) -> tuple[int, int, int]:
    """(Hq, Hkv, D) from the attention's q and k."""
    types = graph.value_types()
    attention = found["attention"]
    _, hq, d = types[input_of(attention, "q")].shape
    return hq, types[input_of(attention, "k")].shape[1], d


def _fusable(per_head: bool | None):
    def where(graph: Graph, found: Match) -> bool:
        types = graph.value_types()
        hq, hkv, d = _heads(graph, found)
        bounds = [(0, hq * d), (hq * d, (hq + hkv) * d), ((hq + hkv) * d, (hq + 2 * hkv) * d)]
        slices = [found["q_slice"], found["k_slice"], found["v_slice"]]
        if any((s.attrs["begin"], s.attrs["end"]) != b for s, b in zip(slices, bounds)):
            return False
        q_rope, k_rope = found["q_rope"], found["k_rope"]
        if types[found["source"]].shape[1:] != ((hq + 2 * hkv) * d,) or q_rope.attrs != k_rope.attrs \
                or q_rope.attrs["head_dim"] != d:
            return False
        if per_head is None:
            return True
        q_norm, k_norm = found["q_norm"], found["k_norm"]
        widths = ((d,), (d,)) if per_head else ((hq * d,), (hkv * d,))
        norms = (types[input_of(q_norm, "weight")].shape, types[input_of(k_norm, "weight")].shape)
        return q_norm.attrs == k_norm.attrs and norms == widths
    return where


def _fuse(per_head: bool | None):
    def rewrite(graph: Graph, found: Match) -> None:
        attention, q_rope, source = found["attention"], found["q_rope"], found["source"]
        hq, hkv, d = _heads(graph, found)
        if per_head is not None:
            q_norm, k_norm = found["q_norm"], found["k_norm"]
            normed = Node("qk_norm", named_inputs("qk_norm", qkv=source, q_weight=input_of(q_norm, "weight"),
                                                  k_weight=input_of(k_norm, "weight")),
                          {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "per_head": per_head, **q_norm.attrs},
                          fresh_name(graph, "qk_norm"), graph.value_types()[source])
            graph.nodes.insert(graph.nodes.index(attention), normed)
            source = normed.output
        attention.op = "paged_attention_fused"
        attention.inputs = named_inputs(
            "paged_attention_fused", qkv=source, positions=input_of(q_rope, "positions"),
            inv_freq=input_of(q_rope, "inv_freq"),
            **{name: input_of(attention, name) for name in ("kv_pages", "slot_mapping", "q_indptr", "page_indptr",
                                                            "page_values", "last_page_len", "kv_scales")})
        attention.attrs = {**attention.attrs, "mscale": q_rope.attrs["mscale"],
                           "rotary_dim": q_rope.attrs["rotary_dim"], "q_heads": hq, "kv_heads": hkv, "head_dim": d}
    return rewrite


RULES = [Rule(_attention_over(per_head), _fuse(per_head), where=_fusable(per_head)) for per_head in (None, True, False)]


@dataclass(frozen=True)
class FuseRopeAttention(GraphPass):
    name: ClassVar[str] = "fuse_rope_attention"

    def rewrite(self, graph: Graph) -> Graph:
        apply_rules(graph, RULES)
        return drop_dead_nodes(graph)
