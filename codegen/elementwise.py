"""Elementwise, reshape, gather and normalisation ops as Relax ops (legalised and scheduled by TVM)."""
from __future__ import annotations

from tvm import relax, te, tirx


def emit_add(ctx, node, a, b):
    return ctx.bb.emit(relax.op.add(a, b))


def emit_mul(ctx, node, a, b):
    return ctx.bb.emit(relax.op.multiply(a, b))


def emit_silu(ctx, node, x):
    return ctx.bb.emit(relax.op.nn.silu(x))


def emit_cast(ctx, node, x):
    return ctx.bb.emit(relax.op.astype(x, node.attrs["dtype"]))


def emit_reshape(ctx, node, x):
    return ctx.bb.emit(relax.op.reshape(x, ctx.shape(node.type.shape)))


def emit_slice(ctx, node, x):
    axis = len(x.ty.shape) - 1
    return ctx.bb.emit(relax.op.strided_slice(x, axes=[axis], begin=[node.attrs["begin"]], end=[node.attrs["end"]],
                                              assume_inbound=True))


def emit_swiglu(ctx, node, x):
    """silu(gate) * up over the two halves; TVM fuses the three into one kernel."""
    axis = len(x.ty.shape) - 1
    halves = ctx.bb.emit(relax.op.split(x, 2, axis=axis))
    gate = ctx.bb.emit(relax.TupleGetItem(halves, 0))
    up = ctx.bb.emit(relax.TupleGetItem(halves, 1))
    return ctx.bb.emit(relax.op.multiply(ctx.bb.emit(relax.op.nn.silu(gate)), up))


def emit_take_rows(ctx, node, x, rows):
    return ctx.bb.emit(relax.op.take(x, rows, axis=0, mode="clip"))


def emit_rms_norm(ctx, node, x, weight):
    """Normalise in float32, round to x's dtype, then scale by the weight (as transformers does)."""
    eps = node.attrs["eps"]
    dtype = node.type.dtype

    def rms_norm(x, w):
        h = int(x.shape[-1])
        k = te.reduce_axis((0, h), "k")
        sq = te.compute(x.shape[:-1], lambda *i: te.sum(x[i + (k,)].astype("float32") * x[i + (k,)].astype("float32"),
                                                        axis=k), name="sumsq")

        def out(*i):
            inv = tirx.rsqrt(sq[i[:-1]] / tirx.const(float(h), "float32") + tirx.const(eps, "float32"))
            normed = (x[i].astype("float32") * inv).astype(dtype)
            return (normed.astype("float32") * w[i[-1]].astype("float32")).astype(dtype)
        return te.compute(x.shape, out, name="rms_norm")
    return ctx.bb.emit_te(rms_norm, x, weight, primfunc_name_hint="rms_norm")


def emit_rope(ctx, node, x, positions, inv_freq):
    """Rotate-half rotary embedding over x [tokens, heads * head_dim]; angles in float32.
    Elementwise in form, so TVM fuses it with the slice of a fused QKV projection before it."""
    dtype, d = node.type.dtype, node.attrs["head_dim"]
    half = d // 2

    def rope(x, pos, inv):
        def out(t, c):
            i = tirx.truncmod(c, d)
            ang = pos[t].astype("float32") * inv[tirx.truncmod(i, half)]
            partner = tirx.if_then_else(i < half, -x[t, c + half].astype("float32"), x[t, c - half].astype("float32"))
            return (x[t, c].astype("float32") * tirx.cos(ang) + partner * tirx.sin(ang)).astype(dtype)
        return te.compute(x.shape, out, name="rope")
    return ctx.bb.emit_te(rope, x, positions, inv_freq, primfunc_name_hint="rope")
