"""Linear kernels (x @ W.T + b [+ residual]): what each takes (its record's `supports`), the layout a
linear's weight is stored in, and the site a record is asked about.

GPUs: on CUDA sm_80+, bf16 and fp16 linears run kiln's tensor-core GEMM (mma; q8, fp8 and the nibble
formats q4, q4a and q4k converted in its main loop) in every step but small decode steps, which run kiln's
streaming GEMV (gemv); on sm_90, steps of more than HOPPER_FROM rows (selection/tiles.py) with bf16/fp16 weights, or
q4 in groups of 64 or more, run CUTLASS's warp-specialised wgmma + TMA GEMM instead (wgmma: one
kernel that launches mma's tiles below that; q4 takes a second copy of its scales, times -8, as
CUTLASS's zeros); what those do not take, a TE matmul that dlight schedules (dlight_gemv in decode steps, a
kernel of its own elsewhere: own_linear), or one the target's pipeline fuses (te_linear).
CPUs: kiln's packed-weight kernel (packed_linear), weights stored [out/nb, in', nb] so a task
accumulates nb outputs in vector registers; in steps that bring chunks the register-blocked GEMM
(gemm) over the same layout. Where the CPU has a dot product for the operands, weights are stored
with its inputs side by side and one kernel serves every step: int8 activations (vnni; int8_gemv
and int8_gemm with AVX2's pair dots), bf16 (bf16dot; on CPUs with AMX, amx_bf16's tiles in steps of
many rows over the same layout, and amx_int8's beside vnni). Quantised weights are decoded inside the
reduction (q4) or scaled in the epilogue (q8, fp8): no dequantised copy of a weight ever exists.
codegen/lowering/linear.py emits each by name.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from kiln.ir import Graph, input_of, weight_format

from .formats import WeightFormat
from .layouts import in_byte_quads, interleave, packed_block, packed_layout
from .shapes import gemv_takes, int8_gemv_takes, mma_takes, tile_bf16_takes, tile_int8_takes, vnni_takes, wgmma_takes
from .tiles import tiles_for

# the gated ops a linear's kernel may apply after it, by the activation it applies
GATE_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_tanh"}


def mma_tiles(target, dtype: str, weight_dtype: str, fmt: WeightFormat, n_out: int, n_in: int):
    """The tensor-core tiles (selection/tiles.py) a CUDA linear runs by rows, or None where the
    tensor-core kernel does not take it (int8 activations are the CPU's scheme)."""
    if fmt.act_block:
        return None
    tiles = tiles_for(target.arch, dtype, n_out, n_in)
    ok = tiles and mma_takes(target.arch, dtype, weight_dtype, n_out, n_in, tiles, fmt.kind, fmt.group_size)
    return tiles if ok else None


@dataclass(frozen=True)
class LinearSite:
    """One linear in one kind of step, as a kernel record sees it."""
    target: object
    step: str                        # "mixed", "decode", "decode_wide" or "prefill"
    layout: str                      # its weight's stored layout (linear_layout)
    n_out: int
    n_in: int
    dtype: str                       # the activations'
    weight_dtype: str                # the stored weight's
    fmt: WeightFormat
    activation: str | None = None    # a gated MLP's gate/up whose kernel may apply act(gate) * up

    @property
    def nb(self) -> int | None:
        return packed_block(self.layout)

    @property
    def decoding(self) -> bool:
        """A step of one new token per sequence (of few sequences, or of many: decode_wide)."""
        return self.step in ("decode", "decode_wide")

    @functools.cached_property
    def tiles(self):
        return mma_tiles(self.target, self.dtype, self.weight_dtype, self.fmt, self.n_out, self.n_in)


@dataclass(frozen=True)
class LinearKernel:
    name: str
    supports: Callable[[LinearSite], bool]
    # stores a gated MLP's gate/up 'gated' and applies the activation in its epilogue: then every
    # step's kernel is told the activation, and returns act(gate) * up where it can
    applies_gate: bool = False


LINEAR_KERNELS = {k.name: k for k in (
    # bf16 weights in input pairs on CPUs with AMX: tiles in steps that bring many rows (the bf16 dots where
    # the OS refuses tiles); decode steps, which stream the weights once, keep bf16dot
    LinearKernel("amx_bf16", lambda s: s.nb is not None and s.fmt.kind == "float" and interleave(s.layout) == 2
                 and s.target.tiles != "" and not s.decoding and tile_bf16_takes(s.n_in, s.nb)),
    # bf16 weights in input pairs (AVX-512 BF16): one kernel for every step
    LinearKernel("bf16dot", lambda s: s.nb is not None and s.fmt.kind == "float" and interleave(s.layout) == 2),
    # int8 levels or nibbles in byte quads on CPUs with AMX: tiles in steps of many rows (vnni where refused)
    LinearKernel("amx_int8", lambda s: in_byte_quads(s.layout, s.fmt.act_block) and s.target.tiles != ""
                 and not s.decoding and tile_int8_takes(s.fmt)),
    # int8 activations on VNNI: one kernel for every step
    LinearKernel("vnni", lambda s: in_byte_quads(s.layout, s.fmt.act_block)),
    # int8 activations elsewhere: exact integer dots per block, the same float steps in both kernels
    LinearKernel("int8_gemv", lambda s: s.nb is not None and bool(s.fmt.act_block) and s.decoding
                 and int8_gemv_takes(s.n_out, s.n_in, s.nb, s.fmt)),
    LinearKernel("int8_gemm", lambda s: s.nb is not None and bool(s.fmt.act_block)),
    # steps that bring chunks: the register-blocked GEMM (decode steps keep the GEMV schedule)
    LinearKernel("gemm", lambda s: s.nb is not None and not s.decoding),
    LinearKernel("packed_linear", lambda s: s.nb is not None),
    # Hopper's wgmma for steps of many rows (mma's tiles for the others): in every step but small decode
    # ones. A gated MLP's gate/up is stored 'gated' so that the decode GEMV applies the activation; wgmma
    # returns the interleaved columns (CUTLASS's epilogue reads no pairs) and a kernel of its own applies it.
    LinearKernel("wgmma", lambda s: s.nb is None and s.step != "decode" and bool(s.tiles) and wgmma_takes(
        s.target.arch, s.dtype, s.weight_dtype, s.n_out, s.n_in, s.fmt.kind, s.fmt.group_size), applies_gate=True),
    # CUDA's tensor cores, in every step but small decode ones
    LinearKernel("mma", lambda s: s.nb is None and bool(s.tiles) and s.step != "decode", applies_gate=True),
    # decode steps: kiln's streaming GEMV where it reads the format, else dlight's
    LinearKernel("gemv", lambda s: s.nb is None and s.decoding and not s.fmt.act_block and gemv_takes(
        s.dtype, s.weight_dtype, s.n_out, s.n_in, s.fmt.kind, s.fmt.group_size, s.activation)),
    LinearKernel("dlight_gemv", lambda s: s.nb is None and s.decoding),
    # a TE matmul as a kernel of its own (kept apart from its elementwise neighbours), or fused by TVM
    LinearKernel("own_linear", lambda s: s.nb is None),
    LinearKernel("te_linear", lambda s: s.nb is None),
)}


def linear_layout(target, n_out: int, n_in: int, operands: str | None = None, act_block: int = 0) -> str:
    """The layout a linear weight [out, in] is stored in for a target (selection/layouts.py names
    them): 'nk' (as in transformers) on GPUs, where the tensor-core GEMM and the GEMV read it so; on
    CPUs, 'packedNB' panels of nb output columns that a kernel accumulates in registers, with the
    inputs a dot product multiplies at once side by side where the target has one (CPUTarget.int8_dot,
    bf16_dot). `operands`: what the weight's kernel multiplies, where the target has a dot product
    for them: "q8"/"q4" weights with int8 activations in blocks of `act_block`, "bf16" weights and
    activations."""
    if target.device != "cpu":
        return "nk"
    nb = next((nb for nb in (64, 32, 16, 8) if n_out % nb == 0), None)
    if nb is None:
        return "nk"
    if operands == "bf16":
        return packed_layout(nb, 2) if target.bf16_dot and nb % 16 == 0 and n_in % 2 == 0 else packed_layout(nb)
    if operands in ("q8", "q4") and target.int8_dot == "vnni" and act_block > 0:
        inputs = n_in * (2 if operands == "q4" else 1)           # a q4 weight is stored as bytes of two
        if vnni_takes(n_out, inputs, nb, WeightFormat(operands, act_block=act_block)):
            # vpdpbusd's byte quads; a q4 byte's nibbles from two activation blocks
            return packed_layout(nb, 4, act_block if operands == "q4" else 0)
    if operands == "q8" and n_in % 2 == 0:
        return packed_layout(nb, 2)                  # vpmaddwd's pairs (a q4 byte is one already)
    return packed_layout(nb)


def target_layout(node, graph: Graph, target) -> str:
    """The layout the target stores a linear's weight param in (linear_layout): int8 activations or
    bf16 weights take the target's dot product's operands side by side. A weight the graph computes
    is 'nk'."""
    name = input_of(node, "weight")
    if name not in graph.params:
        return "nk"
    weight, act_block = graph.params[name].type, node.attrs.get("act_block", 0)
    fmt = weight_format(node)
    operands = ({"q8g": "q8", "q4a": "q4", "q4k": "q4"}.get(fmt, fmt) if act_block > 0    # stored as q8's / q4's levels
                else "bf16" if fmt == "none" and weight.dtype == "bfloat16" else None)
    return linear_layout(target, *weight.shape, operands=operands, act_block=act_block)


def gate_of(node, graph: Graph) -> str | None:
    """The gated op (swiglu, geglu) that alone reads a linear's output, where the linear has no bias or
    residual and is not an output of the graph: a kernel may apply it in its epilogue."""
    if node.op != "linear" or input_of(node, "bias") or input_of(node, "residual") or node.output in graph.outputs:
        return None
    users = [n for n in graph.nodes if node.output in n.inputs]
    return users[0].op if len(users) == 1 and users[0].op in GATE_ACTIVATIONS else None


def linear_site(node, graph: Graph, target, types: dict, step: str, activation: str | None = None) -> LinearSite:
    """The site of a linear node in a step of kind `step` (`types`: the graph's value types)."""
    return LinearSite(target, step, target_layout(node, graph, target), node.type.shape[-1],
                      types[input_of(node, "x")].shape[-1], node.type.dtype, types[input_of(node, "weight")].dtype,
                      WeightFormat.of(node), activation)
