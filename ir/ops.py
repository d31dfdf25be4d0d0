"""The op table: every IR op declared once, with its inputs, attributes, type rule and NumPy semantics.

The NumPy functions here *are* the meaning of each op (the reference interpreter
calls them). The registry and the helpers the families share are ir/opdef.py's; the families
(kv_ops, moe_ops, mla_ops, step_forms) register theirs when this module imports them. They compute in float32 and round to the node's dtype, which is
what the model code in `transformers` does for these ops.
"""
from __future__ import annotations

import numpy as np

from .opdef import (  # noqa: F401
    ACTIVATIONS,
    OPS,
    REQUIRED,
    OpDef,
    as_type,
    check_indices,
    check_kv_pages,
    check_kv_storage,
    f32,
    gelu_tanh_f32,
    need_float,
    op,
)
from .quant import INTEGER_LEVELS, SCHEMES, WEIGHT_FORMATS, group_scales, int8_activation_matmul
from .types import FLOAT_DTYPES, TensorType

# ---------------------------------------------------------------------------- elementwise

def _same_type_binary(types, attrs, fail):
    a, b = types
    if a != b:
        fail(f"operands must have the same type, got {a} and {b}")
    need_float(a, "operand", fail)
    return a


@op("add", ["a", "b"])
def _add():
    """a + b (same shapes)."""
    return _same_type_binary, lambda x, at, ty, dims: as_type(f32(x[0]) + f32(x[1]), ty)


@op("mul", ["a", "b"])
def _mul():
    """a * b (same shapes)."""
    return _same_type_binary, lambda x, at, ty, dims: as_type(f32(x[0]) * f32(x[1]), ty)


@op("silu", ["x"])
def _silu():
    """x * sigmoid(x)."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        return types[0]

    def ref(x, at, ty, dims):
        v = f32(x[0])
        return as_type(v / (1.0 + np.exp(-v)), ty)
    return rule, ref


GATED_OPS = {"silu": "swiglu", "gelu_tanh": "geglu"}      # gate activation -> the op over a fused gate|up


@op("gelu_tanh", ["x"])
def _gelu_tanh():
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh), in float32."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        return types[0]
    return rule, lambda x, at, ty, dims: as_type(gelu_tanh_f32(f32(x[0])), ty)


@op("mul_scalar", ["x"], {"value": REQUIRED})
def _mul_scalar():
    """x * value, the constant first rounded to x's dtype (as transformers makes Gemma's embedding
    normaliser a tensor of the activations' dtype)."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        return types[0]

    def ref(x, at, ty, dims):
        return as_type(f32(x[0]) * f32(as_type(np.float32(at["value"]), ty)), ty)
    return rule, ref


