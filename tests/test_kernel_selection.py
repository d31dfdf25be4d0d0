"""Kernel selection (selection/): which kernel a site gets from its target's order, as docs/kernels.md
describes the choice, what select_kernels records on a graph, and which entries the recorded choices
give an artifact."""
from __future__ import annotations

from dataclasses import replace

import pytest

from kiln.errors import KilnError
from kiln.ir import GraphBuilder, verify
from kiln.selection.choice import gated_activation, recorded
from kiln.selection.experts import EXPERT_KERNELS, ExpertSite
from kiln.selection.formats import WeightFormat
from kiln.selection.linear import LINEAR_KERNELS, LinearSite
from kiln.selection.order import CPU_KERNELS, KernelOrder
from kiln.targets import target_defaults


def cuda(arch="sm_90"):
    return replace(target_defaults("cuda"), arch=arch)


def chosen(target, step, layout="nk", fmt=WeightFormat(), dtype="bfloat16", shape=(2048, 2048)):
    weight_dtype = {"q8": "int8", "q4": "uint8", "fp8": "float8_e4m3fn"}.get(fmt.kind, dtype)
    site = LinearSite(target, step, layout, *shape, dtype, weight_dtype, fmt)
    return next(name for name in target.kernels.linear if LINEAR_KERNELS[name].supports(site))


@pytest.mark.parametrize("target,step,want", [
    ("cuda", "mixed", "wgmma"),          # Hopper: CUTLASS's wgmma GEMM (mma's tiles for few rows)
    ("cuda", "prefill", "wgmma"),
    ("cuda", "decode", "gemv"),          # kiln's streaming GEMV in small decode steps
    ("cuda", "decode_wide", "wgmma"),    # from decode_mma_from sequences
    ("cuda-sm_89", "mixed", "mma"),      # before Hopper: mma.sync wherever a step brings chunks
    ("cuda-sm_80", "prefill", "mma"),
    ("cuda-sm_80", "decode", "gemv"),
    ("cuda-sm_80", "decode_wide", "mma"),
    ("rocm", "decode", "te_linear"),     # TVM's schedules off CUDA
    ("metal", "mixed", "te_linear"),
])
def test_gpu_linears(target, step, want):
    gpu = cuda(*target.split("-")[1:]) if target.startswith("cuda") else target_defaults(target)
    assert chosen(gpu, step) == want


@pytest.mark.parametrize("fmt", [WeightFormat("q8"), WeightFormat("q4", group_size=32), WeightFormat("fp8")])
def test_hopper_gemm_takes_q4_in_groups_its_k_tile_divides(fmt):
    """On sm_90 q8, fp8 and q4 in groups of 32 keep mma's mixed-input main loop (CUTLASS's loads a
    group's scales per 64-wide K tile); q4 in groups of 128 takes the Hopper GEMM."""
    assert chosen(cuda(), "mixed", fmt=fmt) == "mma"
    assert chosen(cuda(), "decode_wide", fmt=fmt) == "mma"
    assert chosen(cuda(), "mixed", fmt=WeightFormat("q4", group_size=128)) == "wgmma"
    assert chosen(cuda(), "decode", fmt=WeightFormat("q4", group_size=128)) == "gemv"
    assert chosen(cuda(), "mixed", dtype="float32") == "own_linear"


def test_cuda_linears_the_tensor_cores_cannot_take():
    # float32 activations: no tensor-core kernel and no streaming GEMV; dlight's GEMV in decode steps
    assert chosen(cuda(), "mixed", dtype="float32") == "own_linear"
    assert chosen(cuda(), "decode", dtype="float32") == "dlight_gemv"
    # q4 in groups of 8 inputs: neither kiln kernel reads them
    assert chosen(cuda(), "decode", fmt=WeightFormat("q4", group_size=8)) == "dlight_gemv"


def test_cpu_linears_by_layout_and_step():
    cpu = replace(target_defaults("cpu"), tiles="")         # AMX's tile kernels: tests/test_cpu_tiles.py
    assert chosen(cpu, "mixed", "packed16", dtype="float32") == "gemm"
    assert chosen(cpu, "decode", "packed16", dtype="float32") == "packed_linear"
    assert chosen(cpu, "decode", "packed16x2") == "bf16dot"
    int8 = WeightFormat("q8", act_block=32)
    assert chosen(cpu, "mixed", "packed16x4", int8, dtype="float32") == "vnni"
    assert chosen(cpu, "decode", "packed16x4", int8, dtype="float32") == "vnni"
    assert chosen(cpu, "mixed", "packed16", int8, dtype="float32") == "int8_gemm"
    assert chosen(cpu, "decode", "packed16", int8, dtype="float32") == "int8_gemv"
    assert chosen(cpu, "mixed", "nk", dtype="float32") == "te_linear"
    # without the GEMM in its order (bench/peers.py's "gemv" row) every step runs the GEMV schedule
    assert chosen(replace(cpu, kernels=cpu.kernels.without("gemm")), "mixed", "packed16", dtype="float32") == \
        "packed_linear"


