"""Translate an ONNX decoder into kiln IR node by node; kiln's pattern rewriter raises what is left.

Each ONNX value becomes one of: a kiln value (activations [tokens, features]: the ONNX batch and sequence axes
are the engine's ragged step), an initializer (a weight, read when the artifact is written), a folded constant,
the attention mask's bookkeeping (sequence lengths, which kiln's step inputs carry: only attention may read
them), or a layer's past or present keys and values (kiln's KV pages, which the runtime owns).

A node maps onto kiln's ops where it is one (MatMul, MatMulNBits → linear; Gather of the token ids → embed;
SimplifiedLayerNormalization and RMSNormalization → rms_norm, the Skip form → add + rms_norm; Add, Mul, Sigmoid,
Sqrt, Cos, …; GroupQueryAttention → rope + kv_append + paged_attend, frontend/onnx_attention.py; RotaryEmbedding →
rope, frontend/onnx_rotary.py). Shapes and views of activations are followed by frontend/onnx_views.py, attention
spelled as MatMul/Softmax, as opset 23's Attention or as MultiHeadAttention, becomes kiln's by
frontend/onnx_sdpa.py. Exporters' spellings of kiln's fused ops (SiLU, RMSNorm, rotary embeddings) are raised by
the first pass of every pipeline, passes/raise_patterns.py. A node kiln cannot place is refused on one line naming
it, its op and why.
"""
from __future__ import annotations

import re

import numpy as np

from kiln.errors import KilnError
from kiln.interface import STEP_INPUTS
from kiln.ir import GraphBuilder, named_inputs

from .onnx_attention import group_query_attention
from .onnx_file import ONNXFile
from .onnx_names import rename_params, role_names
from .onnx_rotary import rope_tables_by_length, rotary_embedding
from . import onnx_sdpa as sdpa
from .onnx_translation import (KV, LOGITS, Const, Init, KVFull, Mask, NBitsNode, Reshaped, SymVec, Translation,
                               Transposed, _kind)
from .onnx_views import ROWS, VIEWS, dims, is_bookkeeping, sym_shape
from .onnx_views import entries as views_entries
from .onnx_weights import check_nbits, gathered_blocks, nbits_matrix

def _attrs(node) -> dict:
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# ---------------------------------------------------------------------- inputs


def _kv_input(file: ONNXFile, name: str) -> KV | None:
    decoder = file.genai_config.get("model", {}).get("decoder", {}).get("inputs", {})
    for which, key in (("key", "past_key_names"), ("value", "past_value_names")):
        pattern = decoder.get(key)
        if pattern and "%d" in pattern:
            m = re.fullmatch(re.escape(pattern).replace("%d", r"(\d+)"), name)
            if m:
                return KV(int(m.group(1)), which)
    m = re.fullmatch(r"past(?:_key_values)?\.(\d+)\.(key|value)", name)
    return KV(int(m.group(1)), m.group(2)) if m else None


def _bind_inputs(t: Translation) -> None:
    b = t.b
    t.step = {i.name: b.input(i.name, (i.length,), "int32") for i in STEP_INPUTS}
    for name, info in t.file.inputs.items():
        kv = _kv_input(t.file, name)
        if kv is not None:
            t.env[name] = kv
        elif name == "input_ids":
            t.env[name] = "ids"
        elif name == "attention_mask":
            t.env[name] = Mask()
        elif name == "position_ids":
            t.env[name] = t.step["positions"]
        else:
            raise KilnError(f"{t.file.path}: graph input {name!r} {list(info.dims)} is neither the token ids, the "
                            "attention mask, the positions nor a layer's past keys or values; kiln cannot bind it")
    if "input_ids" not in t.file.inputs:
        raise KilnError(f"{t.file.path}: the graph takes no input_ids (inputs: {', '.join(t.file.inputs)}); kiln "
                        "compiles decoders that read token ids")
    if not any(isinstance(v, KV) for v in t.env.values()):
        raise KilnError(f"{t.file.path}: the graph has no past key/value inputs, so it is not a decoder with a KV "
                        f"cache (inputs: {', '.join(t.file.inputs)})")
    for name in t.file.initializers:
        t.env[name] = Init(name)


