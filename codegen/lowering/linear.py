"""Linear (x @ W.T + b [+ residual]) for float, q8, fp8 and q4 weights: each kernel of
selection/linear.py's records emitted by name (EMITTERS), as select_kernels recorded it for the step.
What each kernel is and takes: selection/linear.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import relax, tirx

from kiln.selection.formats import WeightFormat
from kiln.selection.layouts import nibble_span, packed_block
from kiln.selection.linear import mma_tiles
from kiln.selection.tiles import hopper_tiles

from ..kernels.cpu.bf16_linear import bf16_linear_kernel, micro_kernels, tile_kernels
from ..kernels.cpu.gemm import packed_gemm_kernel, vector_lanes
from ..kernels.cpu.int8_gemm import int8_gemm_kernel
from ..kernels.cpu.int8_gemv import int8_gemv_kernel
from ..kernels.cpu.packed_linear import packed_linear_kernel
from ..kernels.cpu.vnni_linear import tile_kernels as int8_tile_kernels
from ..kernels.cpu.vnni_linear import vnni_linear_kernel
from ..kernels.gpu.dlight_gemv import decode_kernel
from ..kernels.gpu.gemv import gemv_kernel
from ..kernels.gpu.mma_gemm import mma_linear_kernel, wgmma_linear_kernel
from ..kernels.te_linear import nt_matmul, own_kernel


@dataclass
class LinearCall:
    """One linear as its kernel is emitted: its operands, layout, format and step, and how the
    kernel is called."""
    ctx: object
    args: list                       # x as rows, w, then the optional operands present
    present: list[str]               # which of scale, zeros, bias, residual are
    layout: str
    n_out: int
    n_in: int
    dtype: str
    fmt: WeightFormat
    activation: str | None           # a gated gate/up whose kernel may apply act(gate) * up

    @property
    def target(self):
        return self.ctx.target

    @property
    def nb(self) -> int | None:
        return packed_block(self.layout)

    @property
    def weight_dtype(self) -> str:
        return self.args[1].ty.dtype

    @property
    def epilogue(self) -> tuple[bool, bool]:
        return "bias" in self.present, "residual" in self.present

    @property
    def tiles(self):
        return mma_tiles(self.target, self.dtype, self.weight_dtype, self.fmt, self.n_out, self.n_in)

    def matmul(self, a, b, *rest, staged=False):
        """The linear as a TE function of its operands' tensors."""
        given = dict(zip(self.present, rest))
        return nt_matmul(a, b, given.get("scale"), given.get("bias"), given.get("residual"), self.dtype, self.fmt,
                          staged)

    def call(self, kern, family: str, scheduled: bool = False, gated: bool = False) -> relax.Expr:
        """`kern` as a kernel of its own (packed or not), named by family and shape, called on the
        operands; `gated`: it returns act(gate) * up, half the columns."""
        suffix = "".join(f"_{k}" for k in self.present if k in ("bias", "residual")) \
            + (f"_{self.activation}" if gated else "")
        packing = f"_packed{self.nb}" if self.nb is not None else ""
        gv = self.ctx.add_kernel(kern, f"{family}{self.fmt.suffix}{packing}_{self.n_out}x{self.n_in}{suffix}",
                                 scheduled=scheduled)
        width = self.n_out // 2 if gated else self.n_out
        return self.ctx.bb.emit(relax.call_tir(gv, self.args, relax.TensorType((self.args[0].ty.shape[0], width),
                                                                               self.dtype)))


def _bf16dot(s: LinearCall, tiles: bool = False) -> relax.Expr:
    if s.dtype != "bfloat16" or s.weight_dtype != "bfloat16":
        raise ValueError(f"the bf16 kernel multiplies bf16 activations and weights, not {s.dtype} and {s.weight_dtype}")
    s.ctx.micro_kernels.update(micro_kernels(s.nb))
    if tiles:       # and its AMX micro-kernels, the bf16 dots' where the OS refuses tiles
        s.ctx.tile_kernels.update(tile_kernels(s.nb))
    return s.call(bf16_linear_kernel(s.n_out, s.n_in, s.nb, *s.epilogue, tiles=tiles),
                  "amx_bf16" if tiles else "bf16dot", scheduled=True)


def _vnni(s: LinearCall, tiles: bool = False) -> relax.Expr:
    if s.fmt.nibbles and nibble_span(s.layout) != s.fmt.act_block:
        raise ValueError(f"the VNNI kernel reads q4 bytes of inputs {s.fmt.act_block} apart, not layout {s.layout}")
    if tiles:       # and its AMX micro-kernels, the vpdpbusd ones' where the OS refuses tiles
        s.ctx.tile_kernels.update(int8_tile_kernels(s.nb, s.fmt))
    return s.call(vnni_linear_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue, tiles=tiles),
                  "amx_int8" if tiles else "vnni", scheduled=True)