def test_moe_grouped_gemms_by_target_and_layout():
    def expert_kernel(target, layout, dtype="bfloat16"):
        site = ExpertSite(target, dtype, dtype, WeightFormat(), ((4096, 2048, layout), (2048, 2048, layout)))
        return next(name for name in target.kernels.experts if EXPERT_KERNELS[name].supports(site))
    assert expert_kernel(cuda(), "nk") == "mma"
    assert expert_kernel(cuda(), "nk", dtype="float32") == "te"
    assert expert_kernel(target_defaults("rocm"), "nk") == "te"
    assert expert_kernel(target_defaults("cpu"), "packed16", dtype="float32") == "packed"
    assert expert_kernel(target_defaults("cpu"), "nk", dtype="float32") == "te"


def test_an_order_names_only_kernels_that_exist():
    with pytest.raises(KilnError, match="names no kernel called flash"):
        replace(CPU_KERNELS, linear=("flash", "gemm"))
    smaller = CPU_KERNELS.without("gemm", "kiln_cpu")
    assert "gemm" not in smaller.linear and smaller.attention["mixed"] == () and isinstance(smaller, KernelOrder)


def test_every_kernel_record_has_an_emitter():
    from kiln.codegen.lowering import attention, linear, mla, moe
    from kiln.selection.attention import ATTENTION_KERNELS
    from kiln.selection.latent import LATENT_KERNELS
    assert set(attention.EMITTERS) == set(ATTENTION_KERNELS)
    assert set(mla.EMITTERS) == set(LATENT_KERNELS)
    assert set(linear.EMITTERS) == set(LINEAR_KERNELS)
    assert set(moe.EMITTERS) == set(EXPERT_KERNELS)


# ---------------------------------------------------------------------------- recorded on a graph

def mlp_graph(dtype="bfloat16", hidden=256, ffn=512, gate="swiglu"):
    """x -> gate/up linear -> swiglu -> down linear: a gated MLP, weights as transformers stores them."""
    b = GraphBuilder("mlp")
    x = b.input("x", ("tokens", hidden), dtype)
    gate_up = b.op("linear", x, b.param("gate_up.weight", (2 * ffn, hidden), dtype), name="gate_up")
    act = b.op(gate, gate_up, name="act")
    return verify(b.output(b.op("linear", act, b.param("down.weight", (hidden, ffn), dtype), name="y")))


def select(graph, target):
    from kiln.passes.select_kernels import SelectKernels
    return SelectKernels(target)(graph)


def test_cuda_records_each_steps_linear_kernel_and_the_gate_its_gemm_applies():
    graph = select(mlp_graph(), cuda("sm_80"))
    gate_up, _, down = graph.nodes
    assert gate_up.attrs["kernels"] == down.attrs["kernels"] == {"mixed": "mma", "decode": "gemv",
                                                                  "decode_wide": "mma"}
    assert [recorded(gate_up, step) for step in ("mixed", "prefill", "decode", "decode_wide")] == \
        ["mma", "mma", "gemv", "mma"]
    # the tensor-core GEMM applies the swiglu after gate/up (its weight stored gated); down has no gate
    assert gated_activation(gate_up, graph) == "silu" and gated_activation(down, graph) is None


def test_hopper_records_wgmma_and_the_gate_the_decode_gemv_applies():
    """On sm_90 the gate/up weight is stored gated, so the decode GEMV applies the swiglu; wgmma returns
    the interleaved columns (CUTLASS's epilogue does not pair them) for a kernel of its own."""
    graph = select(mlp_graph(), cuda())
    gate_up, _, down = graph.nodes
    assert gate_up.attrs["kernels"] == down.attrs["kernels"] == {"mixed": "wgmma", "decode": "gemv",
                                                                  "decode_wide": "wgmma"}
    assert gated_activation(gate_up, graph) == "silu" and gated_activation(down, graph) is None


def test_cpu_records_the_gemm_and_no_gate():
    cpu = target_defaults("cpu")
    graph = select(mlp_graph("float32"), replace(cpu, kernels=cpu.kernels.without("bf16dot")))
    gate_up = graph.nodes[0]
    assert gate_up.attrs["kernels"] == {"mixed": "gemm", "decode": "packed_linear"}
    assert gated_activation(gate_up, graph) is None


def test_a_kernel_for_every_step_leaves_one_record_and_no_decode_entry():
    """The ROCm target runs the same linear kernel in every step: one record, and the graph (with no
    attention) needs no decode entry; CUDA's differ, so it gets decode and wide decode entries."""
    from kiln.codegen.lower import entry_steps
    rocm = select(mlp_graph(), target_defaults("rocm"))
    assert [n.attrs["kernels"] for n in rocm.nodes if n.op == "linear"] == [{"mixed": "te_linear"}] * 2
    assert entry_steps(rocm) == ["mixed"]
    assert entry_steps(select(mlp_graph(), cuda())) == ["mixed", "decode", "decode_wide"]


def test_lowering_refuses_a_graph_without_recorded_kernels():
    with pytest.raises(KilnError, match="no kernel recorded: the select_kernels pass"):
        recorded(mlp_graph().nodes[0], "decode")