# ---------------------------------------------------------------------- translators


def _constant(t: Translation, node, a: dict) -> None:
    from onnx import numpy_helper
    if "value" not in a:
        raise t.fail(node, f"has {sorted(a)}; kiln reads Constant's `value` only")
    t.env[node.output[0]] = Const(numpy_helper.to_array(a["value"]))


FOLDS = {"Cast": lambda x, a: x[0],
         "Identity": lambda x, a: x[0],
         "Sub": lambda x, a: x[0] - x[1],
         "Add": lambda x, a: x[0] + x[1],
         "Mul": lambda x, a: x[0] * x[1],
         "Shape": lambda x, a: np.asarray(x[0].shape, np.int64),
         "Gather": lambda x, a: np.take(x[0], x[1], axis=a.get("axis", 0)),
         "ReduceSum": lambda x, a: np.sum(x[0], axis=tuple(x[1]) if len(x) > 1 else None,
                                          keepdims=bool(a.get("keepdims", 1)))}
BOOKKEEPING = {"Cast", "Identity", "Sub", "Add", "Mul", "Shape", "Gather", "ReduceSum", "Unsqueeze", "Squeeze",
               "Concat", "Reshape", "Equal", "Greater", "Less", "Where", "Range", "Expand", "ConstantOfShape"}


def _fold(t: Translation, node, a: dict) -> bool:
    """Shape arithmetic is followed (frontend/onnx_views.py); the mask's bookkeeping passes on as such (any op
    of bookkeeping and constants alone); ops of constants alone are computed here. False: none of these."""
    values = [t.value(n, node) for n in node.input if n]
    if node.op_type == "If":                  # a choice between branches is never bookkeeping of its own
        return False
    if sym_shape(t, node, a):
        return True
    if any(isinstance(v, (Mask, SymVec)) for v in values) and all(is_bookkeeping(v) for v in values):
        for out in node.output:
            t.env[out] = Mask()
        return True
    if node.op_type in BOOKKEEPING and any(isinstance(v, Mask) for v in values) and \
            any(isinstance(v, str) for v in values):
        raise t.fail(node, "mixes the attention mask with activations; kiln cannot raise it")
    if node.op_type in FOLDS and values and all(isinstance(v, (Const, Init)) for v in values):
        arrays = [t.constant(n, node) for n in node.input if n]
        if all(x is not None for x in arrays):
            t.env[node.output[0]] = Const(np.asarray(FOLDS[node.op_type](arrays, a)))
            return True
    return False


def _gather(t: Translation, node, a: dict) -> None:
    table, ids = (t.value(n, node) for n in node.input)
    if ids != "ids" or not isinstance(table, (Init, Transposed)) or len(t.file.shape(table.name)) != 2 \
            or a.get("axis", 0):
        raise t.fail(node, "is not a lookup of the token ids in an embedding table; kiln cannot raise it")
    t.matrix(table.name)
    if isinstance(table, Transposed):          # a table tied to the LM head's MatMul weight
        hidden, vocab = t.file.shape(table.name)
        w = t.param(f"{table.name}.transposed", (vocab, hidden),
                    lambda: np.ascontiguousarray(t.file.array(table.name).T))
    else:
        vocab, hidden = t.file.shape(table.name)
        w = t.param(table.name, (vocab, hidden), lambda: t.file.array(table.name))
    t.env[node.output[0]] = t.op("embed", t.step["tokens"], w, node=node)


def _reshape(t: Translation, node, a: dict) -> None:
    data, shape = t.value(node.input[0], node), t.constant(node.input[1], node)
    if not isinstance(data, Init) and VIEWS["Reshape"](t, node, a):
        return
    if not isinstance(data, Init) or shape is None or -1 in shape.tolist() or 0 in shape.tolist():
        raise t.fail(node, "reshapes an activation or by an unknown shape; kiln raises a reshape of an initializer "
                           "(a tied table's blocks) only")
    if int(np.prod(shape)) != int(np.prod(t.file.shape(data.name))):
        raise t.fail(node, f"reshapes {list(t.file.shape(data.name))} into {shape.tolist()}")
    t.env[node.output[0]] = Reshaped(data.name, tuple(int(d) for d in shape))