def _int8_gemv(s: LinearCall) -> relax.Expr:
    return s.call(int8_gemv_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue), "int8_gemv", scheduled=True)


def _int8_gemm(s: LinearCall) -> relax.Expr:
    return s.call(int8_gemm_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue), "int8_gemm", scheduled=True)


def _chunk_gemm(s: LinearCall) -> relax.Expr:
    return s.call(packed_gemm_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, s.weight_dtype, *s.epilogue,
                                     vector_lanes(s.target.tvm_target())), "gemm", scheduled=True)


def _packed_linear(s: LinearCall) -> relax.Expr:
    return s.call(packed_linear_kernel(tirx.Var("m", "int64"), s.n_out, s.n_in, s.nb, s.dtype, *s.epilogue, s.fmt,
                                       s.weight_dtype), "linear")


def _mma(s: LinearCall) -> relax.Expr:
    func, _ = mma_linear_kernel(s.n_out, s.n_in, s.dtype, *s.epilogue, s.tiles, s.fmt.kind, s.fmt.group_size,
                                s.activation)
    return s.call(func, "mma", scheduled=True, gated=bool(s.activation))


def _wgmma(s: LinearCall) -> relax.Expr:
    # a gated gate/up (weights 'gated'): the interleaved columns, whose activation a kernel of its own applies
    func, variants = wgmma_linear_kernel(s.n_out, s.n_in, s.dtype, *s.epilogue,
                                         hopper_tiles(s.target.arch, s.dtype, s.n_out, s.n_in), s.fmt.kind,
                                         s.fmt.group_size)
    s.ctx.hopper_gemms.update(variants)        # linked into the library (codegen/lower.py)
    return s.call(func, "wgmma", scheduled=True)


def _gemv(s: LinearCall) -> relax.Expr:
    func, _ = gemv_kernel(s.n_out, s.n_in, s.dtype, *s.epilogue, s.fmt.kind, s.fmt.group_size, s.activation,
                          arch=s.target.arch)
    return s.call(func, "gemv", scheduled=True, gated=bool(s.activation))


def _dlight_gemv(s: LinearCall) -> relax.Expr:
    func, gemv = decode_kernel(s.target, lambda *t: s.matmul(*t, staged=True), s.args)
    return s.call(func, "dlgemv" if gemv else "linear", scheduled=gemv)


def _own_linear(s: LinearCall) -> relax.Expr:
    # a kernel of its own, as in decode steps: between the opaque tensor-core kernels the default
    # fusion would group a linear dlight cannot take with its elementwise neighbours
    return s.call(own_kernel(s.matmul, s.args), "linear")


def _te_linear(s: LinearCall) -> relax.Expr:
    return s.ctx.bb.emit_te(s.matmul, *s.args, primfunc_name_hint="linear")


# how each kernel of selection/linear.py's LINEAR_KERNELS is emitted
EMITTERS = {"amx_bf16": lambda s: _bf16dot(s, tiles=True), "bf16dot": _bf16dot,
            "amx_int8": lambda s: _vnni(s, tiles=True), "vnni": _vnni, "int8_gemv": _int8_gemv,
            "int8_gemm": _int8_gemm, "gemm": _chunk_gemm,
            "packed_linear": _packed_linear, "wgmma": _wgmma, "mma": _mma, "gemv": _gemv, "dlight_gemv": _dlight_gemv,
            "own_linear": _own_linear, "te_linear": _te_linear}


def emit_linear(ctx, kernel: str, x: relax.Expr, w: relax.Expr, scale: relax.Expr | None, bias: relax.Expr | None,
                residual: relax.Expr | None, layout: str, n_out: int, n_in: int, dtype: str,
                fmt: WeightFormat = WeightFormat(), activation: str | None = None,
                zeros: relax.Expr | None = None) -> relax.Expr:
    """Emit y = x @ W.T (+ b) (+ residual) for x [..., n_in], flattened to rows, with `kernel`.
    `activation`: W is a gated MLP's gate/up stored 'gated'; the tensor-core kernel and the
    streaming GEMV then return act(gate) * up ([..., n_out / 2]), every other kernel the
    interleaved columns. `zeros`: q4's scales times -8, which the Hopper GEMM reads (wgmma)."""
    def rows(v, width):
        return ctx.bb.emit(relax.op.reshape(v, (-1, width))) if len(v.ty.shape) != 2 else v
    optional = {"scale": scale, "zeros": zeros, "bias": bias,
                "residual": rows(residual, n_out) if residual is not None else None}
    present = [k for k, v in optional.items() if v is not None]
    call = LinearCall(ctx, [rows(x, n_in), w] + [optional[k] for k in present], present, layout, n_out, n_in, dtype,
                      fmt, activation)
    y = EMITTERS[kernel](call)
    if len(x.ty.shape) != 2:
        y = ctx.bb.emit(relax.op.reshape(y, list(x.ty.shape[:-1]) + [y.ty.shape[-1]]))
    return y
