"""Shapes and views of an exported graph's activations (frontend/onnx_graph.py's translators for them).

An exporter computes shapes at run time (Shape, Gather, Slice, Concat of the inputs' dims); kiln follows them as
symbolic vectors (SymVec: "b" batch, "s" new tokens, "p" past, "t" total, ints) so that a Reshape's target can
be read. Activations keep one kiln value per ONNX value with a Layout: [b, s, F] is kiln's [tokens, F];
Reshape to [b, s, h, d] and Transpose to [b, h, s, d] view it as kiln's [tokens, h, d]; Unsqueeze of the
positions or of a [b, s, d] table and Slice/Split/Concat of the last axis are kiln's reshape, slice and concat.
A layer's past and new keys or values (Concat(past, new)) stay one KVFull through the views attention takes of
them (GQA's Unsqueeze/Expand/Reshape, the transposes of the decomposed SDPA)."""
from __future__ import annotations

import numpy as np

from .onnx_translation import KV, Const, Init, KVFull, Layout, Mask, SymVec, Translation

ROWS = Layout()


def dims(t: Translation, v) -> tuple | None:
    """The ONNX dims of a value kiln follows, symbolic where the graph's are; None where kiln does not know them."""
    if v == "ids":
        return ("b", "s")
    if isinstance(v, KV):
        info = next(i for n, i in t.file.inputs.items() if t.env.get(n) == v)
        return ("b", info.dims[1], "p", info.dims[3])
    if isinstance(v, KVFull):
        heads, d = t.b.type_of(v.new).shape[1:]
        return ("b", heads, "t", d)
    if isinstance(v, str):
        shape = t.b.type_of(v).shape
        layout = t.layout.get(v, ROWS)
        if len(shape) == 1:
            return ("b", "s")
        if layout.heads:
            return ("b", shape[1], "s", shape[2]) if layout.transposed else ("b", "s", shape[1], shape[2])
        return ("b", "s", *shape[1:])
    return None


def entries(t: Translation, name: str, node) -> list | None:
    """A shape operand's entries: a SymVec's, or a constant's ints."""
    v = t.value(name, node)
    if isinstance(v, SymVec):
        return list(v.dims)
    c = t.constant(name, node)
    return None if c is None else [int(x) for x in np.asarray(c).reshape(-1)]


def sym_shape(t: Translation, node, a: dict) -> bool:
    """Shape arithmetic over SymVecs and constants; False where this node is none."""
    op = node.op_type
    values = [t.value(n, node) for n in node.input if n]
    if op == "Shape":
        d = dims(t, values[0])
        if d is None:
            return False
        t.env[node.output[0]] = SymVec(tuple(d[a.get("start", 0):a.get("end", len(d))]))
        return True
    if not any(isinstance(v, SymVec) for v in values) or any(isinstance(v, (str, Mask, KVFull)) for v in values):
        return False
    parts = [entries(t, n, node) for n in node.input if n]
    if any(p is None for p in parts):
        return False
    if op in ("Squeeze", "Unsqueeze", "Cast", "Identity") or (op == "Reshape" and len(parts[0]) == 1):
        out = parts[0]
    elif op == "Concat":
        out = [e for p in parts for e in p]
    elif op == "Gather" and len(parts[1]) == 1:
        out = [parts[0][parts[1][0]]]
    elif op == "Slice":
        out = parts[0][parts[1][0]:parts[2][0]]
    elif op == "Add" and len(parts[0]) == len(parts[1]) == 1:
        x, y = parts[0][0], parts[1][0]
        out = [x + y if isinstance(x, int) and isinstance(y, int) else f"{x}+{y}"]
    else:
        return False
    t.env[node.output[0]] = SymVec(tuple(out))
    return True


def _view(t: Translation, x: str, shape: tuple, layout: Layout, node) -> str:
    """x seen as `shape` in `layout`: x itself where that is how it is held, else a reshape (of the same shape
    where only the layout differs: raise_patterns drops it)."""
    if tuple(t.b.type_of(x).shape) == shape and t.layout.get(x, ROWS) == layout:
        return x
    out = t.op("reshape", x, shape=shape, node=node)
    t.layout[out] = layout
    return out


