"""RotaryEmbedding (ONNX's, opset 23, and ONNX Runtime's com.microsoft op) onto kiln's `rope`.

The op rotates the first rotary_embedding_dim elements of each head (all where 0) by halves, with cos/sin
tables of D/2 columns: either per-position caches (initializers indexed by position_ids; their frequencies read
back as GroupQueryAttention's are, frontend/onnx_attention.py) or already gathered for the step, as
torch.onnx.export writes it: Cos and Sin of the positions times the inverse frequencies, which are then the
param the Mul reads. kiln's rope takes the rows [tokens, H·D]; the op's input is [b, s, H·D] (num_heads) or
[b, h, s, D], viewed as kiln's [tokens, H, D] (frontend/onnx_views.py)."""
from __future__ import annotations

import numpy as np

from .onnx_attention import rope_param
from .onnx_translation import Const, Mask, Translation
from .onnx_views import ROWS


def _producer(t: Translation, value: str):
    return next((n for n in reversed(t.b.graph.nodes) if n.output == value), None)


def _gathered_frequencies(t: Translation, cos: str, sin: str) -> str | None:
    """The inverse-frequency param f where cos = cos(a), sin = sin(a), a = cast(positions) · f (through
    reshapes): the step's tables, computed in the graph."""
    c, s = _producer(t, cos), _producer(t, sin)
    if c is None or s is None or (c.op, s.op) != ("cos", "sin") or c.inputs != s.inputs:
        return None
    angles = _producer(t, c.inputs[0])
    if angles is None or angles.op != "bcast_mul" or angles.inputs[1] not in t.b.graph.params:
        return None
    source = _producer(t, angles.inputs[0])
    while source is not None and source.op in ("cast", "reshape"):
        if source.inputs[0] == t.step["positions"]:
            return angles.inputs[1]
        source = _producer(t, source.inputs[0])
    return None


def rotary_embedding(t: Translation, node, a: dict) -> None:
    names = list(node.input) + [""] * 4
    if node.domain == "com.microsoft":
        x_name, positions, cos, sin = names[:4]
    else:
        x_name, cos, sin, positions = names[:4]
    if a.get("interleaved", 0):
        raise t.fail(node, "rotates interleaved pairs; kiln's rope rotates halves")
    x = t.tensor(x_name, node)
    layout, shape = t.layout.get(x, ROWS), t.b.type_of(x).shape
    if layout.heads:
        heads, head_dim = shape[1:]
    elif len(shape) == 2 and a.get("num_heads", 0):
        heads, head_dim = int(a["num_heads"]), shape[1] // int(a["num_heads"])
    elif len(shape) == 2 and positions and not a.get("rotary_embedding_dim", 0) and cos in t.file.initializers:
        head_dim = 2 * t.file.shape(cos)[-1]           # ONNX Runtime's rule: the caches rotate whole heads
        heads = shape[1] // head_dim
    else:
        raise t.fail(node, "rotates rows whose heads it does not say (num_heads) or show ([b, h, s, d])")
    if positions:
        if t.value(positions, node) != t.step["positions"]:
            raise t.fail(node, "takes position ids that are not the graph's positions")
        inv, mscale, rotary = rope_param(t, node, cos, sin, head_dim)
    else:
        inv, mscale = _gathered_frequencies(t, t.tensor(cos, node), t.tensor(sin, node)), 1.0
        if inv is None:
            raise t.fail(node, "rotates with cos/sin tables that are not Cos and Sin of the positions times "
                               "inverse frequencies, nor caches indexed by position ids; kiln cannot raise them")
        rotary = 2 * t.b.type_of(inv).shape[0]
        rotary = 0 if rotary == head_dim else rotary
    rows = t.op("reshape", x, shape=("tokens", heads * head_dim), node=node) if layout.heads else x
    turned = t.op("rope", rows, t.step["positions"], inv, head_dim=head_dim, mscale=mscale, rotary_dim=rotary,
                  node=node)
    out = t.op("reshape", turned, shape=shape, node=node) if layout.heads else turned
    t.layout[out] = layout
    t.env[node.output[0]] = out


def _branch_tables(graph) -> list[np.ndarray] | None:
    """The tensors a branch of constants alone gives (Constant nodes), in its outputs' order; None otherwise."""
    from onnx import numpy_helper
    made = {}
    for n in graph.node:
        value = next((a.t for a in n.attribute if a.name == "value"), None)
        if n.op_type != "Constant" or value is None:
            return None
        made[n.output[0]] = numpy_helper.to_array(value)
    made |= {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    return [made.get(o.name) for o in graph.output] if all(o.name in made for o in graph.output) else None


def rope_tables_by_length(t: Translation, node, a: dict) -> None:
    """If(total length > c) choosing between two sets of tables: LongRoPE's caches as the builder writes them
    (the long factors' past the original context c, the short ones' within it). kiln compiles LongRoPE as it
    does from an HF directory: the short factors' tables, and a context of c (their rows)."""
    condition = next((n for n in t.file.graph.node if node.input[0] in n.output), None)
    limit = t.constant(condition.input[1], node) if condition is not None and len(condition.input) > 1 else None
    tables = [_branch_tables(a[branch]) for branch in ("then_branch", "else_branch")]
    by_length = (condition is not None and condition.op_type == "Greater" and limit is not None and limit.size == 1
                 and isinstance(t.value(condition.input[0], node), Mask))
    long_then_short = all(tables) and by_length and all(len(x) > int(limit) for x in tables[0]) \
        and all(len(x) == int(limit) for x in tables[1])
    if not long_then_short:
        raise t.fail(node, "is not a choice of rotation tables by the sequence's length (LongRoPE's); kiln raises "
                           "no other control flow")
    for name, table in zip(node.output, tables[1]):
        t.env[name] = Const(table)
        t.record[name, f"LongRoPE's short tables: contexts up to {int(limit)} tokens (the long ones not read)"] = True
