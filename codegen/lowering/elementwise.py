"""Elementwise, reshape, gather and normalisation ops as Relax ops (legalised and scheduled by TVM)."""
from __future__ import annotations

import numpy as np
from tvm import relax, te, tirx

from kiln.ir import input_of
from kiln.ir.types import numpy_dtype


def emit_add(ctx, node, a, b):
    return ctx.bb.emit(relax.op.add(a, b))


def emit_mul(ctx, node, a, b):
    return ctx.bb.emit(relax.op.multiply(a, b))


def emit_silu(ctx, node, x):
    return ctx.bb.emit(relax.op.nn.silu(x))


def _gelu_tanh_te(x, dtype: str):
    """GELU (tanh approximation) computed in float32, rounded to `dtype`."""
    def out(*i):
        v = x[i].astype("float32")
        inner = tirx.const(0.7978845608028654, "float32") * (v + tirx.const(0.044715, "float32") * v * v * v)
        return (tirx.const(0.5, "float32") * v * (tirx.const(1.0, "float32") + tirx.tanh(inner))).astype(dtype)
    return te.compute(x.shape, out, name="gelu_tanh")


def emit_gelu_tanh(ctx, node, x):
    return ctx.bb.emit_te(_gelu_tanh_te, x, node.type.dtype, primfunc_name_hint="gelu_tanh")


def emit_mul_scalar(ctx, node, x):
    dtype = node.type.dtype
    value = relax.const(np.array(node.attrs["value"], np.float32).astype(numpy_dtype(dtype)), dtype)
    return ctx.bb.emit(relax.op.multiply(x, value))


def emit_softcap(ctx, node, x):
    """cap * tanh(x / cap) in float32."""
    cap, dtype = node.attrs["cap"], node.type.dtype

    def softcap(x):
        return te.compute(x.shape, lambda *i: (tirx.tanh(x[i].astype("float32") / tirx.const(cap, "float32"))
                                               * tirx.const(cap, "float32")).astype(dtype), name="softcap")
    return ctx.bb.emit_te(softcap, x, primfunc_name_hint="softcap")


def emit_cast(ctx, node, x):
    return ctx.bb.emit(relax.op.astype(x, node.attrs["dtype"]))


def emit_reshape(ctx, node, x):
    return ctx.bb.emit(relax.op.reshape(x, ctx.shape(node.type.shape)))


def emit_slice(ctx, node, x):
    axis = len(x.ty.shape) - 1
    return ctx.bb.emit(relax.op.strided_slice(x, axes=[axis], begin=[node.attrs["begin"]], end=[node.attrs["end"]],
                                              assume_inbound=True))


def emit_gated(ctx, node, x):
    """swiglu / geglu: act(gate) * up over the two halves; TVM fuses them into one kernel. Where the
    gate/up linear's kernel applied it already (codegen/lower.py: gate_of) nothing is left to do;
    where its weights are stored 'gated' but its kernel did not, gate and up columns alternate."""
    form = ctx.gated.get(input_of(node, "x"))
    if form == "fused":
        return x
    return gated(ctx, x, "silu" if node.op == "swiglu" else "gelu_tanh", node.type.dtype, form == "interleaved")


def gated(ctx, x, activation: str, dtype: str, interleaved: bool = False):
    """act(x[..., :n]) * x[..., n:] for x [..., 2n] (activation silu or gelu_tanh); `interleaved`:
    act(x[..., 0::2]) * x[..., 1::2]."""
    axis = len(x.ty.shape) - 1
    if interleaved:
        width = int(x.ty.shape[axis])
        gate, up = (ctx.bb.emit(relax.op.strided_slice(x, axes=[axis], begin=[first], end=[width], strides=[2]))
                    for first in (0, 1))
    else:
        halves = ctx.bb.emit(relax.op.split(x, 2, axis=axis))
        gate = ctx.bb.emit(relax.TupleGetItem(halves, 0))
        up = ctx.bb.emit(relax.TupleGetItem(halves, 1))
    if activation == "silu":
        act = ctx.bb.emit(relax.op.nn.silu(gate))
    else:
        act = ctx.bb.emit_te(_gelu_tanh_te, gate, dtype, primfunc_name_hint="gelu_tanh")
    return ctx.bb.emit(relax.op.multiply(act, up))


def emit_sigmoid_gate(ctx, node, x, gate):
    """x * sigmoid(gate), the sigmoid rounded to x's dtype first."""
    return ctx.bb.emit(relax.op.multiply(x, ctx.bb.emit(relax.op.sigmoid(gate))))


def emit_take_rows(ctx, node, x, rows):
    return ctx.bb.emit(relax.op.take(x, rows, axis=0, mode="clip"))


def _scaled(normed, weight, dtype: str, offset: float, weight_in_float32: bool):
    """An RMS-normalised float32 value times (offset + weight), rounded to `dtype` as the op says:
    once at the end (weight_in_float32), or also before the scaling (Llama)."""
    if not weight_in_float32:
        normed = normed.astype(dtype).astype("float32")
    scale = weight.astype("float32") + tirx.const(offset, "float32") if offset else weight.astype("float32")
    return (normed * scale).astype(dtype)


