"""Two forms of one computation in one graph, chosen per step by the step's shape.

    %o = step_choice(%default, %alternative, %q_indptr) {min_tokens}
is %alternative in a step where every sequence brings at least min_tokens new tokens (a prefill
step), and %default in any other. Both inputs compute the same function; they differ in cost
(specialize_mla: MLA's absorbed form for decode and short chunks, its expanded form for long
prefill chunks). The interpreter computes both and picks; compiled code never does: lowering
builds a "prefill" entry from `for_step(graph, "prefill")` and the other entries from the default
forms, and the runtime runs the prefill entry exactly when the step qualifies, so each step
computes one form only.

The expanded form reads every sequence's context rows, which two derived inputs describe:
    kv_slots  i32[kv_tokens]  the KV slot of each context row, sequence after sequence
    kv_indptr i32[seqs + 1]   where each sequence's rows start in kv_slots
A step that runs a default form passes them empty (zeros for kv_indptr): nothing reads them.
"""
from __future__ import annotations

from kiln.interface import is_prefill_step

from .graph import Graph
from .opdef import OPS, REQUIRED, check_indices, op
from .types import TensorType

CONTEXT_INPUTS = {"kv_slots": TensorType(("kv_tokens",), "int32"), "kv_indptr": TensorType(("seqs1",), "int32")}


@op("step_choice", ["default", "alternative", "q_indptr"], {"min_tokens": REQUIRED})
def _step_choice():
    """`alternative` when every sequence brings at least min_tokens new tokens, else `default`."""
    def rule(types, attrs, fail):
        default, alternative, q_indptr = types
        if default != alternative:
            fail(f"the two forms must have one type, got {default} and {alternative}")
        if not (isinstance(attrs["min_tokens"], int) and attrs["min_tokens"] >= 2):
            fail(f"min_tokens must be an integer of at least 2 (decode steps keep the default), "
                 f"got {attrs['min_tokens']!r}")
        check_indices({"q_indptr": q_indptr}, fail)
        return default
    return rule, lambda x, at, ty, dims: x[1] if is_prefill_step(x[2], at["min_tokens"]) else x[0]


def prefill_min_tokens(graph: Graph) -> int | None:
    """The new tokens per sequence from which a step runs the graph's alternative forms (None: it has none)."""
    mins = {n.attrs["min_tokens"] for n in graph.nodes if n.op == "step_choice"}
    if len(mins) > 1:
        raise ValueError(f"step_choice nodes disagree on min_tokens: {sorted(mins)}")
    return mins.pop() if mins else None


def for_step(graph: Graph, step: str) -> tuple[list, list[str]]:
    """The nodes a step of kind `step` runs, in order, and its outputs: each step_choice's chosen
    input stands for it (alternatives in "prefill" steps, defaults otherwise), and nodes that only
    the other form needed are left out (a node that writes in place always stays)."""
    choice = {n.output: n.inputs[1 if step == "prefill" else 0] for n in graph.nodes if n.op == "step_choice"}
    nodes = []
    for node in graph.nodes:
        if node.op != "step_choice":
            node = type(node)(node.op, [choice.get(i, i) for i in node.inputs], node.attrs, node.output, node.type)
            nodes.append(node)
    outputs = [choice.get(o, o) for o in graph.outputs]
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if node.output in needed or OPS[node.op].mutates:
            kept.append(node)
            needed.update(i for i in node.inputs if i is not None)
    return kept[::-1], outputs
