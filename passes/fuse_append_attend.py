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

from kiln.ir import Graph
from kiln.ir.ops import OPS

from .graph_pass import GraphPass
from .rewrite import drop_dead_nodes, users


@dataclass(frozen=True)
class FuseAppendAttend(GraphPass):
    name: ClassVar[str] = "fuse_append_attend"

    def rewrite(self, graph: Graph) -> Graph:
        producers = {n.output: n for n in graph.nodes}
        readers = users(graph)
        merged: set[str] = set()                     # appends now inside a paged_attention
        for attend in graph.nodes:
            if attend.op != "paged_attend":
                continue
            a = OPS["paged_attend"]
            append = producers.get(a.input_of(attend, "kv_pages"))
            if append is None or append.op != "kv_append" or len(readers[append.output]) != 1:
                continue
            w = OPS["kv_append"]
            scales = w.input_of(append, "kv_scales")
            if append.attrs["layer"] != attend.attrs["layer"] or a.input_of(attend, "kv_scales") != scales:
                continue
            index = [a.input_of(attend, name) for name in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
            attend.op = "paged_attention"
            attend.inputs = [a.input_of(attend, "q"), w.input_of(append, "k"), w.input_of(append, "v"),
                             w.input_of(append, "kv_pages"), w.input_of(append, "slot_mapping"), *index,
                             *([scales] if scales else [])]
            attend.attrs = OPS["paged_attention"].complete_attrs(attend.attrs, f"%{attend.output}")
            merged.add(append.output)
        graph.nodes = [n for n in graph.nodes if n.output not in merged]
        return drop_dead_nodes(graph)