def emit_rms_norm(ctx, node, x, weight):
    """Normalise in float32, then scale by (offset + weight): Llama rounds the normalised value to
    x's dtype first, OLMo 2 and Gemma (weight_in_float32) scale in float32 and round once."""
    eps, offset, weight_in_float32 = node.attrs["eps"], node.attrs["offset"], node.attrs["weight_in_float32"]
    dtype = node.type.dtype

    def rms_norm(x, w):
        h = int(x.shape[-1])
        k = te.reduce_axis((0, h), "k")
        sq = te.compute(x.shape[:-1], lambda *i: te.sum(x[i + (k,)].astype("float32") * x[i + (k,)].astype("float32"),
                                                        axis=k), name="sumsq")

        def out(*i):
            inv = tirx.rsqrt(sq[i[:-1]] / tirx.const(float(h), "float32") + tirx.const(eps, "float32"))
            return _scaled(x[i].astype("float32") * inv, w[i[-1]], dtype, offset, weight_in_float32)
        return te.compute(x.shape, out, name="rms_norm")
    return ctx.bb.emit_te(rms_norm, x, weight, primfunc_name_hint="rms_norm")


def emit_qk_norm(ctx, node, qkv, q_weight, k_weight):
    """RMSNorm of qkv's q and k columns (per head, or over each part), v passed through; one kernel."""
    a, dtype = node.attrs, node.type.dtype
    hq, hkv, d, per_head = a["q_heads"], a["kv_heads"], a["head_dim"], a["per_head"]
    eps, offset, weight_in_float32 = a["eps"], a["offset"], a["weight_in_float32"]

    def qk_norm(x, qw, kw):
        tokens = x.shape[0]
        normed_cols = (hq + hkv) * d             # q and k; v's columns after them pass through
        if per_head:
            k = te.reduce_axis((0, d), "k")
            sq = te.compute((tokens, hq + hkv), lambda t, g: te.sum(
                x[t, g * d + k].astype("float32") * x[t, g * d + k].astype("float32"), axis=k), name="sumsq")
        else:
            def square(t, c):
                return x[t, c].astype("float32") * x[t, c].astype("float32")
            kq, kk = te.reduce_axis((0, hq * d), "kq"), te.reduce_axis((0, hkv * d), "kk")
            sq_q = te.compute((tokens,), lambda t: te.sum(square(t, kq), axis=kq), name="sumsq_q")
            sq_k = te.compute((tokens,), lambda t: te.sum(square(t, hq * d + kk), axis=kk), name="sumsq_k")

        def out(t, c):
            inside = c < normed_cols
            col = tirx.min(c, normed_cols - 1)
            if per_head:
                total, n = sq[t, tirx.truncdiv(col, d)], tirx.const(float(d), "float32")
                w = tirx.if_then_else(col < hq * d, qw[tirx.truncmod(col, d)], kw[tirx.truncmod(col, d)])
            else:
                in_q = col < hq * d
                total = tirx.if_then_else(in_q, sq_q[t], sq_k[t])
                n = tirx.if_then_else(in_q, tirx.const(float(hq * d), "float32"), tirx.const(float(hkv * d), "float32"))
                w = tirx.if_then_else(in_q, qw[tirx.min(col, hq * d - 1)], kw[tirx.max(col - hq * d, 0)])
            normed = x[t, c].astype("float32") * tirx.rsqrt(total / n + tirx.const(eps, "float32"))
            return tirx.if_then_else(inside, _scaled(normed, w, dtype, offset, weight_in_float32), x[t, c])
        return te.compute(x.shape, out, name="qk_norm")
    return ctx.bb.emit_te(qk_norm, qkv, q_weight, k_weight, primfunc_name_hint="qk_norm")


def emit_rope(ctx, node, x, positions, inv_freq):
    """Rotate-half rotary embedding over x [tokens, heads * head_dim]; angles in float32.
    Elementwise in form, so TVM fuses it with the slice of a fused QKV projection before it."""
    dtype, d, mscale = node.type.dtype, node.attrs["head_dim"], node.attrs["mscale"]
    rotary = node.attrs["rotary_dim"] or d
    half = rotary // 2

    def rope(x, pos, inv):
        def out(t, c):
            i = tirx.truncmod(c, d)
            ang = pos[t].astype("float32") * inv[tirx.truncmod(i, half)]
            partner = tirx.if_then_else(i < half, -x[t, c + half].astype("float32"), x[t, c - half].astype("float32"))
            turned = x[t, c].astype("float32") * tirx.cos(ang) + partner * tirx.sin(ang)
            turned = (turned * tirx.const(mscale, "float32") if mscale != 1.0 else turned).astype(dtype)
            return turned if rotary == d else tirx.if_then_else(i < rotary, turned, x[t, c])
        return te.compute(x.shape, out, name="rope")
    return ctx.bb.emit_te(rope, x, positions, inv_freq, primfunc_name_hint="rope")
