"""kiln's packed-weight CPU linear, the kernel of decode steps where no dot-product kernel applies:
W stored [n/nb, in', nb] so a task accumulates nb outputs in vector registers, over row tiles and
reduction blocks so each block of a weight panel is read once per tile. The MoE expert GEMM shares
its schedule (`schedule_packed`)."""
from __future__ import annotations

from tvm import s_tir, te, tirx

from kiln.selection.formats import WeightFormat

from ..weight_format import epilogue, epilogue_scale, weight_value

ROW_TILE, K_BLOCK = 16, 128      # measured on a 2-core Zen VM, bench in docs


def packed_linear_kernel(m: tirx.Var, n_out: int, n_in: int, nb: int, dtype: str, has_bias: bool,
                         has_residual: bool = False, fmt: WeightFormat = WeightFormat(),
                         weight_dtype: str | None = None) -> tirx.PrimFunc:
    """CPU kernel over W packed as Wp[n/nb, k', nb]: each task owns nb output columns of every row,
    accumulates them for a tile of rows and reads each block of its weight panel once per row tile."""
    stored_in = n_in // 2 if fmt.nibbles else n_in
    x = te.placeholder((m, n_in), dtype, name="x")
    wp = te.placeholder((n_out // nb, stored_in, nb), weight_dtype or dtype, name="w")
    scale = (te.placeholder((fmt.table_rows(n_in), n_out), fmt.table_dtype, name="scale") if fmt.grouped
             else te.placeholder((n_out,), "float32", name="scale") if fmt.kind in ("q8", "fp8") else None)
    bias = te.placeholder((n_out,), dtype, name="bias") if has_bias else None
    residual = te.placeholder((m, n_out), dtype, name="residual") if has_residual else None
    k = te.reduce_axis((0, n_in), "k")
    acc = te.compute((m, n_out), lambda i, j: te.sum(
        x[i, k].astype("float32") * weight_value(fmt, lambda jj, kk: wp[jj // nb, kk, jj % nb], scale, j, k), axis=k),
        name="acc")
    y = te.compute((m, n_out), epilogue(acc, epilogue_scale(fmt, scale), bias, residual, dtype), name="y")
    args = [x, wp] + [t for t in (scale, bias, residual) if t is not None] + [y]
    return schedule_packed(te.create_prim_func(args), n_in, nb)


def schedule_packed(func: tirx.PrimFunc, n_in: int, nb: int) -> tirx.PrimFunc:
    """The CPU schedule of a packed-weight GEMM: a reduction block "acc" [rows, n_out] over n_in
    inputs, reading nb-wide panels of the weight, and its epilogue block "y"."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("acc")
    i, j, kk = sch.get_loops(blk)
    jo, ji = sch.split(j, [None, nb])
    # Rows in tiles of ROW_TILE, the reduction in blocks of K_BLOCK: a block of the weight panel
    # ([K_BLOCK, nb], 32 KiB in f32) is read from memory once per row tile and then from L1 for
    # every row of it, so prefill and batched decode do not stream the weights once per row.
    io, ii = sch.split(i, [None, ROW_TILE])
    k_block = next((b for b in (K_BLOCK, 64, 4) if n_in % b == 0), 1)
    kbo, kbi = sch.split(kk, [None, k_block])
    kbi_o, ki = sch.split(kbi, [None, 4] if k_block % 4 == 0 else [None, 1])
    sch.reorder(jo, io, kbo, ii, kbi_o, ki, ji)
    acc_local = sch.cache_write(blk, 0, "local")
    sch.reverse_compute_at(acc_local, io)
    sch.parallel(jo)
    sch.vectorize(ji)
    sch.unroll(ki)
    init = sch.decompose_reduction(blk, kbo)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(acc_local)[-1])
    sch.reverse_compute_inline(sch.get_sblock("y"))   # the epilogue happens in the register write-back
    return sch.mod["main"]
