"""Name an imported graph's weights by the role they play, as Hugging Face checkpoints name them
(model.layers.3.self_attn.v_proj.weight, …mlp.down_proj.weight, lm_head.weight): exporters name initializers
as they like (the builder's `…attn.qkv_proj.MatMul.weight`, torch's `val_83`), and kiln's tensor classes,
4-bit policy and LoRA sites read the roles from the names.

Roles are read from the raised graph: the linears feeding a layer's kv_append and paged_attend are its q/k/v
(one fused qkv_proj when a single linear feeds all three), the linear reading the attention is o_proj, the
norm before q is input_layernorm; the residual add after o_proj feeds post_attention_layernorm, whose readers
are gate_proj (the one under silu, or sigmoid before the patterns raise it) and up_proj, and the linear reading
their product is down_proj; the linear
giving the logits is lm_head and the norm before it model.norm; the frequencies positions are multiplied by
are rope.inv_freq. A weight whose role is not found keeps its
file name."""
from __future__ import annotations

from kiln.ir import Graph, Node, input_of


class _Walk:
    def __init__(self, graph: Graph):
        self.producer = {n.output: n for n in graph.nodes}
        self.readers: dict[str, list[Node]] = {}
        for n in graph.nodes:
            for i in n.inputs:
                self.readers.setdefault(i, []).append(n)
        self.names: dict[str, str] = {}
        self.params = set(graph.params)

    def back(self, value: str) -> Node | None:
        """The projection a query, key or value comes from: back through views, slices and rope (spelled out
        too: the first input of its add and of its product with the cos table)."""
        n = self.producer.get(value)
        while n is not None and n.op in ("reshape", "rope", "slice", "take_rows", "add", "bcast_mul"):
            n = self.producer.get(n.inputs[0])
        return n

    def norm(self, value: str | None) -> Node | None:
        """The RMSNorm giving `value` (past a row choice): rms_norm, or spelled out, the product of the normalised
        rows with its weight param, bcast_mul(bcast_mul(x, ·), @w)."""
        n = self.producer.get(value)
        while n is not None and n.op == "take_rows":
            n = self.producer.get(n.inputs[0])
        if n is not None and n.op == "bcast_mul" and n.inputs[1] in self.params:
            inner = self.producer.get(n.inputs[0])
            return n if inner is not None and inner.op == "bcast_mul" else None
        return n if n is not None and n.op == "rms_norm" else None

    def norm_of(self, x: str) -> Node | None:
        """The RMSNorm of `x`, either spelling."""
        for r in self.readers.get(x, []):
            if r.op == "rms_norm":
                return r
            if r.op == "bcast_mul" and r.inputs[0] == x:
                found = next((n for n in self.readers.get(r.output, []) if self.norm(n.output) is n), None)
                if found is not None:
                    return found
        return None

    def reader(self, value: str, op: str) -> Node | None:
        n = next((r for r in self.readers.get(value, []) if r.op == op), None)
        while n is None and any(r.op == "reshape" for r in self.readers.get(value, [])):
            value = next(r for r in self.readers[value] if r.op == "reshape").output
            n = next((r for r in self.readers.get(value, []) if r.op == op), None)
        return n

    def name(self, node: Node | None, op: str, role: str) -> None:
        if node is None or (node.op != op and not (op == "rms_norm" and node.op == "bcast_mul")):
            return
        self.names.setdefault(node.inputs[1], f"{role}.weight")
        bias = input_of(node, "bias") if op == "linear" else None
        if bias is not None:
            self.names.setdefault(bias, f"{role}.bias")


def _layer(w: _Walk, append: Node) -> None:
    p = f"model.layers.{append.attrs['layer']}"
    attend = w.reader(append.output, "paged_attend")
    if attend is None:
        return
    q, k, v = w.back(attend.inputs[0]), w.back(append.inputs[0]), w.back(append.inputs[1])
    if q is None or q.op != "linear":
        return
    if q is k is v:
        w.name(q, "linear", f"{p}.self_attn.qkv_proj")
    else:
        for node, proj in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
            w.name(node, "linear", f"{p}.self_attn.{proj}")
    w.name(w.norm(q.inputs[0]), "rms_norm", f"{p}.input_layernorm")
    o = w.reader(attend.output, "linear")
    w.name(o, "linear", f"{p}.self_attn.o_proj")
    residual = w.reader(o.output, "add") if o else None
    norm = w.norm_of(residual.output) if residual else None
    if norm is None:
        return
    w.name(norm, "rms_norm", f"{p}.post_attention_layernorm")
    linears = [r for r in w.readers.get(norm.output, []) if r.op == "linear"]
    if len(linears) == 1 and w.reader(linears[0].output, "slice"):     # one gate_up projection, split in two
        gate = next((s for s in w.readers[linears[0].output] if s.op == "slice" and s.attrs["begin"] == 0), None)
        w.name(linears[0], "linear", f"{p}.mlp.gate_up_proj")
        act = (w.reader(gate.output, "silu") or w.reader(gate.output, "mul")) if gate is not None else None
        product = w.reader(act.output, "mul") if act is not None else None
        if product is not None:
            w.name(w.reader(product.output, "linear"), "linear", f"{p}.mlp.down_proj")
        return
    gate = next((g for g in linears if w.reader(g.output, "silu") or w.reader(g.output, "sigmoid")), None)
    if gate is None:
        return
    act = w.reader(gate.output, "silu") or w.reader(gate.output, "mul")      # silu(g), or g · sigmoid(g)
    product = w.reader(act.output, "mul") if act is not None else None
    up = next((u for u in linears if u is not gate and product is not None and u.output in product.inputs), None)
    w.name(gate, "linear", f"{p}.mlp.gate_proj")
    w.name(up, "linear", f"{p}.mlp.up_proj")
    if product is not None:
        w.name(w.reader(product.output, "linear"), "linear", f"{p}.mlp.down_proj")


def role_names(graph: Graph) -> dict[str, str]:
    """file name -> role name, for the weights whose role the graph shows."""
    w = _Walk(graph)
    for node in graph.nodes:
        if node.op == "embed":
            w.name(node, "embed", "model.embed_tokens")
    for node in graph.nodes:
        if node.op == "kv_append":
            _layer(w, node)
        cast = w.producer.get(node.inputs[0]) if node.op == "bcast_mul" else None
        if cast is not None and cast.op == "cast" and node.inputs[1] in w.params and \
                w.producer.get(cast.inputs[0]) is not None and w.producer[cast.inputs[0]].inputs[0] == "positions":
            w.names.setdefault(node.inputs[1], "rope.inv_freq")        # positions · inverse frequencies
    head = w.producer.get(graph.producer(graph.outputs[0]).inputs[0])
    if head is not None and head.op == "linear":
        w.name(head, "linear", "lm_head")
        w.name(w.norm(head.inputs[0]), "rms_norm", "model.norm")
    taken = set(graph.value_types())
    renamed, used = {}, set()
    for old, new in w.names.items():
        if old != new and new not in taken and new not in used:
            renamed[old] = new
            used.add(new)
    return renamed


def rename_params(graph: Graph, renamed: dict[str, str]) -> Graph:
    for node in graph.nodes:
        node.inputs = [renamed.get(i, i) for i in node.inputs]
    params = {}
    for name, param in graph.params.items():
        param.name = renamed.get(name, name)
        params[param.name] = param
    graph.params = params
    return graph
