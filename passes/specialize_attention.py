"""specialize_attention: record which attention kernel family fits each layer's head ratio.

Rewrite (paged_attention or paged_attention_fused):
    %o = paged_attention(%q, %k, %v, …) {variant='auto'}
  ->
    %o = paged_attention(%q, %k, %v, …) {variant='gqa4'}     (q heads / kv heads = 4)
Variants: 'mha' (ratio 1), 'gqaN' (1 < N < q heads), 'mqa' (one KV head).
This pass only annotates: no kernel is chosen from the attribute yet. The CPU attention kernel
derives the group size from the q and kv head counts itself (one task per KV head serving its N
query heads), and CUDA uses TVM's prefill kernel for every ratio. The variant is written to the
manifest (`attention_variants`) and shown by `kiln inspect`; a per-target attention-kernel registry
that reads it is the next step (DESIGN.md).
Requires: nothing. Leaves: the graph's meaning unchanged (only the attribute differs).
"""
from __future__ import annotations

from kiln.ir import Graph
from kiln.ir.ops import ATTENTION_OPS

from .rewrite import editable_copy


def variant_for(q_heads: int, kv_heads: int) -> str:
    if q_heads == kv_heads:
        return "mha"
    if kv_heads == 1:
        return "mqa"
    return f"gqa{q_heads // kv_heads}"


def specialize_attention(graph: Graph) -> Graph:
    graph = editable_copy(graph)
    types = graph.value_types()
    for node in graph.nodes:
        if node.op in ATTENTION_OPS and node.attrs["variant"] == "auto":
            if node.op == "paged_attention":
                q_heads, kv_heads = types[node.inputs[0]].shape[1], types[node.inputs[1]].shape[1]
            else:
                q_heads, kv_heads = node.attrs["q_heads"], node.attrs["kv_heads"]
            node.attrs = {**node.attrs, "variant": variant_for(q_heads, kv_heads)}
    return graph
