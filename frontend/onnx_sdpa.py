"""Attention as an exporter writes it (torch's scaled_dot_product_attention in ONNX): keys and values
concatenated to the past, then either decomposed (the query and keys each times a share of the scale,
MatMul(q, kᵀ), an additive mask computed from the attention mask, Softmax with a NaN guard, MatMul(p, v)) or,
from opset 23, ONNX's Attention op over them (its scale, soft-cap and boolean mask). It becomes kiln's paged
attention: the new keys and values appended to the layer's pages, attention read from them.

The mask's subgraph is the attention mask's bookkeeping; kiln's attention is causal, with the layer's sliding
window where the model has one. The graph computes windows inside that subgraph, so kiln reads them from the
config.json beside the file (transformers' rule for the model's family); without one, attention is full."""
from __future__ import annotations

from kiln.errors import KilnError
from kiln.interface import KVSpec

from .onnx_translation import Const, Init, KVFull, Layer, Mask, Scaled, Scores, Translation
from .onnx_views import ROWS, Layout


def _query(t: Translation, v, node) -> tuple[str, float] | None:
    if isinstance(v, Scaled):
        return v.value, v.factor
    if isinstance(v, str) and t.layout.get(v, ROWS).heads:
        return v, 1.0
    return None


def matmul(t: Translation, node, a: dict) -> bool:
    """MatMul(q, kᵀ) -> Scores; MatMul(softmax, v) -> kiln's attention. False: neither."""
    x, y = (t.value(n, node) for n in node.input)
    q = _query(t, x, node)
    if q is not None and isinstance(y, KVFull) and y.which == "key":
        t.env[node.output[0]] = Scores(q[0], y.new, y.layer, q[1] * y.factor)
        return True
    if isinstance(x, Scores) and x.probs and isinstance(y, KVFull) and y.which == "value":
        t.env[node.output[0]] = _attend(t, node, x, y)
        return True
    return False


def scale(t: Translation, node, v, factor: float) -> bool:
    """Mul of an attention query or keys by a scalar: kept as the scale attention will take."""
    if isinstance(v, KVFull):
        t.env[node.output[0]] = KVFull(v.layer, v.which, v.new, v.factor * factor)
        return True
    layout = t.layout.get(v, ROWS) if isinstance(v, str) else ROWS
    if layout.heads and layout.transposed:
        t.env[node.output[0]] = Scaled(v, factor)
        return True
    return False


def masked(t: Translation, node, values) -> bool:
    """Add(scores, mask) and the softmax's NaN guard Where(IsNaN(p), 0, p) keep the scores; Softmax takes them."""
    op = node.op_type
    scores = [v for v in values if isinstance(v, Scores)]
    if len(scores) != 1 or not all(isinstance(v, (Scores, Mask, Const, Init)) or v is None for v in values):
        return False
    s = scores[0]
    if op == "Softmax":
        t.env[node.output[0]] = Scores(s.q, s.keys, s.layer, s.scale, probs=True)
    elif op == "IsNaN":
        t.env[node.output[0]] = Mask()
    elif op in ("Add", "Where"):
        t.env[node.output[0]] = s
    else:
        return False
    return True


def _one_layers(keys, values) -> bool:
    """Keys and values of one layer, each concatenated to its past (KVFull)."""
    return (isinstance(keys, KVFull) and keys.which == "key" and isinstance(values, KVFull)
            and values.which == "value" and keys.layer == values.layer)


def _causal(t: Translation, node, mask, causal_flag) -> None:
    """An attention's mask must be the attention mask's bookkeeping, or absent where the op says it is causal."""
    if not isinstance(mask, Mask) and not (mask is None and causal_flag):
        raise t.fail(node, "masks with something other than the attention mask's causal bookkeeping")