def _transpose(t: Translation, node, a: dict) -> None:
    data = t.value(node.input[0], node)
    if not isinstance(data, Init) and VIEWS["Transpose"](t, node, a):
        return
    if not isinstance(data, Init) or len(t.file.shape(data.name)) != 2 or list(a.get("perm", [1, 0])) != [1, 0]:
        raise t.fail(node, f"transposes {_kind(data)} by {list(a.get('perm', []))}; kiln raises the transposes of "
                           "attention heads and of a 2-D initializer (a tied table)")
    t.env[node.output[0]] = Transposed(data.name)


def _gather_block_quantized(t: Translation, node, a: dict) -> None:
    """The embedding lookup of a 4-bit table (the builder's tied LM head blocks): embed on its values."""
    data, ids = (t.value(n, node) for n in node.input[:2])
    source = Reshaped(data.name, t.file.shape(data.name)) if isinstance(data, Init) else data
    if ids != "ids" or not isinstance(source, Reshaped) or len(source.shape) != 2:
        raise t.fail(node, "is not a lookup of the token ids in a table of 4-bit blocks; kiln cannot raise it")
    if (a.get("bits", 4), a.get("gather_axis", 0), a.get("quantize_axis", 1)) != (4, 0, 1):
        raise t.fail(node, "is not 4-bit blocks along the rows of a table gathered by row")
    if t.file.initializers[source.name].data_type != 2:     # TensorProto.UINT8: two values a byte
        raise t.fail(node, "gathers blocks that are not packed uint8 nibbles (kiln reads those)")
    rows, width = source.shape
    t.matrix(source.name, f"int4 blocks of {a.get('block_size', 128)} (embedding)")
    table = t.param(f"{source.name}.gathered", (rows, 2 * width),
                    lambda: gathered_blocks(t.file, node, a, source.name, source.shape, t.record))
    t.env[node.output[0]] = t.op("embed", t.step["tokens"], table, node=node)


def _linear_input(t: Translation, node) -> str:
    x = t.tensor(node.input[0], node)
    if node.output[0] == t.head_output:   # the engine wants the logits of some rows only
        x = t.op("take_rows", x, t.step["logit_rows"], node=node)
    return x


def _matmul(t: Translation, node, a: dict) -> None:
    w = t.value(node.input[1], node)
    if isinstance(w, Transposed):            # x @ tableᵀ: a head tied to the embedding table, kiln's [out, in]
        t.env[node.output[0]] = t.op("linear", _linear_input(t, node), t.param(
            w.name, t.file.shape(w.name), lambda: t.file.array(w.name)), node=node)
        return
    if not isinstance(w, Init) and sdpa.matmul(t, node, a):
        return
    if not isinstance(w, Init) or len(t.file.shape(w.name)) != 2:
        raise t.fail(node, "multiplies two activations that are not attention's query and keys or weights and "
                           "values; kiln cannot raise it")
    x = _linear_input(t, node)
    k, n = t.file.shape(w.name)
    t.matrix(w.name)
    weight = t.param(w.name, (n, k), lambda: np.ascontiguousarray(t.file.array(w.name).T))
    t.env[node.output[0]] = t.op("linear", x, weight, node=node)


def _matmul_nbits(t: Translation, node, a: dict) -> None:
    scheme, n, k, block = check_nbits(t.file, node, a)
    t.matrix(node.input[1], f"int4 blocks of {block}" + (" with zero points" if scheme == "q4a" else ""))
    x = _linear_input(t, node)
    weight = t.param(node.input[1], (n, k), lambda: nbits_matrix(t.file, node, a, t.record, t.scale_dtype))
    t.nbits.append(NBitsNode(weight, scheme, block, int(a.get("accuracy_level", 0)), t.file.stored_type(node.input[2])))
    t.env[node.output[0]] = t.op("linear", x, weight, node=node)


