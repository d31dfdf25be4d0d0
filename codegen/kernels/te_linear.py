"""The linear as TE compute, for the kernels TVM schedules: y = x @ W.T in float32 over any stored
weight format (ir/ops.py's semantics), then the shared epilogue. dlight's GPU rules (decode GEMV)
and TVM's default schedules take it; so does the reference the kernel tests compare against."""
from __future__ import annotations

from tvm import relax, te, tirx

from kiln.selection.formats import WeightFormat

from .weight_format import epilogue, epilogue_scale, group_minimum, group_scale, weight_level, weight_value


def nt_matmul(x, w, scale, bias, residual, out_dtype, fmt: WeightFormat, staged: bool = False):
    """y[m, n] = sum_k x[m, k] * W[n, k], accumulated in float32, then the epilogue. `staged`: q4
    weights are decoded in a stage of their own, "dequantize", which dlight's GEMV rules compute
    into registers tile by tile (the same float32 values: nothing rounds differently)."""
    if fmt.act_block:
        acc = int8_activation_matmul(x, w, scale, fmt)
    else:
        weight = lambda n, k: weight_value(fmt, lambda j, kk: w[j, kk], scale, n, k)      # noqa: E731
        if staged and fmt.nibbles:
            weight = te.compute((w.shape[0], x.shape[1]), weight, name="dequantize")
        k = te.reduce_axis((0, x.shape[1]), "k")
        acc = te.compute((x.shape[0], w.shape[0]), lambda m, n: te.sum(
            x[m, k].astype("float32") * weight(n, k), axis=k), name="matmul")
    return te.compute(acc.shape, epilogue(acc, epilogue_scale(fmt, scale), bias, residual, out_dtype),
                      name="linear")


def int8_activation_matmul(x, w, scale, fmt: WeightFormat):
    """The int8-activation scheme (ir/ops.py: linear of format q8/q4 with act_block) as TE stages, for weights
    the packed kernels do not take: x's block peaks, its int8 levels, per-block integer dots, and
    their sum over blocks, each times x's block scale (and the weight group's), plus for q4a and q4k Σ x's
    levels times x's block scale and the group's minimum."""
    rows, width, block = x.shape[0], x.shape[1], fmt.act_block
    blocks = width // block
    k = te.reduce_axis((0, block), "k")
    amax = te.compute((rows, blocks), lambda i, b: te.max(te.abs(x[i, b * block + k].astype("float32")), axis=k),
                      name="amax")
    inverse = te.compute((rows, blocks), lambda i, b: tirx.if_then_else(
        amax[i, b] > 0, tirx.const(127, "float32") / amax[i, b], tirx.const(0, "float32")), name="inverse")
    levels = te.compute((rows, width), lambda i, c: tirx.nearbyint(
        x[i, c].astype("float32") * inverse[i, c // block]).astype("int32"), name="x_levels")
    kk = te.reduce_axis((0, block), "kk")
    dots = te.compute((rows, w.shape[0], blocks), lambda i, n, b: te.sum(
        levels[i, b * block + kk] * weight_level(fmt, lambda j, c: w[j, c], n, b * block + kk), axis=kk), name="dots")

    def block_scale(i, n, b):
        x_scale = amax[i, b] / tirx.const(127, "float32")
        if not fmt.grouped:
            return x_scale
        return x_scale * group_scale(fmt, lambda table_row: scale[table_row, n], b * block // fmt.group_size)

    def block_term(i, n, b):
        term = dots[i, n, b].astype("float32") * block_scale(i, n, b)
        if not fmt.has_minimums:
            return term
        minimum = group_minimum(fmt, lambda table_row: scale[table_row, n], b * block // fmt.group_size)
        return term + sums[i, b].astype("float32") * (amax[i, b] / tirx.const(127, "float32") * minimum)
    if fmt.has_minimums:
        ks = te.reduce_axis((0, block), "ks")
        sums = te.compute((rows, blocks), lambda i, b: te.sum(levels[i, b * block + ks], axis=ks), name="x_sums")
    b = te.reduce_axis((0, blocks), "b")
    return te.compute((rows, w.shape[0]), lambda i, n: te.sum(block_term(i, n, b), axis=b), name="matmul")


def own_kernel(kernel, args: list[relax.Expr]) -> tirx.PrimFunc:
    """`kernel` (a TE function of the arguments' tensors) as a PrimFunc of its own."""
    tensors = [te.placeholder(tuple(a.ty.shape), a.ty.dtype, name=f"in{i}") for i, a in enumerate(args)]
    return te.create_prim_func([*tensors, kernel(*tensors)])