def attention(t: Translation, node, a: dict) -> None:
    """ONNX's Attention (opset 23) over a layer's keys and values as the graph concatenated them to its past,
    [b, h, s, d] views (the query too; grouped keys repeated or not)."""
    names = list(node.input) + [""] * 6
    if any(names[4:6]) or any(list(node.output)[1:]):
        raise t.fail(node, "carries its past keys and values itself; kiln reads them concatenated to the past")
    if a.get("qk_matmul_output_mode", 0) or a.get("softmax_precision", 0) not in (0, 1):
        raise t.fail(node, "asks for scores or a softmax precision kiln's attention does not give")
    q, keys, values = (t.value(n, node) for n in names[:3])
    mask = t.value(names[3], node) if names[3] else None
    query = _query(t, q, node)
    if query is None or not _one_layers(keys, values):
        raise t.fail(node, "does not attend from [b, h, s, d] queries over one layer's keys and values "
                           "concatenated to its past")
    _causal(t, node, mask, a.get("is_causal", 0))
    d = t.b.type_of(query[0]).shape[-1]
    scale = float(a.get("scale", 0.0) or d ** -0.5) * query[1] * keys.factor
    probs = Scores(query[0], keys.new, keys.layer, scale, probs=True)
    t.env[node.output[0]] = _attend(t, node, probs, values, softcap=float(a.get("softcap", 0.0)))


def multi_head_attention(t: Translation, node, a: dict) -> None:
    """ONNX Runtime's MultiHeadAttention (the builder's float16 and bfloat16 CPU files) over a layer's keys and
    values as the graph concatenated them to its past and repeated them for its heads: [b, s, H·D] queries."""
    names = list(node.input) + [""] * 10
    if any(names[3:5]) or any(names[6:10]) or any(list(node.output)[1:]):
        raise t.fail(node, "takes a bias, a key padding mask or its own past keys and values; kiln reads keys and "
                           "values concatenated to the past and masks causally")
    q, keys, values = (t.value(n, node) for n in names[:3])
    mask = t.value(names[5], node) if names[5] else None
    heads = int(a["num_heads"])
    if not (isinstance(q, str) and not t.layout.get(q, ROWS).heads and _one_layers(keys, values)):
        raise t.fail(node, "does not attend from [b, s, H·D] queries over one layer's keys and values "
                           "concatenated to its past")
    _causal(t, node, mask, a.get("unidirectional", 0))
    d = t.b.type_of(q).shape[-1] // heads
    query = t.op("reshape", q, shape=("tokens", heads, d), node=node)
    probs = Scores(query, keys.new, keys.layer, float(a.get("scale", 0.0) or d ** -0.5) * keys.factor, probs=True)
    out = _attend(t, node, probs, values)
    t.env[node.output[0]] = t.op("reshape", out, shape=("tokens", heads * d), node=node)


def _window(t: Translation, layer: int) -> int:
    """The layer's window as kiln's HF importer reads it from config.json (0: none, or no config.json)."""
    if not t.file.hf_config:
        return 0
    from .families import parse_config
    try:
        config = parse_config(t.file.hf_config)
    except KilnError:
        return 0
    return (config.sliding_window or 0) if config.is_sliding(layer) else 0


def _attend(t: Translation, node, probs: Scores, values: KVFull, softcap: float = 0.0) -> str:
    layer, keys = probs.layer, probs.keys
    if layer in t.layers:
        raise t.fail(node, f"is a second attention over layer {layer}'s cache")
    heads, d = t.b.type_of(probs.q).shape[1:]
    kv_heads = t.b.type_of(values.new).shape[1]
    window = _window(t, layer)
    spec = KVSpec("sliding" if window else "full", kv_heads, d, d, t.dtype, t.page_size, window=window or None)
    pages = t.b.kv_cache(layer, spec)[0]
    written = t.op("kv_append", keys, values.new, pages, t.step["slot_mapping"], layer=layer, node=node)
    paging = [t.step[n] for n in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
    out = t.op("paged_attend", probs.q, written, *paging, layer=layer, scale=float(probs.scale), window=window,
               softcap=softcap, node=node)
    t.layout[out] = Layout(heads, True)
    t.layers[layer] = Layer(layer, heads, kv_heads, d, window, None)
    return out
