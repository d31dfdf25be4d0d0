"""ONNX Runtime's GroupQueryAttention onto kiln's paged attention: q, k and v (packed in one input or apart)
rotated by kiln's rope, k and v appended to the layer's KV pages, and the causal attention read from them.

GQA rotates with cos/sin tables indexed by position (cos_cache[p, i] = m · cos(p · f_i)); kiln's rope computes
them from the inverse frequencies f and the factor m, so those are read back from the tables (f_i from the
phase at positions 1, 2, 4, … so that each doubling halves its error, m as the mean length of (cos, sin)) and
the whole table checked against them, within the rounding of its dtype (float32, or float16 and bfloat16 in
the builder's CUDA files): a table kiln's rope would not reproduce is refused. `local_window_size` w is kiln's
window w (a query attends to the w newest positions, itself among them: measured against ONNX Runtime's CPU
kernel)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.interface import KVSpec

from .onnx_translation import KV, Layer, Mask, Translation

ROPE_PARAMS = ("rope.inv_freq", "rope_local.inv_freq")
TABLE_TOLERANCE = 2e-6            # per unit of position, on top of the rounding of the table's own dtype


def rope_from_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(inverse frequencies, factor, worst deviation of the table from them, in units of what the table's
    rounding and TABLE_TOLERANCE allow) of GQA's cos/sin tables."""
    rounding = max(1e-6, float(ml_dtypes.finfo(cos.dtype).eps))       # a float16 or bfloat16 table's ulp at 1
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)
    mscale = float(np.hypot(cos, sin).mean())
    inv = np.arctan2(sin[1], cos[1]) if len(cos) > 1 else np.zeros(cos.shape[1])
    p = 2
    while p < len(cos):
        predicted = p * inv
        measured = np.arctan2(sin[p], cos[p])
        inv = (predicted + (measured - predicted + np.pi) % (2 * np.pi) - np.pi) / p
        p *= 2
    positions = np.arange(len(cos), dtype=np.float64)[:, None]
    angle = positions * inv.astype(np.float32).astype(np.float64)
    allowed = rounding + TABLE_TOLERANCE * positions
    deviation = np.maximum(np.abs(cos - mscale * np.cos(angle)), np.abs(sin - mscale * np.sin(angle))) / allowed
    return inv.astype(np.float32), mscale, float(deviation.max())


def rope_param(t: Translation, node, cos_name: str, sin_name: str, head_dim: int) -> tuple[str, float, int]:
    """(kiln's inverse-frequency param, factor, rotary dim or 0 for the whole head) of cos/sin caches indexed by
    position: read back from the tables once per pair (rope_from_tables), refused where they are no rotation."""
    key = (cos_name, sin_name)
    if key not in t.rope:
        cos, sin = (t.constant(n, node) if n else None for n in key)
        cos = t.file.array(cos_name) if cos is None and cos_name in t.file.initializers else cos
        sin = t.file.array(sin_name) if sin is None and sin_name in t.file.initializers else sin
        if cos is None or sin is None or cos.ndim != 2 or cos.shape != sin.shape:
            raise t.fail(node, "rotates with cos/sin caches that are not two initializers of one [positions, "
                               "rotary_dim / 2] shape; kiln cannot raise it")
        if 2 * cos.shape[1] > head_dim:
            raise t.fail(node, f"rotates {2 * cos.shape[1]} elements of heads of {head_dim}")
        inv, mscale, deviation = rope_from_tables(cos, sin)
        if deviation > 1:
            raise t.fail(node, f"rotates with cos/sin caches {cos_name!r}/{sin_name!r} that are not m·cos(p·f) "
                               "tables of one set of frequencies (kiln's rope); kiln cannot raise them")
        if len(t.rope) == len(ROPE_PARAMS):
            raise t.fail(node, f"is the {len(t.rope) + 1}th rotation table kiln met; it holds {len(ROPE_PARAMS)}")
        name = ROPE_PARAMS[len(t.rope)]
        t.b.param(name, inv.shape, "float32")
        t.weights[name] = lambda inv=inv: inv
        t.rope[key] = (name, mscale, 2 * cos.shape[1], len(cos))
    name, mscale, rotary, _ = t.rope[key]
    return name, mscale, 0 if rotary == head_dim else rotary


def group_query_attention(t: Translation, node, a: dict) -> None:
    names = list(node.input) + [""] * 12
    for index, what in ((9, "position_ids"), (10, "attention_bias"), (11, "head_sink")):
        if names[index]:
            raise t.fail(node, f"takes {what}, which kiln does not read")
    for attr in ("smooth_softmax", "qk_output", "rotary_interleaved"):
        if a.get(attr, 0):
            raise t.fail(node, f"sets {attr}={a[attr]}, which kiln's attention does not do")
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    past_k, past_v = (t.value(n, node) if n else None for n in names[3:5])
    if not (isinstance(past_k, KV) and isinstance(past_v, KV) and past_k.layer == past_v.layer
            and (past_k.which, past_v.which) == ("key", "value")):
        raise t.fail(node, "does not read one layer's past keys and values from the graph's inputs")
    if not all(isinstance(t.value(n, node), Mask) for n in names[5:7]):
        raise t.fail(node, "takes sequence lengths that are not computed from the attention mask")
    layer = past_k.layer
    if layer in t.layers:
        raise t.fail(node, f"is a second attention over layer {layer}'s cache")
    if names[1]:
        q, k, v = (t.tensor(n, node) for n in names[:3])
        head_dim = t.b.type_of(q).shape[-1] // heads
    else:
        qkv = t.tensor(names[0], node)
        head_dim = t.b.type_of(qkv).shape[-1] // (heads + 2 * kv_heads)
        D = head_dim
        q, k, v = (t.op("slice", qkv, begin=lo * D, end=hi * D, node=node)
                   for lo, hi in ((0, heads), (heads, heads + kv_heads), (heads + kv_heads, heads + 2 * kv_heads)))
    rope = None
    if a.get("do_rotary", 0):
        rope, mscale, rotary_dim = rope_param(t, node, names[7], names[8], head_dim)
        turn = {"head_dim": head_dim, "mscale": mscale, "rotary_dim": rotary_dim}
        positions = t.step["positions"]
        q = t.op("rope", q, positions, rope, node=node, **turn)
        k = t.op("rope", k, positions, rope, node=node, **turn)
    window = max(int(a.get("local_window_size", -1)), 0)
    kind = "sliding" if window else "full"
    pages = t.b.kv_cache(layer, KVSpec(kind, kv_heads, head_dim, head_dim, t.dtype, t.page_size,
                                        window=window or None))[0]
    q, k, v = (t.op("reshape", x, shape=("tokens", n, head_dim), node=node) for x, n in
               ((q, heads), (k, kv_heads), (v, kv_heads)))
    written = t.op("kv_append", k, v, pages, t.step["slot_mapping"], layer=layer, node=node)
    paging = [t.step[n] for n in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
    scale = float(a.get("scale", 0.0) or head_dim ** -0.5)
    attn = t.op("paged_attend", q, written, *paging, layer=layer, scale=scale, window=window,
                softcap=float(a.get("softcap", 0.0)), node=node)
    t.env[node.output[0]] = t.op("reshape", attn, shape=("tokens", heads * head_dim), node=node)
    outputs = list(node.output) + ["", ""]
    for name, which in ((outputs[1], "key"), (outputs[2], "value")):
        if name:
            t.env[name] = KV(layer, which, present=True)
    t.layers[layer] = Layer(layer, heads, kv_heads, head_dim, window, rope)
