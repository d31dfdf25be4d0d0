"""Attention kernels: what each can run (its record's `supports`), and the head ratio's variant.

  kiln_cpu      kiln's own CPU kernels: fused qkv, rope inside, int8/float8 pages, sliding
                windows, soft-capped scores. Any step.
  tvm_prefill   TVM's paged prefill kernel. Any step. Full attention only: its window mode
                drops whole leading rows for every query of a sequence alike, not per query.
  tvm_decode    TVM's paged decode kernel: one query per sequence; on GPUs a block serves the q
                heads of one KV head, so a GQA group reads each K/V page once.
  kiln_gpu      kiln's CUDA kernel (codegen/kernels/gpu/attention.py): any step, sliding windows,
                soft-capped scores, int8/float8 pages (with its own quantising append), any head
                ratio; a block per tile of a sequence's query rows.
  kiln_gpu_decode  the same kernel for decode steps, each sequence's keys split over thread
                blocks and the shares merged: long contexts fill the GPU with few sequences.
  flashinfer    FlashInfer's batch prefill over paged KV (codegen/kernels/gpu/flashinfer.py), linked
                into the artifact with `--attention flashinfer`: tensor cores, ragged rows of any step
                (chunks of prompts beside decode rows and verify rows), sliding windows and soft-capped
                scores; float16/bfloat16 pages (FlashInfer has no int8 KV) and head dims 64, 128, 256.
                The runtime plans each step on the host (runtime/flashinfer_plan.py).
  kiln_gpu_fallback  kiln's CPU attention kernel bound to GPU thread blocks, one per (sequence,
                KV head), after TVM's append: correct for sliding windows and soft-capped scores,
                which TVM's kernels lack, but one thread walks each task's keys: slow. GPU targets
                take it only for the layers no other kernel runs (ROCm and Metal: every
                windowed or soft-capped layer).
codegen/lowering/attention.py emits each by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.dtypes import numpy_dtype
from kiln.interface import KVSpec

BOTH_STEPS = ("mixed", "decode")          # a kernel serving any step and decode-only ones


@dataclass(frozen=True)
class AttentionSite:
    """One attention layer in one kind of step, as a kernel record sees it."""
    op: str                  # paged_attention or paged_attention_fused (rope inside)
    spec: KVSpec             # the layer's cache
    softcap: bool            # soft-capped scores
    step: str                # "mixed" (any step) or "decode"


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    steps: tuple[str, ...]             # step kinds it can run
    quantized_kv: bool                 # reads int8/float8 pages
    fused_qkv: bool                    # runs paged_attention_fused (rope inside)
    windows: bool                      # runs sliding-window layers
    softcap: bool = False              # soft-caps scores (Gemma 2)
    row_bytes: int = 0                 # a stored row's bytes must be a multiple of this (its loads' width)
    head_dims: tuple[int, ...] = ()    # the head dims it is built for (empty: any)
    page_dtypes: tuple[str, ...] = ()  # the page dtypes it reads (empty: any it reads by quantized_kv)

    def supports(self, site: AttentionSite) -> bool:
        spec = site.spec
        row = spec.head_dim * numpy_dtype(spec.dtype).itemsize
        return (site.step in self.steps and (site.op == "paged_attention" or self.fused_qkv)
                and (self.quantized_kv or spec.scales == "none") and (self.windows or spec.kind == "full")
                and (self.softcap or not site.softcap) and (not self.row_bytes or row % self.row_bytes == 0)
                and (not self.head_dims or spec.head_dim in self.head_dims)
                and (not self.page_dtypes or spec.dtype in self.page_dtypes))


ATTENTION_KERNELS = {k.name: k for k in (
    AttentionKernel("kiln_cpu", BOTH_STEPS, quantized_kv=True, fused_qkv=True, windows=True, softcap=True),
    AttentionKernel("tvm_prefill", BOTH_STEPS, quantized_kv=False, fused_qkv=False, windows=False),
    AttentionKernel("tvm_decode", ("decode",), quantized_kv=False, fused_qkv=False, windows=False),
    AttentionKernel("kiln_gpu", BOTH_STEPS, quantized_kv=True, fused_qkv=False, windows=True, softcap=True,
                    row_bytes=16),
    AttentionKernel("kiln_gpu_decode", ("decode",), quantized_kv=True, fused_qkv=False, windows=True, softcap=True,
                    row_bytes=16),
    AttentionKernel("flashinfer", ("mixed",), quantized_kv=False, fused_qkv=False, windows=True, softcap=True,
                    head_dims=(64, 128, 256), page_dtypes=("float16", "bfloat16")),
    AttentionKernel("kiln_gpu_fallback", BOTH_STEPS, quantized_kv=False, fused_qkv=False, windows=True,
                    softcap=True),
)}


def variant_for(q_heads: int, kv_heads: int) -> str:
    """The head ratio's family: 'mha' (ratio 1), 'gqaN' (1 < N < q heads), 'mqa' (one KV head)."""
    if q_heads == kv_heads:
        return "mha"
    if kv_heads == 1:
        return "mqa"
    return f"gqa{q_heads // kv_heads}"