def _elementwise(t: Translation, node, op: str, x: str, y: str) -> str:
    """op(x, y) of two activations: kiln's `op` on equal types, else its broadcasting form (the larger first)."""
    tx, ty = t.b.type_of(x), t.b.type_of(y)
    if tx == ty:
        out = t.op(op, x, y, node=node)
    else:
        big, small = (x, y) if tx.rank >= ty.rank and all(
            isinstance(d, str) or d >= e for d, e in zip(tx.shape[::-1], ty.shape[::-1]) if isinstance(e, int)) \
            else (y, x)
        out = t.op(f"bcast_{op}", big, small, node=node)
    t.layout[out] = t.layout.get(x if t.b.type_of(out) == tx else y, ROWS)
    return out


def _scalar(t: Translation, name: str, node) -> float | None:
    c = t.constant(name, node)
    return float(np.asarray(c).reshape(())) if c is not None and np.asarray(c).size == 1 else None


def _add(t: Translation, node, a: dict) -> None:
    x, y = (t.value(n, node) for n in node.input)
    if sdpa.masked(t, node, [x, y]):
        return
    if isinstance(x, str) and isinstance(y, str):
        t.env[node.output[0]] = _elementwise(t, node, "add", x, y)
        return
    (act_name, act), (other, bias) = sorted(zip(node.input, (x, y)), key=lambda p: not isinstance(p[1], str))
    scalar = _scalar(t, other, node) if isinstance(act, str) else None
    if scalar is not None:
        t.env[node.output[0]] = t.op("add_scalar", act, value=scalar, node=node)
        t.layout[t.env[node.output[0]]] = t.layout.get(act, ROWS)
        return
    producer = next((n for n in reversed(t.b.graph.nodes) if n.output == act), None)
    if not (isinstance(act, str) and isinstance(bias, Init) and producer is not None and producer.op == "linear"
            and len(producer.inputs) == 2 and t.readers[act_name] == 1
            and t.file.shape(bias.name) == (producer.type.shape[-1],)):
        raise t.fail(node, "adds a constant that is not the bias of the MatMul it alone reads; kiln cannot raise it")
    bias_param = t.param(bias.name, t.file.shape(bias.name), lambda: t.file.array(bias.name))
    producer.inputs = named_inputs("linear", x=producer.inputs[0], weight=producer.inputs[1], bias=bias_param)
    t.env[node.output[0]] = act


def _mul(t: Translation, node, a: dict) -> None:
    x, y = (t.value(n, node) for n in node.input)
    if isinstance(x, str) and isinstance(y, str):
        t.env[node.output[0]] = _elementwise(t, node, "mul", x, y)
        return
    (_, act), (other, value) = sorted(zip(node.input, (x, y)), key=lambda p: not isinstance(p[1], (str, KVFull)))
    scalar = _scalar(t, other, node)
    if scalar is not None and sdpa.scale(t, node, act, scalar):
        return
    if isinstance(act, str) and scalar is not None:
        out = t.op("mul_scalar", act, value=scalar, node=node)
    elif isinstance(act, str) and isinstance(value, Init) and len(t.file.shape(value.name)) == 1 and \
            t.b.type_of(act).shape[-1] in (1, t.file.shape(value.name)[0]):     # a norm's weight, rope's frequencies
        out = t.op("bcast_mul", act, t.param(value.name, t.file.shape(value.name),
                                             lambda: t.file.array(value.name)), node=node)
    else:
        raise t.fail(node, "multiplies by a tensor that is neither an activation, a scalar nor a vector of the "
                           "last axis; kiln cannot raise it")
    t.layout[out] = t.layout.get(act, ROWS)
    t.env[node.output[0]] = out


