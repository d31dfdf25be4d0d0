"""Each target's kernels in order of preference, per family: the first whose record supports a site
runs it (selection/choice.py). A target holds its order (`Target.kernels`); a test or a benchmark
may hand a target another one (`KernelOrder.without`, dataclasses.replace).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kiln.errors import KilnError

from .attention import ATTENTION_KERNELS
from .experts import EXPERT_KERNELS
from .latent import LATENT_KERNELS
from .linear import LINEAR_KERNELS


@dataclass(frozen=True)
class KernelOrder:
    attention: dict[str, tuple[str, ...]]      # step kind ("mixed": any step, "decode") -> kernel names
    latent: tuple[str, ...]
    linear: tuple[str, ...]
    experts: tuple[str, ...]
    name: str = field(default="", compare=False)

    def __post_init__(self):
        records = [(ATTENTION_KERNELS, n) for names in self.attention.values() for n in names]
        records += [(LATENT_KERNELS, n) for n in self.latent] + [(LINEAR_KERNELS, n) for n in self.linear]
        records += [(EXPERT_KERNELS, n) for n in self.experts]
        unknown = sorted(n for table, n in records if n not in table)
        if unknown:
            raise KilnError(f"kernel order {self.name!r} names no kernel called {', '.join(unknown)}")

    def without(self, *names: str) -> KernelOrder:
        """This order less the kernels `names` (in every family)."""
        drop = lambda order: tuple(n for n in order if n not in names)     # noqa: E731
        return replace(self, attention={step: drop(o) for step, o in self.attention.items()},
                       latent=drop(self.latent), linear=drop(self.linear), experts=drop(self.experts))

    def fuses_rope(self) -> bool:
        """Whether every attention kernel it prefers runs the fused rope + attention form (the
        fuse_rope_attention pass makes it)."""
        return all(ATTENTION_KERNELS[names[0]].fused_qkv for names in self.attention.values())


CPU_KERNELS = KernelOrder(
    name="cpu",
    attention={"mixed": ("kiln_cpu",), "decode": ("kiln_cpu",)},
    latent=("kiln_latent",),
    # packed layouts take the first eight, in this order; 'nk' weights (no panel width divides the
    # outputs) the TE matmul the CPU pipeline schedules
    linear=("amx_bf16", "bf16dot", "amx_int8", "vnni", "int8_gemv", "int8_gemm", "gemm", "packed_linear", "te_linear"),
    experts=("packed", "te"),
)

CUDA_KERNELS = KernelOrder(
    name="cuda",
    # Decode steps: kiln's kernel first. It splits a sequence's keys over thread blocks, where TVM's decode
    # kernel gives one block to each sequence and KV head: on an H100 at 4,096 tokens of context a Gemma 2
    # layer's decode attention took 51 µs with kiln's and 607 µs with TVM's (docs/BENCHMARKS.md).
    # Mixed steps: TVM's prefill kernel where it runs the layer (full attention, unquantised pages), kiln's
    # for windows, soft-capped scores and int8/fp8 pages.
    attention={"mixed": ("tvm_prefill", "kiln_gpu"), "decode": ("kiln_gpu_decode", "tvm_decode", "tvm_prefill")},
    latent=("tvm_mla",),
    # wgmma (sm_90 only) before mma; own_linear before te_linear: between the opaque tensor-core
    # kernels the default fusion would group a linear dlight cannot take with its elementwise neighbours
    linear=("wgmma", "mma", "gemv", "dlight_gemv", "own_linear", "te_linear"),
    experts=("mma", "te"),
)

# `kiln compile --attention flashinfer`: FlashInfer's prefill for the steps that are not plain decode
# (prompts, chunks beside decodes, speculative verification); decode steps keep kiln's split kernel,
# which CUDA graphs capture. Layers FlashInfer cannot serve take CUDA's kernels (kiln inspect says which).
CUDA_FLASHINFER_KERNELS = replace(CUDA_KERNELS, name="cuda-flashinfer",
                                  attention={**CUDA_KERNELS.attention,
                                             "mixed": ("flashinfer", *CUDA_KERNELS.attention["mixed"])},
                                  latent=("flashinfer_mla", *CUDA_KERNELS.latent))

# ROCm and Metal: TVM's kernels and schedules. No own_linear: on ROCm TVM's LLVM codegen emits the
# rule's lane shuffles with a 64-bit lane index, which LLVM's verifier rejects (kernels with a residual).
GPU_KERNELS = KernelOrder(
    name="gpu",
    attention={"mixed": ("tvm_prefill", "kiln_gpu_fallback"),
               "decode": ("tvm_decode", "tvm_prefill", "kiln_gpu_fallback")},
    latent=("tvm_mla",),
    linear=("te_linear",),
    experts=("te",),
)
