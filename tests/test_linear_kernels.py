"""The linear kernel registry (codegen/lowering/linear.py LINEAR_KERNELS): which kernel a linear gets, by
target, step, layout and format, as docs/kernels.md describes the choice."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from kiln.codegen.lowering.linear import LINEAR_KERNELS, LinearSite
from kiln.codegen.kernels.weight_format import WeightFormat
from kiln.targets import target_defaults


def chosen(target, step, layout="", fmt=WeightFormat(), dtype="bfloat16", shape=(2048, 2048), wide=False):
    ctx = SimpleNamespace(target=target, step=step, wide_decode=wide)
    weight = SimpleNamespace(ty=SimpleNamespace(dtype=dtype))
    site = LinearSite(ctx, [None, weight], [], layout, *shape, dtype, fmt, None)
    return [k.name for k in LINEAR_KERNELS if k.supports(site)][0]


@pytest.mark.parametrize("target,step,wide,want", [
    ("cuda", "mixed", False, "mma"),            # tensor cores wherever a step brings chunks
    ("cuda", "decode", False, "gemv"),          # kiln's streaming GEMV in small decode steps
    ("cuda", "decode", True, "mma"),            # decode_wide: from decode_mma_from sequences
    ("rocm", "decode", False, "te_linear"),     # TVM's schedules off CUDA
])
def test_gpu_linears(target, step, wide, want):
    gpu = target_defaults(target)
    if target == "cuda":
        gpu = replace(gpu, arch="sm_90")
    assert chosen(gpu, step, wide=wide) == want


def test_cpu_linears_by_layout_and_step():
    cpu = replace(target_defaults("cpu"), chunk_gemm=True)
    assert chosen(cpu, "mixed", "packed16", dtype="float32") == "gemm"
    assert chosen(cpu, "decode", "packed16", dtype="float32") == "packed_linear"
    assert chosen(cpu, "decode", "packed16x2") == "bf16dot"
    int8 = WeightFormat("q8", act_block=32)
    assert chosen(cpu, "mixed", "packed16x4", int8, dtype="float32") == "vnni"
    assert chosen(cpu, "mixed", "packed16", int8, dtype="float32") == "int8_gemm"
    assert chosen(cpu, "mixed", "", dtype="float32") == "te_linear"


def expert_gemm(target, layout, dtype="bfloat16", fmt=WeightFormat()):
    from kiln.codegen.lowering.moe import MOE_GEMM_KERNELS, ExpertGemm
    weight = SimpleNamespace(ty=SimpleNamespace(dtype=dtype, shape=(8, 2048, 2048)))
    gemm = ExpertGemm(SimpleNamespace(target=target), "moe_down", [None, None, weight], 2048, 2048, layout, dtype,
                      fmt, gather=False, weighted=True)
    return [k.name for k in MOE_GEMM_KERNELS if k.supports(gemm)][0]


def test_moe_grouped_gemms_by_target_and_layout():
    cuda = replace(target_defaults("cuda"), arch="sm_90")
    assert expert_gemm(cuda, "") == "mma"
    assert expert_gemm(target_defaults("rocm"), "") == "te"
    assert expert_gemm(target_defaults("cpu"), "packed16", dtype="float32") == "packed"


def test_every_attention_and_latent_kernel_has_an_emitter():
    from kiln.codegen.lowering import attention, attention_kernels, latent_kernels, mla
    assert set(attention.EMITTERS) == set(attention_kernels.KERNELS)
    assert set(mla.EMITTERS) == set(latent_kernels.KERNELS)