@op("softcap", ["x"], {"cap": REQUIRED})
def _softcap():
    """cap * tanh(x / cap), in float32: Gemma 2's final-logit soft-capping."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        if not attrs["cap"] > 0:
            fail(f"cap must be positive, got {attrs['cap']}")
        return types[0]

    def ref(x, at, ty, dims):
        cap = np.float32(at["cap"])
        return as_type(np.tanh(f32(x[0]) / cap) * cap, ty)
    return rule, ref


@op("cast", ["x"], {"dtype": REQUIRED})
def _cast():
    """x converted to another dtype."""
    def rule(types, attrs, fail):
        return TensorType(types[0].shape, attrs["dtype"])
    return rule, lambda x, at, ty, dims: as_type(f32(x[0]), ty)


@op("reshape", ["x"], {"shape": REQUIRED})
def _reshape():
    """x viewed with a new shape (same element count; symbolic dims must be kept in order)."""
    def rule(types, attrs, fail):
        src, dst = types[0].shape, tuple(attrs["shape"])
        if [d for d in src if isinstance(d, str)] != [d for d in dst if isinstance(d, str)]:
            fail(f"reshape must keep the symbolic dims of {types[0]}, got {dst}")
        if np.prod([d for d in src if isinstance(d, int)]) != np.prod([d for d in dst if isinstance(d, int)]):
            fail(f"reshape of {types[0]} to {dst} changes the element count")
        return TensorType(dst, types[0].dtype)

    def ref(x, at, ty, dims):
        return x[0].reshape([dims[d] if isinstance(d, str) else d for d in ty.shape])
    return rule, ref


# ---------------------------------------------------------------------------- model ops

def weight_format(node) -> str:
    """The stored format of the weight a linear, embed or moe_experts node reads (WEIGHT_FORMATS)."""
    return node.attrs.get("format", "none")


def _check_format(attrs, fail) -> str:
    fmt = attrs.get("format", "none")
    if fmt not in WEIGHT_FORMATS:
        fail(f"format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if SCHEMES.get(fmt) and SCHEMES[fmt].grouped and (attrs.get("group_size", 0) <= 0 or attrs["group_size"] % 2):
        fail(f"format {fmt} needs an even group_size > 0, got {attrs.get('group_size', 0)}")
    return fmt


def _table_dtype(attrs, scheme, fail) -> str:
    """A grouped format's scale table dtype: its scheme's, or float32 where `scale_dtype` says so (float16
    tables only: float32 holds each of theirs exactly)."""
    wide = attrs.get("scale_dtype", "")
    if wide and (wide != "float32" or scheme.scale_dtype != "float16"):
        fail(f"scale_dtype {wide!r}: only the float16 scale tables (q4, q8g, q4a) may be float32")
    return wide or scheme.scale_dtype


def _check_scale(scale, fmt: str, fail) -> None:
    if (scale is None) != (fmt == "none"):
        fail(f"a weight of format {fmt} takes {'no scale' if fmt == 'none' else 'a scale input'}")


@op("embed", ["ids", "table", "scale?"], {"format": "none", "dtype": "", "group_size": 0})
def _embed():
    """table[ids]: one row of the embedding table per token. `format` says how the table is stored:
      none  the rows as they are; the output has the table's dtype (`dtype` unset).
      q8    int8 table [vocab, hidden] with one float32 scale per row: row r reads table[r] * scale[r].
      fp8   float8 e4m3 table [vocab, hidden] with one float32 scale per row, read the same way.
      q4    u8 table [vocab, hidden/2] of two nibbles per byte (q + 8, even column low) with f16
            scales [hidden/group_size, vocab]: row r, column c reads (nibble - 8) * scale[c // group_size, r].
    A quantised table is decoded in float32 only in the gathered rows and rounded to `dtype`."""
    def rule(types, attrs, fail):
        ids, table, scale = types
        fmt = _check_format(attrs, fail)
        _check_scale(scale, fmt, fail)
        if ids.dtype != "int32" or ids.rank != 1:
            fail(f"ids must be i32[tokens], got {ids}")
        if fmt == "none":
            if table.rank != 2:
                fail(f"table must be 2-D [vocab, hidden], got {table}")
            return TensorType((ids.shape[0], table.shape[1]), table.dtype)
        scheme = SCHEMES[fmt]
        if fmt in ("q8g", "q4a", "q4k"):
            fail(f"an embedding table is stored q8 (a scale per row) or q4, not {fmt}")
        short = str(TensorType((), scheme.weight_dtype))[:-2]
        if attrs.get("dtype") not in FLOAT_DTYPES:
            fail(f"dtype must be a float dtype, got {attrs.get('dtype')!r}")
        if table.dtype != scheme.weight_dtype or table.rank != 2:
            fail(f"table must be {short}[vocab, {'hidden / 2' if scheme.grouped else 'hidden'}], got {table}")
        vocab, hidden = table.shape[0], table.shape[1] * (2 if scheme.grouped else 1)
        if scheme.grouped:
            g = attrs["group_size"]
            if hidden % g:
                fail(f"hidden width {hidden} must be a multiple of an even group_size {g}")
            if scale.dtype != "float16" or scale.shape != (hidden // g, vocab):
                fail(f"scale must be f16[{hidden // g}, {vocab}], got {scale}")
        elif scale.dtype != "float32" or scale.shape != (vocab,):
            fail(f"scale must be f32[{vocab}], got {scale}")
        return TensorType((ids.shape[0], hidden), attrs["dtype"])

    def ref(x, at, ty, dims):
        ids, fmt = np.asarray(x[0]), at.get("format", "none")
        if fmt == "none":
            return np.asarray(x[1])[ids]
        if fmt == "q4":
            packed = np.asarray(x[1])[ids]                                     # [tokens, hidden/2]
            low, high = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
            q = np.empty((len(ids), 2 * packed.shape[1]), np.float32)
            q[:, 0::2], q[:, 1::2] = low - 8, high - 8
            scale = f32(x[2])[:, ids].T                                       # [tokens, hidden/group]
            return as_type(q * np.repeat(scale, at["group_size"], axis=1), ty)
        rows = np.asarray(x[1])[ids].astype(np.float32)                       # the gathered rows only
        return as_type(rows * f32(x[2])[ids][:, None], ty)
    return rule, ref


def _linear_out(x: TensorType, n_out: int, bias, residual, fail) -> TensorType:
    """The output type of a linear, checking the optional bias and residual."""
    out = TensorType(x.shape[:-1] + (n_out,), x.dtype)
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype):
        fail(f"bias must be {x.dtype}[{n_out}], got {bias}")
    if residual is not None and residual != out:
        fail(f"residual must be {out}, got {residual}")
    return out


def _check_act_block(k, attrs, fail, group_size: int = 0) -> None:
    block = attrs.get("act_block", 0)
    if block and (k % block or block % 2 or (group_size and group_size % block)):
        fail(f"act_block {block} must be even and divide the input width {k}"
             + (f" and the group_size {group_size}" if group_size else ""))


@op("linear", ["x", "weight", "scale?", "bias?", "residual?"],
    {"format": "none", "group_size": 0, "act_block": 0, "scale_dtype": "", "kernels": None})
def _linear():
    """x @ W.T (+ bias) (+ residual), with W [out, in] as transformers stores it, read from `weight`
    as `format` says:
      none  W is `weight`, in x's dtype (no scale).
      q8    int8 weight [out, in] and float32 per-output-channel scales: W = weight * scale[:, None].
      fp8   float8 e4m3 weight [out, in] with float32 per-output-channel scales, read the same way.
      q4    u8 weight [out, in/2] of two nibbles (q + 8, even input index low) with f16 scales
            [in/group_size, out]: W[n, k] = (nibble - 8) * scale[k // group_size, n].
      q8g   int8 weight [out, in] with f16 scales [in/group_size, out]: W[n, k] = weight[n, k] *
            scale[k // group_size, n] (GGUF's Q8_0 for groups of 32).
      q4a   u8 weight [out, in/2] of two nibbles (the level 0..15, even input index low) with f16
            scales and minimums [2 · in/group_size, out]: W[n, k] = nibble · scale[2g, n] +
            scale[2g + 1, n], g = k // group_size (GGUF's Q4_1 for groups of 32).
      q4k   q4a's nibbles with u8 tables [20 · in/256, out]: per super-block of 256 inputs, each group's
            6-bit scale and depth and the super-block's float16 d and -dmin as bytes (ir/quant.py
            _q4k_quantize): W[n, k] = nibble · d · s_g - dmin · m_g (GGUF's Q4_K).
    scale_dtype "float32" (q4, q8g, q4a): their scale tables in float32 rather than f16 (a file's float32
    scales kept exactly: ONNX's MatMulNBits).
    A quantised weight is dequantised inside the kernel. act_block > 0 (q8, q4, q8g, q4a, q4k; dividing the
    group_size): x is quantised to int8 in blocks of act_block inputs per row (ir/quant.py
    quantize_activations) and each block's integer dot with the levels scaled by x's block scale
    (times the group's scale), the blocks summed in order (q4a, q4k adding Σ x's levels times x's block
    scale times the group's minimum after each), then scaled by q8's channel scale (llama.cpp's
    Q8_0 × Q8_0).

    The product is rounded to x's dtype and then the residual added, exactly as a separate add
    would; a fused kernel does it in its epilogue."""
    def rule(types, attrs, fail):
        x, w, s, b, r = types
        fmt = _check_format(attrs, fail)
        _check_scale(s, fmt, fail)
        if attrs.get("scale_dtype") and (fmt == "none" or not SCHEMES[fmt].grouped):
            fail(f"scale_dtype applies to the grouped formats' scale tables, not to format {fmt}")
        need_float(x, "x", fail)
        k = x.shape[-1]
        if fmt == "none":
            if w.rank != 2 or k != w.shape[1]:
                fail(f"weight must be [out, {k}], got {w}")
            if w.dtype != x.dtype:
                fail(f"weight dtype {w.dtype} differs from x dtype {x.dtype}")
        elif SCHEMES[fmt].grouped:
            scheme, g = SCHEMES[fmt], attrs["group_size"]
            per_byte, short = scheme.per_byte, "u8" if scheme.weight_dtype == "uint8" else "i8"
            if not isinstance(k, int) or not scheme.holds(k, g):
                fail(f"input width {k} must be a multiple of an even group_size {g}"
                     + (f" and of {scheme.super_block}" if scheme.super_block else ""))
            if w.dtype != scheme.weight_dtype or w.rank != 2 or w.shape[1] * per_byte != k:
                fail(f"weight must be {short}[out, {k // per_byte}], got {w}")
            want = TensorType((scheme.table_rows(k, g), w.shape[0]), _table_dtype(attrs, scheme, fail))
            if s != want:
                fail(f"scale must be {want}, got {s}")
        else:
            weight_dtype = SCHEMES[fmt].weight_dtype
            if w.dtype != weight_dtype or w.rank != 2 or w.shape[1] != k:
                fail(f"weight must be {str(TensorType((), weight_dtype))[:-2]}[out, {k}], got {w}")
            if s.dtype != "float32" or s.shape != (w.shape[0],):
                fail(f"scale must be f32[{w.shape[0]}], got {s}")
        if attrs.get("act_block", 0) and fmt not in INTEGER_LEVELS:
            fail(f"act_block applies to {', '.join(INTEGER_LEVELS)} weights, not {fmt}")
        grouped = fmt in SCHEMES and SCHEMES[fmt].grouped
        _check_act_block(k, attrs, fail, attrs.get("group_size", 0) if grouped else 0)
        return _linear_out(x, w.shape[0], b, r, fail)

    def ref(x, at, ty, dims):
        fmt, block = at.get("format", "none"), at.get("act_block", 0)
        epilogue = x[3:]
        if fmt == "none":
            return _linear_ref(f32(x[0]) @ f32(x[1]).T, epilogue, ty)
        if SCHEMES[fmt].grouped:
            packed = np.asarray(x[1])
            levels = (np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float32)
                      - (8 if fmt == "q4" else 0) if fmt != "q8g" else packed.astype(np.float32))
            g = at["group_size"]
            scale, minimum = group_scales(fmt, np.asarray(x[2]), g)
            if block:
                rows = f32(x[0]).reshape(-1, x[0].shape[-1])
                y = int8_activation_matmul(rows, levels, lambda b: scale[b * block // g], block,
                                           None if minimum is None else lambda b: minimum[b * block // g])
                return _linear_ref(y.reshape(*x[0].shape[:-1], -1), epilogue, ty)
            w = levels * np.repeat(scale.T, g, axis=1)
            w = w if minimum is None else w + np.repeat(minimum.T, g, axis=1)
            return _linear_ref(f32(x[0]) @ w.T, epilogue, ty)
        if block:
            rows = f32(x[0]).reshape(-1, x[0].shape[-1])
            y = int8_activation_matmul(rows, np.asarray(x[1]), None, block) * f32(x[2])[None, :]
            return _linear_ref(y.reshape(*x[0].shape[:-1], -1), epilogue, ty)
        w = np.asarray(x[1]).astype(np.float32) * f32(x[2])[:, None]        # dequantised, float32
        return _linear_ref(f32(x[0]) @ w.T, epilogue, ty)
    return rule, ref


def _linear_ref(y: np.ndarray, extras, ty: TensorType) -> np.ndarray:
    """The epilogue: + bias, round, + residual, round."""
    bias = extras[0] if len(extras) > 0 else None
    residual = extras[1] if len(extras) > 1 else None
    if bias is not None:
        y = y + f32(bias)
    if residual is not None:
        y = f32(as_type(y, ty)) + f32(residual)
    return as_type(y, ty)


@op("rms_norm", ["x", "weight"], {"eps": REQUIRED, "offset": 0.0, "weight_in_float32": False})
def _rms_norm():
    """(offset + weight) * (x / sqrt(mean(x^2) + eps)) over the last axis, normalised in float32.
    Llama's order (weight_in_float32 False): the normalised x is rounded to x's dtype, then scaled and
    rounded again. OLMo 2's and Gemma's (True): scaled in float32, rounded once. Gemma stores the
    weight as an offset from 1 (offset 1.0, added in float32)."""
    def rule(types, attrs, fail):
        x, w = types
        need_float(x, "x", fail)
        if w.shape != (x.shape[-1],):
            fail(f"weight must be [{x.shape[-1]}], got {w}")
        return x

    def ref(x, at, ty, dims):
        v = f32(x[0])
        normed = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + np.float32(at["eps"]))
        weight = f32(x[1]) + np.float32(at["offset"])
        if at["weight_in_float32"]:
            return as_type(normed * weight, ty)
        return as_type(f32(as_type(normed, ty)) * weight, ty)
    return rule, ref


@op("rope", ["x", "positions", "inv_freq"], {"head_dim": REQUIRED, "mscale": 1.0, "rotary_dim": 0})
def _rope():
    """Rotary embedding, rotate-half layout, on x [tokens, heads * head_dim]: the first R =
    rotary_dim elements of each head of token t (all when 0) rotated by positions[t] * inv_freq
    (elements i and i + R/2 form a pair) and scaled by `mscale` (YaRN's and LongRoPE's attention
    factor, which transformers folds into cos and sin); the other head_dim - R pass through."""
    def rule(types, attrs, fail):
        x, pos, inv = types
        d = attrs["head_dim"]
        r = attrs["rotary_dim"] or d
        if x.rank != 2 or not isinstance(x.shape[1], int) or x.shape[1] % d or r % 2 or not 0 < r <= d:
            fail(f"x must be [tokens, heads * {d}] with an even rotary_dim <= {d}, got {x}, rotary_dim {r}")
        if pos.dtype != "int32" or pos.shape != (x.shape[0],):
            fail(f"positions must be i32[{x.shape[0]}], got {pos}")
        if inv.dtype != "float32" or inv.shape != (r // 2,):
            fail(f"inv_freq must be f32[{r // 2}], got {inv}")
        return x

    def ref(x, at, ty, dims):
        d = at["head_dim"]
        r = at["rotary_dim"] or d
        v = f32(x[0]).reshape(x[0].shape[0], -1, d)                                # [T, H, D]
        turn, keep = v[..., :r], v[..., r:]
        ang = np.asarray(x[1], np.float32)[:, None] * f32(x[2])[None, :]       # [T, R/2]
        cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
        sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
        rotated = np.concatenate([-turn[..., r // 2:], turn[..., :r // 2]], -1)
        turned = (turn * cos + rotated * sin) * np.float32(at["mscale"])
        return as_type(np.concatenate([turned, keep], -1).reshape(x[0].shape), ty)
    return rule, ref


ATTENTION_OPS = ("paged_attention", "paged_attention_fused")     # both read inputs kv_pages and kv_scales?


@op("qk_norm", ["qkv", "q_weight", "k_weight"],
    {"q_heads": REQUIRED, "kv_heads": REQUIRED, "head_dim": REQUIRED, "per_head": REQUIRED, "eps": REQUIRED,
     "offset": 0.0, "weight_in_float32": False})
def _qk_norm():
    """RMSNorm of the q and k columns of a fused projection qkv [tokens, (Hq + 2 Hkv) D], v passed
    through: per head over D with weights [D] (`per_head`, Qwen3 and Gemma 3), or over all of q's
    Hq·D and all of k's Hkv·D columns with weights of those widths (OLMo 2). Each norm computes as
    rms_norm does: normalised in float32, scaled by (offset + weight), rounded to qkv's dtype once
    (weight_in_float32) or before the scaling too."""
    def rule(types, attrs, fail):
        qkv, qw, kw = types
        d, hq, hkv = attrs["head_dim"], attrs["q_heads"], attrs["kv_heads"]
        need_float(qkv, "qkv", fail)
        if qkv.rank != 2 or qkv.shape[1] != (hq + 2 * hkv) * d:
            fail(f"qkv must be [tokens, {(hq + 2 * hkv) * d}], got {qkv}")
        want_q, want_k = ((d,), (d,)) if attrs["per_head"] else ((hq * d,), (hkv * d,))
        if qw.shape != want_q or kw.shape != want_k or qw.dtype != qkv.dtype or kw.dtype != qkv.dtype:
            fail(f"q/k weights must be {qkv.dtype}{list(want_q)} and {list(want_k)}, got {qw}, {kw}")
        return qkv

    def ref(x, at, ty, dims):
        d, hq, hkv = at["head_dim"], at["q_heads"], at["kv_heads"]
        qkv = f32(x[0])
        out = qkv.copy()
        for lo, heads, w in ((0, hq, f32(x[1])), (hq * d, hkv, f32(x[2]))):
            part = qkv[:, lo:lo + heads * d]
            part = part.reshape(len(part), heads, d) if at["per_head"] else part
            mean_sq = np.mean(part * part, axis=-1, keepdims=True)
            normed = part / np.sqrt(mean_sq + np.float32(at["eps"]))
            if not at["weight_in_float32"]:
                normed = f32(as_type(normed, ty))
            out[:, lo:lo + heads * d] = (normed * (w + np.float32(at["offset"]))).reshape(len(part), -1)
        return as_type(out, ty)
    return rule, ref


@op("take_rows", ["x", "rows"])
def _take_rows():
    """x[rows]: the rows of the tokens whose logits are wanted (each sequence's last)."""
    def rule(types, attrs, fail):
        x, rows = types
        if x.rank != 2 or rows.dtype != "int32" or rows.rank != 1:
            fail(f"take_rows wants x[tokens, hidden] and i32 rows, got {x}, {rows}")
        return TensorType((rows.shape[0], x.shape[1]), x.dtype)
    return rule, lambda x, at, ty, dims: np.asarray(x[0])[np.asarray(x[1])]


@op("slice", ["x"], {"begin": REQUIRED, "end": REQUIRED})
def _slice():
    """x[..., begin:end]: a range of the last axis (the q, k or v part of a fused projection)."""
    def rule(types, attrs, fail):
        x = types[0]
        b, e = attrs["begin"], attrs["end"]
        if not (isinstance(x.shape[-1], int) and 0 <= b < e <= x.shape[-1]):
            fail(f"slice [{b}:{e}] is outside the last axis of {x}")
        return TensorType(x.shape[:-1] + (e - b,), x.dtype)
    return rule, lambda x, at, ty, dims: np.ascontiguousarray(np.asarray(x[0])[..., at["begin"]:at["end"]])


def _gated(name: str, activation: str):
    """Type rule and reference of act(x[..., :n]) * x[..., n:] for x [..., 2n]."""
    def rule(types, attrs, fail):
        x = types[0]
        need_float(x, "x", fail)
        if not isinstance(x.shape[-1], int) or x.shape[-1] % 2:
            fail(f"{name} needs an even last axis, got {x}")
        return TensorType(x.shape[:-1] + (x.shape[-1] // 2,), x.dtype)

    def ref(x, at, ty, dims):
        v = f32(x[0])
        n = v.shape[-1] // 2
        gate = f32(as_type(v[..., :n], ty))
        act = f32(as_type(ACTIVATIONS[activation](gate), ty))    # rounded like the activation, then mul, in the model
        return as_type(act * v[..., n:], ty)
    return rule, ref


@op("swiglu", ["x"])
def _swiglu():
    """silu(x[..., :n]) * x[..., n:] for x [..., 2n]: gate and up halves of a fused projection."""
    return _gated("swiglu", "silu")


@op("geglu", ["x"])
def _geglu():
    """gelu_tanh(x[..., :n]) * x[..., n:] for x [..., 2n]: Gemma's gated MLP on a fused projection."""
    return _gated("geglu", "gelu_tanh")


from . import (
    imported_ops,  # noqa: E402,F401  (registers the ops imported graphs spell kiln's with)
    kv_ops,  # noqa: E402,F401  (registers the paged KV cache ops)
    lora_ops,  # noqa: E402,F401  (registers lora)
    mla_ops,  # noqa: E402,F401  (registers the latent-cache attention ops)
    moe_ops,  # noqa: E402,F401  (registers moe_router and moe_experts)
    step_forms,  # noqa: E402,F401  (registers step_choice)
)

APPEND_OPS = ("kv_append", "latent_append")              # write a step's rows; their result is the pages
LATENT_OPS = ("latent_append", "mla_attend", "latent_attend", "latent_gather")
KV_OPS = ("kv_append", "paged_attend", *ATTENTION_OPS, *LATENT_OPS)   # the ops that read or write a layer's KV cache
