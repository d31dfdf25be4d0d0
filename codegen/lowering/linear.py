"""Linear (x @ W.T + b [+ residual]) for float, q8, fp8 and q4 weights: the registry of linear
kernels (LINEAR_KERNELS, first match wins) and the one emitter.

GPUs: on CUDA sm_80+, bf16 and fp16 linears run kiln's tensor-core GEMM (codegen/kernels/gpu/mma_gemm.py; q8,
fp8 and q4 weights converted in its main loop) in every step but small decode steps, which run
kiln's streaming GEMV (codegen/kernels/gpu/gemv.py); what those do not take, a TE matmul that dlight
schedules, in decode steps as its low-batch GEMV (`decode_kernel`).
CPUs: kiln's packed-weight kernel, weights stored [out/nb, in', nb] so a task accumulates nb
outputs in vector registers; in steps that bring chunks (every entry but decode, on targets with
`chunk_gemm`) the register-blocked GEMM of codegen/kernels/cpu/gemm.py over the same layout. Where the CPU has
a dot product for the operands, weights are stored with its inputs side by side and one kernel
serves every step: int8 activations (codegen/kernels/cpu/vnni_linear.py, int8_gemm.py, int8_gemv.py), bf16
(codegen/kernels/cpu/bf16_linear.py). Quantised weights are decoded inside the reduction (q4) or scaled in the
epilogue (q8, fp8): no dequantised copy of a weight ever exists.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from tvm import relax, tirx

from ..kernels.cpu import int8_gemv
from ..kernels.cpu.bf16_linear import bf16_linear_kernel, micro_kernels
from ..kernels.cpu.gemm import packed_gemm_kernel, vector_lanes
from ..kernels.cpu.int8_gemm import int8_gemm_kernel
from ..kernels.cpu.int8_gemv import int8_gemv_kernel
from ..kernels.cpu.packed_linear import packed_linear_kernel
from ..kernels.cpu.vnni_linear import vnni_linear_kernel
from ..kernels.gpu import gemv_tuning, mma_gemm
from ..kernels.gpu.dlight_gemv import decode_kernel
from ..kernels.gpu.gemv import gemv_kernel
from ..kernels.gpu.mma_gemm import mma_linear_kernel
from ..kernels.gpu.mma_tuning import tiles_for
from ..kernels.layouts import in_byte_quads, interleave, nibble_span, packed_block
from ..kernels.te_linear import nt_matmul, own_kernel
from ..kernels.weight_format import WeightFormat


def mma_tiles(target, dtype: str, weight_dtype: str, fmt: WeightFormat, n_out: int, n_in: int):
    """The tensor-core tiles (codegen/kernels/gpu/mma_tuning.py) a CUDA linear runs by rows, or None where it
    runs TVM's schedules: bf16 or fp16 activations on sm_80+, weights in their dtype or q8, fp8, q4
    (float activations: int8 ones are the CPU's scheme)."""
    if target.device != "cuda" or fmt.act_block or not target.tensor_cores:
        return None
    tiles = tiles_for(target.arch, dtype, n_out, n_in)
    ok = tiles and mma_gemm.supports(target.arch, dtype, weight_dtype, n_out, n_in, tiles, fmt.kind, fmt.group_size)
    return tiles if ok else None


def streaming_gemv(dtype: str, weight_dtype: str, fmt: WeightFormat, n_out: int, n_in: int,
                   activation: str | None = None) -> bool:
    """Whether a CUDA decode step's linear runs kiln's streaming GEMV (codegen/kernels/gpu/gemv.py) rather than
    dlight's: float activations (int8 ones are the CPU's scheme) and a format it reads."""
    return not fmt.act_block and gemv_tuning.supports(dtype, weight_dtype, n_out, n_in, fmt.kind, fmt.group_size,
                                                      activation)


@dataclass
class LinearSite:
    """One linear as the kernel registry sees it: its operands, layout, format and step, and how a
    kernel chosen for it is called."""
    ctx: object
    args: list                       # x as rows, w, then the optional operands present
    present: list[str]               # which of scale, bias, residual are
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
    def step(self) -> str:
        return self.ctx.step

    @property
    def nb(self) -> int | None:
        return packed_block(self.layout)

    @property
    def weight_dtype(self) -> str:
        return self.args[1].ty.dtype

    @property
    def epilogue(self) -> tuple[bool, bool]:
        return "bias" in self.present, "residual" in self.present

    @functools.cached_property
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
        suffix = "".join(f"_{k}" for k in self.present if k != "scale") + (f"_{self.activation}" if gated else "")
        packing = f"_packed{self.nb}" if self.nb is not None else ""
        gv = self.ctx.add_kernel(kern, f"{family}{self.fmt.suffix}{packing}_{self.n_out}x{self.n_in}{suffix}",
                                 scheduled=scheduled)
        width = self.n_out // 2 if gated else self.n_out
        return self.ctx.bb.emit(relax.call_tir(gv, self.args, relax.TensorType((self.args[0].ty.shape[0], width),
                                                                               self.dtype)))


@dataclass(frozen=True)
class LinearKernel:
    name: str
    supports: Callable[[LinearSite], bool]
    emit: Callable[[LinearSite], relax.Expr]


def _bf16dot(s: LinearSite) -> relax.Expr:
    if s.dtype != "bfloat16" or s.weight_dtype != "bfloat16":
        raise ValueError(f"the bf16 kernel multiplies bf16 activations and weights, not {s.dtype} and {s.weight_dtype}")
    s.ctx.micro_kernels.update(micro_kernels(s.nb))
    return s.call(bf16_linear_kernel(s.n_out, s.n_in, s.nb, *s.epilogue), "bf16dot", scheduled=True)


def _vnni(s: LinearSite) -> relax.Expr:
    if s.fmt.kind == "q4" and nibble_span(s.layout) != s.fmt.act_block:
        raise ValueError(f"the VNNI kernel reads q4 bytes of inputs {s.fmt.act_block} apart, not layout {s.layout}")
    return s.call(vnni_linear_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue), "vnni", scheduled=True)


