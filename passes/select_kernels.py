"""select_kernels: record on every node that has a choice of kernels the kernel each kind of step
runs, and on attention layers the head ratio's variant.

Rewrite, on the CUDA target (for example):
    %o = paged_attention(%q, %k, %v, …) : bf16[tokens, 32, 64]
    %y = linear(%h, @w) : bf16[tokens, 2048]
  ->
    %o = paged_attention(%q, %k, %v, …) {variant='gqa4', kernels={'mixed': 'tvm_prefill', 'decode': 'kiln_gpu_decode'}} : …
    %y = linear(%h, @w) {kernels={'mixed': 'mma', 'decode': 'gemv', 'decode_wide': 'mma'}} : …
For attention, MLA's latent ops, linears and moe_experts, `kernels` holds the mixed steps' kernel and
the step kinds whose kernel differs from the steps they fall back to (selection/choice.py): for each,
the first of the target's kernels (Target.kernels, selection/order.py) whose record supports the
node in that step. `variant` is 'mha' (ratio 1), 'gqaN' (1 < N < q heads) or 'mqa' (one KV head).
Codegen emits what is recorded and gives each step kind whose kernels differ its own entry function;
the manifest and `kiln inspect` report it. Choices already recorded are kept.
Requires: quantize and quantize_kv already run (a weight's format and the pages' dtype decide which
kernels can read them).
Leaves: the graph's meaning unchanged (only attributes differ).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, input_of
from kiln.ir.ops import ATTENTION_OPS
from kiln.selection.attention import variant_for
from kiln.selection.choice import CHOSEN_OPS, choose

from .graph_pass import GraphPass


@dataclass(frozen=True)
class SelectKernels(GraphPass):
    name: ClassVar[str] = "select_kernels"
    target: object                  # the Target whose kernel order is chosen from

    def rewrite(self, graph: Graph) -> Graph:
        types = graph.value_types()
        for node in graph.nodes:
            attrs = dict(node.attrs)
            if node.op in ATTENTION_OPS and attrs["variant"] == "auto":
                if node.op == "paged_attention":
                    q_heads, kv_heads = (types[input_of(node, name)].shape[1] for name in ("q", "k"))
                else:
                    q_heads, kv_heads = attrs["q_heads"], attrs["kv_heads"]
                attrs["variant"] = variant_for(q_heads, kv_heads)
            if node.op in CHOSEN_OPS and attrs["kernels"] is None:
                attrs["kernels"] = choose(node, graph, self.target, types)
            node.attrs = attrs
        return graph