UNARY = {"Sigmoid": "sigmoid", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Cos": "cos", "Sin": "sin"}


def _unary(t: Translation, node, a: dict) -> None:
    x = t.tensor(node.input[0], node)
    out = t.op(UNARY[node.op_type], x, node=node)
    t.layout[out] = t.layout.get(x, ROWS)
    t.env[node.output[0]] = out


def _neg(t: Translation, node, a: dict) -> None:
    x = t.tensor(node.input[0], node)
    t.env[node.output[0]] = out = t.op("mul_scalar", x, value=-1.0, node=node)
    t.layout[out] = t.layout.get(x, ROWS)


def _pow(t: Translation, node, a: dict) -> None:
    x = t.tensor(node.input[0], node)
    if _scalar(t, node.input[1], node) != 2.0:
        raise t.fail(node, "raises to a power other than 2 (an RMSNorm's square); kiln cannot raise it")
    t.env[node.output[0]] = out = t.op("mul", x, x, node=node)
    t.layout[out] = t.layout.get(x, ROWS)


def _reduce_mean(t: Translation, node, a: dict) -> None:
    x = t.tensor(node.input[0], node)
    axes = a.get("axes") or (views_entries(t, node.input[1], node) if len(node.input) > 1 else None)
    if axes is None or len(axes) != 1 or axes[0] not in (-1, len(dims(t, x)) - 1) or not a.get("keepdims", 1):
        raise t.fail(node, "is not a mean over the last axis, kept; kiln cannot raise it")
    t.env[node.output[0]] = out = t.op("mean_last", x, node=node)
    t.layout[out] = t.layout.get(x, ROWS)


ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int32"}   # int64 ids run as int32


def _cast(t: Translation, node, a: dict) -> None:
    x = t.tensor(node.input[0], node)
    to = ONNX_DTYPES.get(a.get("to"))
    if to is None:
        raise t.fail(node, f"casts to ONNX type {a.get('to')}; kiln cannot raise it")
    same = t.b.type_of(x).dtype == to or (to in ("float32", "float16", "bfloat16") and
                                          t.b.type_of(x).dtype == t.dtype)
    t.env[node.output[0]] = x if same else t.op("cast", x, dtype=to, node=node)


def _attention_step(t: Translation, node, a: dict) -> None:
    if not sdpa.masked(t, node, [t.value(n, node) if n else None for n in node.input]):
        raise t.fail(node, "is not part of an attention (scores, their mask and softmax); kiln cannot raise it")


def _view(t: Translation, node, a: dict) -> None:
    if not VIEWS[node.op_type](t, node, a):
        raise t.fail(node, f"on {', '.join(_kind(t.value(n, node)) for n in node.input if n)} is not a view kiln "
                           "raises (heads of a projection, positions, a rotary table, keys and values)")


def _norm(t: Translation, x: str, weight_name: str, node, a: dict) -> str:
    w = t.value(weight_name, node)
    if not isinstance(w, Init) or a.get("axis", -1) != -1:
        raise t.fail(node, "is not a norm over the last axis with a weight initializer; kiln cannot raise it")
    t.eps.append(float(a.get("epsilon", 1e-5)))
    weight = t.param(w.name, t.file.shape(w.name), lambda: t.file.array(w.name))
    return t.op("rms_norm", x, weight, eps=float(a.get("epsilon", 1e-5)), node=node)


def _simplified_norm(t: Translation, node, a: dict) -> None:
    t.env[node.output[0]] = _norm(t, t.tensor(node.input[0], node), node.input[1], node, a)


def _skip_simplified_norm(t: Translation, node, a: dict) -> None:
    if len(node.input) > 3 and node.input[3]:
        raise t.fail(node, "adds a bias before its norm; kiln cannot raise it")
    total = t.op("add", t.tensor(node.input[0], node), t.tensor(node.input[1], node), node=node)
    outputs = list(node.output) + [""] * 4
    if outputs[1] or outputs[2]:
        raise t.fail(node, "has its mean or inverse deviation as outputs; kiln cannot raise them")
    if outputs[0]:
        t.env[outputs[0]] = _norm(t, total, node.input[2], node, a)
    if outputs[3]:
        t.env[outputs[3]] = total


def _translators() -> dict:
    return {"Constant": _constant, "Gather": _gather, "GatherBlockQuantized": _gather_block_quantized,
            "Reshape": _reshape, "Transpose": _transpose, "MatMul": _matmul, "MatMulNBits": _matmul_nbits,
            "Add": _add, "Mul": _mul, **{op: _unary for op in UNARY}, "Neg": _neg, "Pow": _pow,
            "ReduceMean": _reduce_mean, "Cast": _cast, "Softmax": _attention_step, "IsNaN": _attention_step,
            "Where": _attention_step, **{op: _view for op in ("Unsqueeze", "Expand", "Slice", "Split", "Concat")},
            "SimplifiedLayerNormalization": _simplified_norm, "SkipSimplifiedLayerNormalization": _skip_simplified_norm,
            "GroupQueryAttention": group_query_attention, "RMSNormalization": _simplified_norm,
            "RotaryEmbedding": rotary_embedding, "Attention": sdpa.attention,
            "MultiHeadAttention": sdpa.multi_head_attention, "If": rope_tables_by_length}


# ---------------------------------------------------------------------- the whole graph


def translate(file: ONNXFile, dtype: str, page_size: int, scale_dtype: str = "float16") -> Translation:
    """The file's graph as kiln IR (raised, verified: `t.graph`), with what each param is made from (MatMulNBits'
    scales to be stored in `scale_dtype`)."""
    t = Translation(file, dtype, page_size, GraphBuilder(file.path.stem), scale_dtype=scale_dtype)
    for node in file.graph.node:
        t.readers.update(n for n in node.input if n)
    t.readers.update(list(file.outputs))
    t.head_output = _head_output(file)
    _bind_inputs(t)
    translators = _translators()
    for node in file.graph.node:
        a = _attrs(node)
        if _fold(t, node, a):
            continue
        if node.op_type not in translators:
            domain = f" of domain {node.domain}" if node.domain else ""
            raise t.fail(node, f"is an op{domain} kiln cannot raise (it raises {', '.join(sorted(translators))})")
        translators[node.op_type](t, node, a)
    _finish(t)
    return t


def _head_output(file: ONNXFile) -> str:
    """The value the logits output is, through Casts (a bfloat16 file casts its head's product to float)."""
    producers = {out: node for node in file.graph.node for out in node.output}
    name = LOGITS
    while name in producers and producers[name].op_type == "Cast":
        name = producers[name].input[0]
    return name


def _finish(t: Translation) -> None:
    """Check the outputs, cast the logits and name the weights by their roles."""
    from kiln.ir import verify
    logits = t.env.get(LOGITS)
    if not isinstance(logits, str):
        raise KilnError(f"{t.file.path}: the graph has no {LOGITS!r} output computed from the tokens "
                        f"(outputs: {', '.join(t.file.outputs)})")
    for name in t.file.outputs:
        v = t.env.get(name)
        if name != LOGITS and not (isinstance(v, KV) and v.present) and not isinstance(v, KVFull):
            raise KilnError(f"{t.file.path}: graph output {name!r} is neither the logits nor a layer's present "
                            "keys or values; kiln cannot give it")
    missing = sorted(set(range(max(t.layers) + 1)) - set(t.layers)) if t.layers else [0]
    if missing:
        raise KilnError(f"{t.file.path}: no attention reads layer {missing[0]}'s past keys and values")
    graph = t.b.output(t.b.op("cast", logits, dtype="float32", name=LOGITS))
    if not any(n.op == "take_rows" for n in graph.nodes):
        raise KilnError(f"{t.file.path}: the {LOGITS!r} output is not a MatMul of the hidden states by the LM head "
                        f"(through Casts); kiln gives the logits of chosen rows and cannot choose them here")
    renamed = role_names(graph)
    t.graph = verify(rename_params(graph, renamed))
    t.weights = {renamed.get(name, name): thunk for name, thunk in t.weights.items()}
    t.nbits = [n._replace(param=renamed.get(n.param, n.param)) for n in t.nbits]