def reshape(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    if isinstance(v, KVFull):
        t.env[node.output[0]] = v
        return True
    if not isinstance(v, str):
        return False
    target = entries(t, node.input[1], node)
    src = dims(t, v)
    if target is not None and not a.get("allowzero", 0) and src is not None:     # a 0 keeps the input's dim
        target = [src[i] if d == 0 and i < len(src) else d for i, d in enumerate(target)]
    width = int(np.prod(t.b.type_of(v).shape[1:]))       # the features of a token
    transposed = target is not None and len(target) == 4 and target[2] == "s"     # [b, h, s, d]
    if target is None or len(target) not in (3, 4) or (target[1] != "s" and not transposed):
        raise t.fail(node, f"reshapes {list(src)} into {target}: kiln views [b, s, F] as [b, s, h, d] or "
                           "[b, h, s, d] and back only")
    features = [target[1], target[3]] if transposed else target[2:]
    known = [d for d in features if isinstance(d, int) and d != -1]
    rest = width // int(np.prod(known)) if known else width
    shape = [rest if d == -1 else d for d in features]
    if len(shape) == 2:
        t.env[node.output[0]] = _view(t, v, ("tokens", *shape), Layout(shape[0], transposed), node)
    else:
        t.env[node.output[0]] = _view(t, v, ("tokens", shape[0]), ROWS, node)
    return True


def transpose(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    perm = list(a.get("perm", []))
    if isinstance(v, KVFull):              # the decomposed SDPA's k^T
        t.env[node.output[0]] = v
        return True
    layout = t.layout.get(v, ROWS) if isinstance(v, str) else None
    if layout is None or not layout.heads or perm != [0, 2, 1, 3]:
        return False
    t.env[node.output[0]] = _view(t, v, tuple(t.b.type_of(v).shape), Layout(layout.heads, not layout.transposed),
                                  node)
    return True


def unsqueeze(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    axes = a.get("axes") or entries(t, node.input[1], node) if len(node.input) > 1 or "axes" in a else None
    if isinstance(v, KVFull):
        t.env[node.output[0]] = v
        return True
    if not isinstance(v, str) or axes is None or len(axes) != 1:
        return False
    shape = t.b.type_of(v).shape
    axis = axes[0]
    if len(shape) == 1 and axis in (2, -1):                  # the positions [b, s] -> [b, s, 1]
        t.env[node.output[0]] = _view(t, v, (shape[0], 1), ROWS, node)
    elif len(shape) == 2 and not t.layout.get(v, ROWS).heads and axis == 1:      # [b, s, d] -> [b, 1, s, d]
        t.env[node.output[0]] = _view(t, v, (shape[0], 1, shape[1]), Layout(1, True), node)
    else:
        return False
    return True


def expand(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    if isinstance(v, KVFull):                # GQA's repeat of the kv heads
        t.env[node.output[0]] = v
        return True
    return False


def last_axis(axis: int | None, rank: int) -> bool:
    return axis in (-1, rank - 1)


def slice_(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    if not isinstance(v, str):
        return False
    starts, ends = entries(t, node.input[1], node), entries(t, node.input[2], node)
    axes = entries(t, node.input[3], node) if len(node.input) > 3 and node.input[3] else [-1]
    steps = entries(t, node.input[4], node) if len(node.input) > 4 and node.input[4] else [1]
    rank = len(dims(t, v))
    if None in (starts, ends, axes, steps) or len(axes) != 1 or steps != [1] or not last_axis(axes[0], rank):
        raise t.fail(node, "slices other than a range of the last axis; kiln cannot raise it")
    width = t.b.type_of(v).shape[-1]
    begin, end = (max(0, min(width, e if e >= 0 else width + e)) for e in (starts[0], ends[0]))
    out = t.op("slice", v, begin=begin, end=end, node=node)
    t.layout[out] = t.layout.get(v, ROWS)
    t.env[node.output[0]] = out
    return True


def split(t: Translation, node, a: dict) -> bool:
    v = t.value(node.input[0], node)
    sizes = entries(t, node.input[1], node) if len(node.input) > 1 and node.input[1] else a.get("split")
    if sizes is None and isinstance(v, str) and a.get("num_outputs"):           # opset 18: equal parts
        sizes = [t.b.type_of(v).shape[-1] // a["num_outputs"]] * a["num_outputs"]
    if not isinstance(v, str) or sizes is None or not last_axis(a.get("axis", 0), len(dims(t, v))):
        raise t.fail(node, "splits other than the last axis into given sizes; kiln cannot raise it")
    begin = 0
    for name, size in zip(node.output, sizes):
        out = t.op("slice", v, begin=begin, end=begin + int(size), node=node)
        t.layout[out] = t.layout.get(v, ROWS)
        t.env[name] = out
        begin += int(size)
    return True


def concat(t: Translation, node, a: dict) -> bool:
    values = [t.value(n, node) for n in node.input]
    axis = a.get("axis")
    if len(values) == 2 and isinstance(values[0], KV) and isinstance(values[1], str) and axis in (-2, 2):
        past, new = values
        t.env[node.output[0]] = KVFull(past.layer, past.which, new)
        return True
    if not all(isinstance(v, str) for v in values) or not last_axis(axis, len(dims(t, values[0]))):
        return False
    out = values[0]
    for v in values[1:]:
        out = t.op("concat", out, v, node=node)
    t.layout[out] = t.layout.get(values[0], ROWS)
    t.env[node.output[0]] = out
    return True


VIEWS = {"Reshape": reshape, "Transpose": transpose, "Unsqueeze": unsqueeze, "Expand": expand, "Slice": slice_,
         "Split": split, "Concat": concat}


def is_bookkeeping(v) -> bool:
    return isinstance(v, (Mask, SymVec, Const, Init))
