"""Lowering of moe_router and moe_experts (ir/moe_ops.py) to kiln's MoE kernels
(codegen/kernels/moe.py): the router, the plan, two grouped GEMMs with the activation between
them, and the combine. The grouped GEMMs run the kernel select_kernels recorded (selection/experts.py:
the tensor-core kernel on CUDA, kiln's packed CPU schedule, or a TE kernel the target's pipeline
schedules); the router, plan and combine have one form each, built for the target's threads
(`thread_blocks`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import relax, te, tirx

from kiln.ir import input_of
from kiln.selection.choice import recorded
from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import packed_block
from kiln.selection.linear import mma_tiles

from ..kernels.cpu.packed_linear import schedule_packed
from ..kernels.gpu.mma_gemm import mma_experts_kernel
from ..kernels.moe import combine_kernel, grouped_gemm, plan_kernel, router_kernel
from .elementwise import gated


@dataclass
class ExpertGemm:
    """One grouped GEMM of moe_experts as its kernel is emitted.
    args: x, [row_token,] row_expert, w, [scale,] [row_weight]."""
    ctx: object
    name: str
    args: list
    n_out: int
    n_in: int
    layout: str
    dtype: str
    fmt: WeightFormat
    gather: bool
    weighted: bool

    @property
    def nb(self) -> int | None:
        return packed_block(self.layout)

    @property
    def n_rows(self):
        return self.args[2 if self.gather else 1].ty.shape[0]

    @property
    def weight(self) -> relax.Expr:
        return self.args[3 if self.gather else 2]

    @property
    def experts(self) -> int:
        return int(self.weight.ty.shape[0])

    @property
    def tiles(self):
        return mma_tiles(self.ctx.target, self.dtype, self.weight.ty.dtype, self.fmt, self.n_out, self.n_in)

    def build(self, *tensors):
        """The GEMM as TE over its operands' tensors."""
        it = iter(tensors)
        x = next(it)
        rows = (next(it) if self.gather else None, next(it))
        w = next(it)
        scale = next(it) if self.fmt.kind != "float" else None
        row_weight = next(it) if self.weighted else None
        return grouped_gemm(x, rows, w, scale, row_weight, self.n_out, self.n_in, self.nb, self.dtype, self.fmt,
                            self.gather)

    def call(self, func, name: str, scheduled: bool = False) -> relax.Expr:
        gv = self.ctx.add_kernel(func, name, scheduled=scheduled)
        return self.ctx.bb.emit(relax.call_tir(gv, self.args, relax.TensorType((self.n_rows, self.n_out), self.dtype)))


def _mma(g: ExpertGemm) -> relax.Expr:
    func = mma_experts_kernel(g.experts, g.n_out, g.n_in, g.dtype, g.tiles, g.fmt.kind, g.fmt.group_size, g.gather,
                              g.weighted)
    return g.call(func, f"{g.name}_mma{g.fmt.suffix}_e{g.experts}_{g.n_out}x{g.n_in}_{g.dtype}", scheduled=True)


def _packed(g: ExpertGemm) -> relax.Expr:
    # the kernel's own placeholders: x [tokens (gathered) or rows, n_in], the row vectors [rows],
    # the weight and its scales as stored
    tokens, rows = tirx.Var("tokens", "int64"), tirx.Var("rows", "int64")
    index_args = 2 if g.gather else 1
    shapes = [(tokens if g.gather else rows, g.n_in)] + [(rows,)] * index_args
    shapes += [tuple(int(d) for d in a.ty.shape) for a in g.args[1 + index_args:len(g.args) - g.weighted]]
    shapes += [(rows,)] * g.weighted
    placeholders = [te.placeholder(shape, a.ty.dtype, name=f"in{i}")
                    for i, (shape, a) in enumerate(zip(shapes, g.args))]
    func = schedule_packed(te.create_prim_func([*placeholders, g.build(*placeholders)]), g.n_in, g.nb)
    return g.call(func, f"{g.name}{g.fmt.suffix}_e{g.experts}_packed{g.nb}_{g.n_out}x{g.n_in}_{g.dtype}")


