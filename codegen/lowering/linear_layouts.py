"""The layout a linear weight [out, in] is stored in for a target (codegen/kernels/layouts.py names them):
'nk' (as in transformers) on GPUs, where the tensor-core GEMM and the GEMV read it so; on CPUs,
'packedNB' panels of nb output columns that a kernel accumulates in registers, with the inputs a
dot product multiplies at once side by side where the target has one (CPUTarget.int8_dot, bf16_dot)."""
from __future__ import annotations

from ..kernels.layouts import packed_layout
from ..kernels.cpu.vnni_linear import supports as vnni_supports
from ..kernels.weight_format import WeightFormat


def linear_layout(target, n_out: int, n_in: int, operands: str | None = None, act_block: int = 0) -> str:
    """`operands`: what the weight's kernel multiplies, where the target has a dot product for them:
    "q8"/"q4" weights with int8 activations in blocks of `act_block`, "bf16" weights and activations."""
    if target.device != "cpu":
        return "nk"
    nb = next((nb for nb in (64, 32, 16, 8) if n_out % nb == 0), None)
    if nb is None:
        return "nk"
    if operands == "bf16":
        return packed_layout(nb, 2) if target.bf16_dot and nb % 16 == 0 and n_in % 2 == 0 else packed_layout(nb)
    if operands in ("q8", "q4") and target.int8_dot == "vnni" and act_block > 0:
        inputs = n_in * (2 if operands == "q4" else 1)           # a q4 weight is stored as bytes of two
        if vnni_supports(n_out, inputs, nb, WeightFormat(operands, act_block=act_block)):
            # vpdpbusd's byte quads; a q4 byte's nibbles from two activation blocks
            return packed_layout(nb, 4, act_block if operands == "q4" else 0)
    if operands == "q8" and n_in % 2 == 0:
        return packed_layout(nb, 2)                  # vpmaddwd's pairs (a q4 byte is one already)
    return packed_layout(nb)
