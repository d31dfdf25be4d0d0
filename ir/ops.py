"""The op table: every IR op declared once, with its inputs, attributes, type rule and NumPy semantics.

The NumPy functions here *are* the meaning of each op (the reference interpreter
calls them). The registry and the helpers the families share are ir/opdef.py's; the families
(kv_ops, moe_ops, mla_ops, step_forms) register theirs when this module imports them. They compute in float32 and round to the node's dtype, which is
what the model code in `transformers` does for these ops.
"""
from __future__ import annotations

import numpy as np

from .opdef import (ACTIVATIONS, OPS, REQUIRED, OpDef, as_type, check_indices, check_kv_pages,  # noqa: F401
                    check_kv_storage, f32, gelu_tanh_f32, need_float, op)
from .quant import int8_activation_matmul
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

@op("embed", ["ids", "table"])
def _embed():
    """table[ids]: one row of the embedding table per token."""
    def rule(types, attrs, fail):
        ids, table = types
        if ids.dtype != "int32" or ids.rank != 1:
            fail(f"ids must be i32[tokens], got {ids}")
        if table.rank != 2:
            fail(f"table must be 2-D [vocab, hidden], got {table}")
        return TensorType((ids.shape[0], table.shape[1]), table.dtype)
    return rule, lambda x, at, ty, dims: np.asarray(x[1])[np.asarray(x[0])]


