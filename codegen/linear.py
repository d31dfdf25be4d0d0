"""Linear (x @ W.T + b) kernels: a TE matmul scheduled by dlight on GPUs, a packed-weight kernel on CPUs."""
from __future__ import annotations

from tvm import relax, s_tir, te, tirx

from .layouts import packed_block


def _epilogue(acc, bias, residual, dtype):
    """The value a linear writes for acc[i, j] (float32): + bias, round, + residual, round."""
    def value(i, j):
        y = acc[i, j] if bias is None else acc[i, j] + bias[j].astype("float32")
        if residual is None:
            return y.astype(dtype)
        return (y.astype(dtype).astype("float32") + residual[i, j].astype("float32")).astype(dtype)
    return value


def _nt_matmul(x, w, bias, residual, out_dtype):
    """y[m, n] = sum_k x[m, k] * w[n, k], accumulated in float32, then the epilogue."""
    k = te.reduce_axis((0, x.shape[1]), "k")
    acc = te.compute((x.shape[0], w.shape[0]), lambda m, n: te.sum(
        x[m, k].astype("float32") * w[n, k].astype("float32"), axis=k), name="matmul")
    return te.compute(acc.shape, _epilogue(acc, bias, residual, out_dtype), name="linear")


def packed_linear_kernel(m: tirx.Var, n_out: int, n_in: int, nb: int, dtype: str, has_bias: bool,
                         has_residual: bool = False) -> tirx.PrimFunc:
    """CPU kernel over W packed as Wp[n/nb, k, nb]: each task owns nb output columns of every row,
    accumulates them in vector registers and streams its weight panel once per row."""
    x = te.placeholder((m, n_in), dtype, name="x")
    wp = te.placeholder((n_out // nb, n_in, nb), dtype, name="w")
    bias = te.placeholder((n_out,), dtype, name="bias") if has_bias else None
    residual = te.placeholder((m, n_out), dtype, name="residual") if has_residual else None
    k = te.reduce_axis((0, n_in), "k")
    acc = te.compute((m, n_out), lambda i, j: te.sum(
        x[i, k].astype("float32") * wp[j // nb, k, j % nb].astype("float32"), axis=k), name="acc")
    y = te.compute((m, n_out), _epilogue(acc, bias, residual, dtype), name="y")
    args = [x, wp] + [t for t in (bias, residual) if t is not None] + [y]
    sch = s_tir.Schedule(te.create_prim_func(args))
    blk = sch.get_sblock("acc")
    i, j, kk = sch.get_loops(blk)
    jo, ji = sch.split(j, [None, nb])
    ko, ki = sch.split(kk, [None, 4] if n_in % 4 == 0 else [None, 1])
    sch.reorder(jo, i, ko, ki, ji)
    acc_local = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc_local, i)
    sch.parallel(jo)
    sch.vectorize(ji)
    sch.unroll(ki)
    init = sch.decompose_reduction(blk, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(acc_local)[-1])
    sch.reverse_compute_inline(sch.get_sblock("y"))   # the epilogue happens in the register write-back
    return sch.mod["main"]


def emit_linear(ctx, x: relax.Expr, w: relax.Expr, bias: relax.Expr | None, residual: relax.Expr | None,
                layout: str, n_out: int, n_in: int, dtype: str) -> relax.Expr:
    """Emit y = x @ W.T (+ b) (+ residual) for x [..., n_in], flattened to rows."""
    def rows(v, width):
        return ctx.bb.emit(relax.op.reshape(v, (-1, width))) if len(v.ty.shape) != 2 else v
    args = [rows(x, n_in), w] + ([bias] if bias is not None else []) + \
        ([rows(residual, n_out)] if residual is not None else [])
    nb = packed_block(layout)
    if nb is None:
        y = ctx.bb.emit_te(lambda a, b, *rest: _nt_matmul(
            a, b, rest[0] if bias is not None else None, rest[-1] if residual is not None else None, dtype),
            *args, primfunc_name_hint="linear")
    else:
        m = tirx.Var("m", "int64")
        kern = packed_linear_kernel(m, n_out, n_in, nb, dtype, bias is not None, residual is not None)
        suffix = ("_bias" if bias is not None else "") + ("_residual" if residual is not None else "")
        gv = ctx.add_kernel(kern, f"linear_packed{nb}_{n_out}x{n_in}{suffix}")
        y = ctx.bb.emit(relax.call_tir(gv, args, relax.TensorType((args[0].ty.shape[0], n_out), dtype)))
    if len(x.ty.shape) != 2:
        y = ctx.bb.emit(relax.op.reshape(y, list(x.ty.shape[:-1]) + [n_out]))
    return y
