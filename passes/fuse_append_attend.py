"""fuse_append_attend: a layer's KV append and its attention become one paged_attention node, the
form the attention kernels implement (they write the step's rows and attend in one call).

Rewrite (kv_scales present for a quantised cache, absent otherwise):
    %kv = kv_append(%k, %v, %kv_pages3, %slots, %kv_scales3) {layer=3}
    %o = paged_attend(%q, %kv, %qi, %pi, %pv, %lpl, %kv_scales3) {layer=3, scale, window, softcap}
  ->
    %o = paged_attention(%q, %k, %v, %kv_pages3, %slots, %qi, %pi, %pv, %lpl, %kv_scales3)
         {layer=3, scale, window, softcap}
Requires: the attention reads the append's result and nothing else does; both ops of one layer,
  with the same scales.
Leaves: %o keeps its name and meaning; the pages are written before they are read, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, attrs_for, input_of, named_inputs

from .graph_pass import GraphPass
from .pattern import Match, Pat, Rule, apply_rules
from .rewrite import drop_dead_nodes

APPEND_THEN_ATTEND = Pat("paged_attend", {
    "kv_pages": Pat("kv_append", {"kv_scales": "kv_scales"}, name="append", sole=True),
    "kv_scales": "kv_scales"}, name="attend")
INDEX_INPUTS = ("q_indptr", "page_indptr", "page_values", "last_page_len")


def _same_layer(graph: Graph, found: Match) -> bool:
    return found["append"].attrs["layer"] == found["attend"].attrs["layer"]


def _merge(graph: Graph, found: Match) -> None:
    attend, append = found["attend"], found["append"]
    attend.inputs = named_inputs(
        "paged_attention", q=input_of(attend, "q"), k=input_of(append, "k"), v=input_of(append, "v"),
        kv_pages=input_of(append, "kv_pages"), slot_mapping=input_of(append, "slot_mapping"),
        **{name: input_of(attend, name) for name in INDEX_INPUTS}, kv_scales=found["kv_scales"])
    attend.op = "paged_attention"
    attend.attrs = attrs_for("paged_attention", **attend.attrs)
    graph.nodes.remove(append)


@dataclass(frozen=True)
class FuseAppendAttend(GraphPass):
    name: ClassVar[str] = "fuse_append_attend"

    def rewrite(self, graph: Graph) -> Graph:
        apply_rules(graph, [Rule(APPEND_THEN_ATTEND, _merge, where=_same_layer)])
        return drop_dead_nodes(graph)