def _quantized_embed_rule(table_dtype: str, grouped: bool):
    """The type rule of embed_q8/fp8 (`grouped` False: one f32 scale per row) and embed_q4
    (two nibbles per byte along hidden, f16 scales [hidden / group_size, vocab])."""
    short = str(TensorType((), table_dtype))[:-2]

    def rule(types, attrs, fail):
        ids, table, scale = types
        if ids.dtype != "int32" or ids.rank != 1:
            fail(f"ids must be i32[tokens], got {ids}")
        if attrs["dtype"] not in FLOAT_DTYPES:
            fail(f"dtype must be a float dtype, got {attrs['dtype']!r}")
        if table.dtype != table_dtype or table.rank != 2:
            fail(f"table must be {short}[vocab, {'hidden / 2' if grouped else 'hidden'}], got {table}")
        vocab, hidden = table.shape[0], table.shape[1] * (2 if grouped else 1)
        if grouped:
            g = attrs["group_size"]
            if g <= 0 or g % 2 or hidden % g:
                fail(f"hidden width {hidden} must be a multiple of an even group_size {g}")
            if scale.dtype != "float16" or scale.shape != (hidden // g, vocab):
                fail(f"scale must be f16[{hidden // g}, {vocab}], got {scale}")
        elif scale.dtype != "float32" or scale.shape != (vocab,):
            fail(f"scale must be f32[{vocab}], got {scale}")
        return TensorType((ids.shape[0], hidden), attrs["dtype"])
    return rule


def _per_row_embed_ref(x, at, ty, dims):
    """Gather the rows first, then dequantise only those: q[ids] * scale[ids][:, None]."""
    ids = np.asarray(x[0])
    rows = np.asarray(x[1])[ids].astype(np.float32)                           # [tokens, hidden]
    return as_type(rows * f32(x[2])[ids][:, None], ty)


@op("embed_q8", ["ids", "table", "scale"], {"dtype": REQUIRED})
def _embed_q8():
    """table[ids] from an int8 table [vocab, hidden] with one float32 scale per row: row r reads
    table[r] * scale[r], computed in float32 and rounded to `dtype` (only gathered rows are decoded)."""
    return _quantized_embed_rule("int8", grouped=False), _per_row_embed_ref


@op("embed_fp8", ["ids", "table", "scale"], {"dtype": REQUIRED})
def _embed_fp8():
    """table[ids] from a float8 e4m3 table [vocab, hidden] with one float32 scale per row: row r
    reads table[r] * scale[r], computed in float32 and rounded to `dtype`."""
    return _quantized_embed_rule("float8_e4m3fn", grouped=False), _per_row_embed_ref


@op("embed_q4", ["ids", "table", "scale"], {"dtype": REQUIRED, "group_size": REQUIRED})
def _embed_q4():
    """table[ids] from an int4 table in groups along hidden: table u8[vocab, hidden/2] holds two
    nibbles per byte (q + 8, even column low), scale f16[hidden/group_size, vocab]; row r, column c
    reads (nibble - 8) * scale[c // group_size, r], rounded to `dtype`."""
    def ref(x, at, ty, dims):
        ids = np.asarray(x[0])
        packed = np.asarray(x[1])[ids]                                         # [tokens, hidden/2]
        low, high = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
        q = np.empty((len(ids), 2 * packed.shape[1]), np.float32)
        q[:, 0::2], q[:, 1::2] = low - 8, high - 8
        scale = f32(x[2])[:, ids].T                                           # [tokens, hidden/group]
        return as_type(q * np.repeat(scale, at["group_size"], axis=1), ty)
    return _quantized_embed_rule("uint8", grouped=True), ref


EMBED_OPS = ("embed", "embed_q8", "embed_q4", "embed_fp8")      # all: ids at input 0, table at 1


def _linear_out(x: TensorType, n_out: int, bias, residual, fail) -> TensorType:
    """The output type of every linear variant, checking the optional bias and residual."""
    out = TensorType(x.shape[:-1] + (n_out,), x.dtype)
    if bias is not None and (bias.shape != (n_out,) or bias.dtype != x.dtype):
        fail(f"bias must be {x.dtype}[{n_out}], got {bias}")
    if residual is not None and residual != out:
        fail(f"residual must be {out}, got {residual}")
    return out


@op("linear", ["x", "weight", "bias?", "residual?"])
def _linear():
    """x @ weight.T (+ bias) (+ residual), with weight [out, in] as transformers stores it.

    The GEMM result is rounded to x's dtype and then the residual added, exactly as a separate add
    would; a fused kernel does it in its epilogue."""
    def rule(types, attrs, fail):
        x, w, b, r = types
        need_float(x, "x", fail)
        if w.rank != 2 or x.shape[-1] != w.shape[1]:
            fail(f"weight must be [out, {x.shape[-1]}], got {w}")
        if w.dtype != x.dtype:
            fail(f"weight dtype {w.dtype} differs from x dtype {x.dtype}")
        return _linear_out(x, w.shape[0], b, r, fail)

    def ref(x, at, ty, dims):
        return _linear_ref(f32(x[0]) @ f32(x[1]).T, x[2:], ty)
    return rule, ref


def _per_channel_linear(weight_dtype: str):
    """Type rule and reference of a linear whose weight is stored in `weight_dtype` with one float32
    scale per output channel: x @ (weight * scale[:, None]).T (+ bias) (+ residual). An op that
    declares an `act_block` attr (linear_q8) and sets it > 0 quantises x as ir/quant.py quantize_activations
    says and sums integer dots per block (int8_activation_matmul), then scales by the weight's."""
    short = str(TensorType((), weight_dtype))[:-2]

    def rule(types, attrs, fail):
        x, w, s, b, r = types
        need_float(x, "x", fail)
        if w.dtype != weight_dtype or w.rank != 2 or w.shape[1] != x.shape[-1]:
            fail(f"weight must be {short}[out, {x.shape[-1]}], got {w}")
        if s.dtype != "float32" or s.shape != (w.shape[0],):
            fail(f"scale must be f32[{w.shape[0]}], got {s}")
        _check_act_block(x.shape[-1], attrs, fail)
        return _linear_out(x, w.shape[0], b, r, fail)

    def ref(x, at, ty, dims):
        if at.get("act_block"):
            rows = f32(x[0]).reshape(-1, x[0].shape[-1])
            y = int8_activation_matmul(rows, np.asarray(x[1]), None, at["act_block"]) * f32(x[2])[None, :]
            return _linear_ref(y.reshape(*x[0].shape[:-1], -1), x[3:], ty)
        w = np.asarray(x[1]).astype(np.float32) * f32(x[2])[:, None]        # dequantised, float32
        return _linear_ref(f32(x[0]) @ w.T, x[3:], ty)
    return rule, ref


def _check_act_block(k, attrs, fail, group_size: int = 0) -> None:
    block = attrs.get("act_block", 0)
    if block and (k % block or block % 2 or (group_size and group_size % block)):
        fail(f"act_block {block} must be even and divide the input width {k}"
             + (f" and the group_size {group_size}" if group_size else ""))


@op("linear_q8", ["x", "weight", "scale", "bias?", "residual?"], {"act_block": 0})
def _linear_q8():
    """linear with an int8 weight [out, in] and float32 per-output-channel scales:
    x @ (weight * scale[:, None]).T (+ bias) (+ residual), dequantised inside the kernel.
    act_block > 0: x is quantised to int8 in blocks of act_block inputs per row (ir/quant.py
    quantize_activations) and each block's integer dot scaled by the block's x scale, then the sum
    by the weight's scale (llama.cpp's Q8_0 × Q8_0 with per-channel weight scales)."""
    return _per_channel_linear("int8")


@op("linear_fp8", ["x", "weight", "scale", "bias?", "residual?"])
def _linear_fp8():
    """linear with a float8 e4m3 weight [out, in] and float32 per-output-channel scales:
    x @ (weight * scale[:, None]).T (+ bias) (+ residual), dequantised inside the kernel."""
    return _per_channel_linear("float8_e4m3fn")


@op("linear_q4", ["x", "weight", "scale", "bias?", "residual?"], {"group_size": REQUIRED, "act_block": 0})
def _linear_q4():
    """linear with int4 weights in groups along the input axis: weight u8[out, in/2] holds two
    nibbles (q + 8, even input index low), scale f16[in/group_size, out];
    x @ W.T with W[n, k] = (nibble - 8) * scale[k // group_size, n] (+ bias) (+ residual).
    act_block > 0 (dividing group_size): x is quantised to int8 in blocks of act_block inputs per
    row (ir/quant.py quantize_activations); each block's integer dot with the levels (nibble - 8)
    is scaled by x's block scale times the group's scale, and the blocks summed in order."""
    def rule(types, attrs, fail):
        x, w, s, b, r = types
        need_float(x, "x", fail)
        g = attrs["group_size"]
        k = x.shape[-1]
        if not isinstance(k, int) or k % g or g % 2:
            fail(f"input width {k} must be a multiple of an even group_size {g}")
        if w.dtype != "uint8" or w.rank != 2 or w.shape[1] * 2 != k:
            fail(f"weight must be u8[out, {k // 2}], got {w}")
        if s.dtype != "float16" or s.shape != (k // g, w.shape[0]):
            fail(f"scale must be f16[{k // g}, {w.shape[0]}], got {s}")
        _check_act_block(k, attrs, fail, g)
        return _linear_out(x, w.shape[0], b, r, fail)

    def ref(x, at, ty, dims):
        packed = np.asarray(x[1])
        levels = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1).astype(np.float32) - 8
        scale, g, block = f32(x[2]), at["group_size"], at.get("act_block", 0)
        if block:
            rows = f32(x[0]).reshape(-1, x[0].shape[-1])
            y = int8_activation_matmul(rows, levels, lambda b: scale[b * block // g], block)
            return _linear_ref(y.reshape(*x[0].shape[:-1], -1), x[3:], ty)
        w = levels * np.repeat(scale.T, g, axis=1)
        return _linear_ref(f32(x[0]) @ w.T, x[3:], ty)
    return rule, ref


def _linear_ref(y: np.ndarray, extras, ty: TensorType) -> np.ndarray:
    """The epilogue shared by linear and linear_q8: + bias, round, + residual, round."""
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


from . import kv_ops  # noqa: E402,F401  (registers the paged KV cache ops)
from . import moe_ops  # noqa: E402,F401  (registers moe_router and moe_experts)
from . import mla_ops  # noqa: E402,F401  (registers the latent-cache attention ops)
from . import step_forms  # noqa: E402,F401  (registers step_choice)

APPEND_OPS = ("kv_append", "latent_append")              # write a step's rows; their result is the pages
LATENT_OPS = ("latent_append", "mla_attend", "latent_attend", "latent_gather")
KV_OPS = ("kv_append", "paged_attend", *ATTENTION_OPS, *LATENT_OPS)   # the ops that read or write a layer's KV cache