def _int8_gemv_supports(s: LinearSite) -> bool:
    return s.step == "decode" and int8_gemv.supports(s.n_out, s.n_in, s.nb, s.fmt)


def _int8_gemv(s: LinearSite) -> relax.Expr:
    return s.call(int8_gemv_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue), "int8_gemv", scheduled=True)


def _int8_gemm(s: LinearSite) -> relax.Expr:
    return s.call(int8_gemm_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, *s.epilogue), "int8_gemm", scheduled=True)


def _chunk_gemm(s: LinearSite) -> relax.Expr:
    return s.call(packed_gemm_kernel(s.n_out, s.n_in, s.nb, s.dtype, s.fmt, s.weight_dtype, *s.epilogue,
                                     vector_lanes(s.target.tvm_target())), "gemm", scheduled=True)


def _packed_linear(s: LinearSite) -> relax.Expr:
    return s.call(packed_linear_kernel(tirx.Var("m", "int64"), s.n_out, s.n_in, s.nb, s.dtype, *s.epilogue, s.fmt,
                                       s.weight_dtype), "linear")


def _mma(s: LinearSite) -> relax.Expr:
    func, _ = mma_linear_kernel(s.n_out, s.n_in, s.dtype, *s.epilogue, s.tiles, s.fmt.kind, s.fmt.group_size,
                                s.activation)
    return s.call(func, "mma", scheduled=True, gated=bool(s.activation))


def _gemv(s: LinearSite) -> relax.Expr:
    func, _ = gemv_kernel(s.n_out, s.n_in, s.dtype, *s.epilogue, s.fmt.kind, s.fmt.group_size, s.activation,
                          arch=s.target.arch)
    return s.call(func, "gemv", scheduled=True, gated=bool(s.activation))


def _dlight_gemv(s: LinearSite) -> relax.Expr:
    func, gemv = decode_kernel(s.target, lambda *t: s.matmul(*t, staged=True), s.args)
    return s.call(func, "dlgemv" if gemv else "linear", scheduled=gemv)


def _own_linear(s: LinearSite) -> relax.Expr:
    # a kernel of its own, as in decode steps: between the opaque tensor-core kernels the default
    # fusion would group a linear dlight cannot take with its elementwise neighbours
    return s.call(own_kernel(s.matmul, s.args), "linear")


