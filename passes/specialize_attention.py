"""specialize_attention: record each layer's kernel family and the attention kernels that run it.

Rewrite (paged_attention or paged_attention_fused), for a target whose kernels are
{"mixed": ("tvm_prefill",), "decode": ("tvm_decode", "tvm_prefill")}:
    %o = paged_attention(%q, %k, %v, …) {variant='auto', kernel='auto', decode_kernel='auto'}
  ->
    %o = paged_attention(%q, %k, %v, …) {variant='gqa4', kernel='tvm_prefill', decode_kernel='tvm_decode'}
`variant` is the head ratio's family: 'mha' (ratio 1), 'gqaN' (1 < N < q heads), 'mqa' (one KV
head). `kernel` runs steps with prefill tokens, `decode_kernel` decode-only steps: for each, the
first of the target's kernels for that step kind that supports the op and the layer's KVSpec
(page dtype, sliding window; codegen/lowering/attention_kernels.py). Codegen emits what is recorded; the compiler gives decode
its own entry function where the two differ. Attributes already chosen are kept. The kernels
are recorded in the manifest and shown by `kiln inspect`.
Requires: quantize_kv already run (the page dtype decides which kernels can read the pages).
Leaves: the graph's meaning unchanged (only attributes differ).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.codegen.lowering.attention_kernels import choose_kernel
from kiln.ir import Graph
from kiln.ir.ops import ATTENTION_OPS

from .graph_pass import GraphPass


def variant_for(q_heads: int, kv_heads: int) -> str:
    if q_heads == kv_heads:
        return "mha"
    if kv_heads == 1:
        return "mqa"
    return f"gqa{q_heads // kv_heads}"


@dataclass(frozen=True)
class SpecializeAttention(GraphPass):
    name: ClassVar[str] = "specialize_attention"
    target: object                  # the Target whose attention_kernels are chosen from

    def rewrite(self, graph: Graph) -> Graph:
        types = graph.value_types()
        for node in graph.nodes:
            if node.op not in ATTENTION_OPS:
                continue
            attrs = dict(node.attrs)
            if attrs["variant"] == "auto":
                if node.op == "paged_attention":
                    q_heads, kv_heads = types[node.inputs[0]].shape[1], types[node.inputs[1]].shape[1]
                else:
                    q_heads, kv_heads = attrs["q_heads"], attrs["kv_heads"]
                attrs["variant"] = variant_for(q_heads, kv_heads)
            spec = graph.kv_specs[attrs["layer"]]
            for attr, step in (("kernel", "mixed"), ("decode_kernel", "decode")):
                if attrs[attr] == "auto":
                    attrs[attr] = choose_kernel(self.target, node.op, spec, step, bool(attrs["softcap"]))
            node.attrs = attrs
        return graph
