"""Linear (x @ W.T + b) kernels: a TE matmul scheduled by dlight on GPUs, a packed-weight kernel on CPUs."""
from __future__ import annotations

from tvm import relax, s_tir, te, tirx

from .layouts import packed_block


def _nt_matmul(x, w, bias, out_dtype):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in float32."""
    k = te.reduce_axis((0, x.shape[1]), "k")
    acc = te.compute((x.shape[0], w.shape[0]), lambda m, n: te.sum(
        x[m, k].astype("float32") * w[n, k].astype("float32"), axis=k), name="matmul")
    if bias is None:
        return te.compute(acc.shape, lambda m, n: acc[m, n].astype(out_dtype), name="linear")
    return te.compute(acc.shape, lambda m, n: (acc[m, n] + bias[n].astype("float32")).astype(out_dtype),
                      name="linear")


def packed_linear_kernel(m: tirx.Var, n_out: int, n_in: int, nb: int, dtype: str, has_bias: bool) -> tirx.PrimFunc:
    """CPU kernel over W packed as Wp[n/nb, k, nb]: each task owns nb output columns of every row,
    accumulates them in vector registers and streams its weight panel once per row."""
    x = te.placeholder((m, n_in), dtype, name="x")
    wp = te.placeholder((n_out // nb, n_in, nb), dtype, name="w")
    bias = te.placeholder((n_out,), dtype, name="bias") if has_bias else None
    k = te.reduce_axis((0, n_in), "k")
    acc = te.compute((m, n_out), lambda i, j: te.sum(
        x[i, k].astype("float32") * wp[j // nb, k, j % nb].astype("float32"), axis=k), name="acc")
    if has_bias:
        y = te.compute((m, n_out), lambda i, j: (acc[i, j] + bias[j].astype("float32")).astype(dtype), name="y")
    else:
        y = te.compute((m, n_out), lambda i, j: acc[i, j].astype(dtype), name="y")
    args = [x, wp] + ([bias] if has_bias else []) + [y]
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
    sch.reverse_compute_inline(sch.get_sblock("y"))   # cast and bias happen in the register write-back
    return sch.mod["main"]


def emit_linear(ctx, x: relax.Expr, w: relax.Expr, bias: relax.Expr | None, layout: str, n_out: int, n_in: int,
                dtype: str) -> relax.Expr:
    """Emit y = x @ W.T + b for x [..., n_in] flattened to rows."""
    rows = ctx.bb.emit(relax.op.reshape(x, (-1, n_in))) if len(x.ty.shape) != 2 else x
    nb = packed_block(layout)
    if nb is None:
        args = [rows, w] + ([bias] if bias is not None else [])
        y = ctx.bb.emit_te(lambda *a: _nt_matmul(a[0], a[1], a[2] if len(a) > 2 else None, dtype), *args,
                           primfunc_name_hint="linear")
    else:
        m = tirx.Var("m", "int64")
        kern = packed_linear_kernel(m, n_out, n_in, nb, dtype, bias is not None)
        gv = ctx.add_kernel(kern, f"linear_packed{nb}_{n_out}x{n_in}" + ("_bias" if bias is not None else ""))
        args = [rows, w] + ([bias] if bias is not None else [])
        y = ctx.bb.emit(relax.call_tir(gv, args, relax.TensorType((rows.ty.shape[0], n_out), dtype)))
    if len(x.ty.shape) != 2:
        y = ctx.bb.emit(relax.op.reshape(y, list(x.ty.shape[:-1]) + [n_out]))
    return y