def _te(g: ExpertGemm) -> relax.Expr:
    return g.ctx.bb.emit_te(g.build, *g.args, primfunc_name_hint=g.name)


# how each kernel of selection/experts.py's EXPERT_KERNELS is emitted
EMITTERS = {"mma": _mma, "packed": _packed, "te": _te}


def _grouped(ctx, kernel: str, name: str, args: list, n_out: int, n_in: int, layout: str, dtype: str,
             fmt: WeightFormat, gather: bool, weighted: bool) -> relax.Expr:
    return EMITTERS[kernel](ExpertGemm(ctx, name, args, n_out, n_in, layout, dtype, fmt, gather, weighted))


def emit_moe_router(ctx, node, logits, bias=None):
    at = node.attrs
    gpu = ctx.target.thread_blocks
    kernel = router_kernel(node.type.shape[1], at["scheme"], at["top_k"], at["normalize"], float(at["scaling"]),
                           at["n_group"], at["topk_group"], gpu)
    scaling = f"{float(at['scaling']):g}".replace(".", "p").replace("-", "m")
    name = (f"moe_router_{at['scheme']}_e{node.type.shape[1]}_k{at['top_k']}{'_norm' if at['normalize'] else ''}"
            f"_x{scaling}_g{at['n_group']}of{at['topk_group']}")
    gv = ctx.add_kernel(kernel, name, scheduled=True)
    args = [logits] + ([bias] if bias is not None else [])
    return ctx.bb.emit(relax.call_tir(gv, args, relax.TensorType(logits.ty.shape, "float32")))


def emit_moe_experts(ctx, node, x, routing, gate_up, gate_up_scale, down, down_scale=None):
    """moe_experts, its experts in any weight format: plan, gate_up GEMM, activation, down GEMM, combine."""
    fmt = WeightFormat.of(node)
    gpu = ctx.target.thread_blocks
    dtype, k = node.type.dtype, node.attrs["top_k"]
    experts, hidden = ctx.types[input_of(node, "routing")].shape[1], node.type.shape[1]
    ffn = ctx.types[input_of(node, "gate_up")].shape[1] // 2      # gate_up [E, 2F, ...], stored in any format
    tokens = x.ty.shape[0]
    plan = ctx.add_kernel(plan_kernel(experts, k, gpu), f"moe_plan_e{experts}_k{k}", scheduled=True)
    planned = ctx.bb.emit(relax.call_tir(plan, [routing], [
        relax.TensorType((tokens * k,), "int32"), relax.TensorType((tokens * k,), "int32"),
        relax.TensorType((tokens * k,), "float32"), relax.TensorType((tokens, k), "int32")]))
    row_token, row_expert, row_weight, token_rows = (ctx.bb.emit(relax.TupleGetItem(planned, i)) for i in range(4))
    scales = (lambda s: [s] if s is not None else [])
    up_layout, down_layout = ctx.layout(node, 2), ctx.layout(node, 4)
    kernel = recorded(node, ctx.step)
    h = _grouped(ctx, kernel, "moe_gate_up", [x, row_token, row_expert, gate_up, *scales(gate_up_scale)],
                 2 * ffn, hidden, up_layout, dtype, fmt, gather=True, weighted=False)
    act = gated(ctx, h, node.attrs["activation"], dtype)
    y = _grouped(ctx, kernel, "moe_down", [act, row_expert, down, *scales(down_scale), row_weight],
                 hidden, ffn, down_layout, dtype, fmt, gather=False, weighted=True)
    combine = ctx.add_kernel(combine_kernel(hidden, k, dtype, gpu), f"moe_combine_{hidden}_k{k}_{dtype}",
                             scheduled=True)
    return ctx.bb.emit(relax.call_tir(combine, [y, token_rows], relax.TensorType((tokens, hidden), dtype)))
