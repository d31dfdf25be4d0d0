"""Linear (x @ W.T + b) kernels: a TE matmul scheduled by dlight on GPUs, a packed-weight kernel on CPUs."""
from __future__ import annotations

from tvm import relax, s_tir, te, tirx

from .layouts import packed_block


def _epilogue(acc, scale, bias, residual, dtype):
    """The value a linear writes for acc[i, j] (float32): * scale, + bias, round, + residual, round."""
    def value(i, j):
        y = acc[i, j] if scale is None else acc[i, j] * scale[j]
        y = y if bias is None else y + bias[j].astype("float32")
        if residual is None:
            return y.astype(dtype)
        return (y.astype(dtype).astype("float32") + residual[i, j].astype("float32")).astype(dtype)
    return value


def _nt_matmul(x, w, scale, bias, residual, out_dtype):
    """y[m, n] = sum_k x[m, k] * w[n, k], accumulated in float32 (w int8 when quantised), then the epilogue."""
    k = te.reduce_axis((0, x.shape[1]), "k")
    acc = te.compute((x.shape[0], w.shape[0]), lambda m, n: te.sum(
        x[m, k].astype("float32") * w[n, k].astype("float32"), axis=k), name="matmul")
    return te.compute(acc.shape, _epilogue(acc, scale, bias, residual, out_dtype), name="linear")


def packed_linear_kernel(m: tirx.Var, n_out: int, n_in: int, nb: int, dtype: str, has_bias: bool,
                         has_residual: bool = False, weight_dtype: str | None = None) -> tirx.PrimFunc:
    """CPU kernel over W packed as Wp[n/nb, k, nb]: each task owns nb output columns of every row,
    accumulates them in vector registers and streams its weight panel once per row."""
    x = te.placeholder((m, n_in), dtype, name="x")
    wp = te.placeholder((n_out // nb, n_in, nb), weight_dtype or dtype, name="w")
    scale = te.placeholder((n_out,), "float32", name="scale") if weight_dtype else None
    bias = te.placeholder((n_out,), dtype, name="bias") if has_bias else None
    residual = te.placeholder((m, n_out), dtype, name="residual") if has_residual else None
    k = te.reduce_axis((0, n_in), "k")
    acc = te.compute((m, n_out), lambda i, j: te.sum(
        x[i, k].astype("float32") * wp[j // nb, k, j % nb].astype("float32"), axis=k), name="acc")
    y = te.compute((m, n_out), _epilogue(acc, scale, bias, residual, dtype), name="y")
    args = [x, wp] + [t for t in (scale, bias, residual) if t is not None] + [y]
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


def emit_linear(ctx, x: relax.Expr, w: relax.Expr, scale: relax.Expr | None, bias: relax.Expr | None,
                residual: relax.Expr | None, layout: str, n_out: int, n_in: int, dtype: str) -> relax.Expr:
    """Emit y = x @ (W [* scale]).T (+ b) (+ residual) for x [..., n_in], flattened to rows."""
    def rows(v, width):
        return ctx.bb.emit(relax.op.reshape(v, (-1, width))) if len(v.ty.shape) != 2 else v
    optional = {"scale": scale, "bias": bias, "residual": rows(residual, n_out) if residual is not None else None}
    present = [k for k, v in optional.items() if v is not None]
    args = [rows(x, n_in), w] + [optional[k] for k in present]
    nb = packed_block(layout)
    if nb is None:
        def kernel(a, b, *rest):
            given = dict(zip(present, rest))
            return _nt_matmul(a, b, given.get("scale"), given.get("bias"), given.get("residual"), dtype)
        y = ctx.bb.emit_te(kernel, *args, primfunc_name_hint="linear")
    else:
        m = tirx.Var("m", "int64")
        wdtype = w.ty.dtype if scale is not None else None
        kern = packed_linear_kernel(m, n_out, n_in, nb, dtype, bias is not None, residual is not None, wdtype)
        suffix = "".join(f"_{k}" for k in present if k != "scale")
        gv = ctx.add_kernel(kern, f"linear{'_q8' if wdtype else ''}_packed{nb}_{n_out}x{n_in}{suffix}")
        y = ctx.bb.emit(relax.call_tir(gv, args, relax.TensorType((args[0].ty.shape[0], n_out), dtype)))
    if len(x.ty.shape) != 2:
        y = ctx.bb.emit(relax.op.reshape(y, list(x.ty.shape[:-1]) + [n_out]))
    return y