def _te_linear(s: LinearSite) -> relax.Expr:
    return s.ctx.bb.emit_te(s.matmul, *s.args, primfunc_name_hint="linear")


# The first record that supports a linear emits it. Packed layouts (CPU weights) and plain ones (GPU
# weights, and the CPU's where none is packed) take disjoint records.
LINEAR_KERNELS = (
    # bf16 weights in input pairs (AVX-512 BF16): one kernel for every step
    LinearKernel("bf16dot", lambda s: s.nb is not None and s.fmt.kind == "float" and interleave(s.layout) == 2,
                 _bf16dot),
    # int8 activations on VNNI: one kernel for every step
    LinearKernel("vnni", lambda s: in_byte_quads(s.layout, s.fmt.act_block), _vnni),
    # int8 activations elsewhere: exact integer dots per block, the same float steps in both kernels
    LinearKernel("int8_gemv", lambda s: s.nb is not None and bool(s.fmt.act_block) and _int8_gemv_supports(s),
                 _int8_gemv),
    LinearKernel("int8_gemm", lambda s: s.nb is not None and bool(s.fmt.act_block), _int8_gemm),
    # steps that bring chunks: the register-blocked GEMM (decode steps keep the GEMV schedule)
    LinearKernel("gemm", lambda s: s.nb is not None and s.target.chunk_gemm and s.step != "decode", _chunk_gemm),
    LinearKernel("packed_linear", lambda s: s.nb is not None, _packed_linear),
    # CUDA's tensor cores, in every step but small decode ones
    LinearKernel("mma", lambda s: s.nb is None and bool(s.tiles) and (s.step != "decode" or s.ctx.wide_decode),
                 _mma),
    # CUDA decode steps: kiln's streaming GEMV where it reads the format, else dlight's
    LinearKernel("gemv", lambda s: s.nb is None and s.step == "decode" and s.target.device == "cuda" and streaming_gemv(
        s.dtype, s.weight_dtype, s.fmt, s.n_out, s.n_in, s.activation), _gemv),
    LinearKernel("dlight_gemv", lambda s: s.nb is None and s.step == "decode" and s.target.device == "cuda",
                 _dlight_gemv),
    # CUDA only: measured there; on ROCm TVM's LLVM codegen emits the rule's lane shuffles with a
    # 64-bit lane index, which LLVM's verifier rejects (kernels with a residual)
    LinearKernel("own_linear", lambda s: s.nb is None and s.target.device == "cuda", _own_linear),
    LinearKernel("te_linear", lambda s: s.nb is None, _te_linear),
)


def emit_linear(ctx, x: relax.Expr, w: relax.Expr, scale: relax.Expr | None, bias: relax.Expr | None,
                residual: relax.Expr | None, layout: str, n_out: int, n_in: int, dtype: str,
                fmt: WeightFormat = WeightFormat(), activation: str | None = None) -> relax.Expr:
    """Emit y = x @ W.T (+ b) (+ residual) for x [..., n_in], flattened to rows, with the first kernel
    of LINEAR_KERNELS that supports it. `activation`: W is a gated MLP's gate/up stored 'gated'; the
    tensor-core kernel and the streaming GEMV then return act(gate) * up ([..., n_out / 2]), every
    other kernel the interleaved columns."""
    def rows(v, width):
        return ctx.bb.emit(relax.op.reshape(v, (-1, width))) if len(v.ty.shape) != 2 else v
    optional = {"scale": scale, "bias": bias, "residual": rows(residual, n_out) if residual is not None else None}
    present = [k for k, v in optional.items() if v is not None]
    site = LinearSite(ctx, [rows(x, n_in), w] + [optional[k] for k in present], present, layout, n_out, n_in, dtype,
                      fmt, activation)
    y = next(k for k in LINEAR_KERNELS if k.supports(site)).emit(site)
    if len(x.ty.shape) != 2:
        y = ctx.bb.emit(relax.op.reshape(y, list(x.ty.shape[:-1]) + [y.ty.shape[-1]]))
    return y
