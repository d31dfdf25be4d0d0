"""Attention kernels by name, what each can run, and the choice for a layer and step kind.

A target lists, per step kind, the kernels it prefers (`Target.attention_kernels`);
`specialize_attention` records the first that supports each layer (`choose_kernel`), and codegen
(codegen/lowering/attention.py) emits the recorded one. Step kinds: "mixed" (any step: prefill chunks,
possibly with decode tokens) and "decode" (one new token per sequence); the compiler gives each
step kind whose kernels differ its own entry function.
  kiln_cpu      kiln's own CPU kernels: fused qkv, rope inside, int8/float8 pages, sliding
                windows, soft-capped scores. Any step.
  tvm_prefill   TVM's paged prefill kernel. Any step. Full attention only: its window mode
                drops whole leading rows for every query of a sequence alike, not per query.
  tvm_decode    TVM's paged decode kernel: one query per sequence; on GPUs a block serves the q
                heads of one KV head, so a GQA group reads each K/V page once.
  kiln_gpu      kiln's CUDA kernel (codegen/kernels/gpu/attention.py): any step, sliding windows,
                soft-capped scores, int8/float8 pages (with its own quantising append), any
                head ratio; decode steps split long contexts over thread blocks.
  kiln_gpu_fallback  kiln's CPU attention kernel bound to GPU thread blocks, one per (sequence,
                KV head), after TVM's append: correct for sliding windows and soft-capped scores,
                which TVM's kernels lack, but one thread walks each task's keys: slow. GPU targets
                take it only for the layers no other kernel runs (ROCm and Metal: every
                windowed or soft-capped layer).
No TVM import here: targets read this table before TVM is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError
from kiln.ir.kv_spec import KVSpec
from kiln.ir.types import numpy_dtype

BOTH_STEPS = ("mixed", "decode")          # a kernel serving any step and decode-only ones


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    steps: tuple[str, ...]             # step kinds it can run
    devices: tuple[str, ...]           # runtime devices it is built for
    quantized_kv: bool                 # reads int8/float8 pages
    fused_qkv: bool                    # runs paged_attention_fused (rope inside)
    windows: bool                      # runs sliding-window layers
    softcap: bool = False              # soft-caps scores (Gemma 2)
    row_bytes: int = 0                 # a stored row's bytes must be a multiple of this (its loads' width)

    def supports(self, op: str, spec: KVSpec, device: str, step: str, softcap: bool = False) -> bool:
        row = spec.head_dim * np.dtype(numpy_dtype(spec.dtype)).itemsize
        return (step in self.steps and device in self.devices and (op == "paged_attention" or self.fused_qkv)
                and (self.quantized_kv or spec.scales == "none") and (self.windows or spec.kind == "full")
                and (self.softcap or not softcap) and (not self.row_bytes or row % self.row_bytes == 0))


_GPUS = ("cuda", "rocm", "metal")
KERNELS = {k.name: k for k in (
    AttentionKernel("kiln_cpu", BOTH_STEPS, ("cpu",), quantized_kv=True, fused_qkv=True, windows=True, softcap=True),
    AttentionKernel("tvm_prefill", BOTH_STEPS, ("cpu", *_GPUS), quantized_kv=False, fused_qkv=False, windows=False),
    AttentionKernel("tvm_decode", ("decode",), ("cpu", *_GPUS), quantized_kv=False, fused_qkv=False, windows=False),
    AttentionKernel("kiln_gpu", BOTH_STEPS, ("cuda",), quantized_kv=True, fused_qkv=False, windows=True, softcap=True,
                    row_bytes=16),
    AttentionKernel("kiln_gpu_fallback", BOTH_STEPS, _GPUS, quantized_kv=False, fused_qkv=False, windows=True,
                    softcap=True),
)}


def choose_kernel(target, op: str, spec: KVSpec, step: str, softcap: bool = False) -> str:
    """The first of the target's kernels for `step` that runs this attention op (soft-capped or
    not) on a layer whose cache is `spec`."""
    wanted = target.attention_kernels[step]
    for name in wanted:
        if KERNELS[name].supports(op, spec, target.device, step, softcap):
            return name
    capped = " with soft-capped scores" if softcap else ""
    raise KilnError(f"target {target.name} has no attention kernel for {op}{capped} over a KV cache of "
                    f"{spec.describe()} in {step} steps (its kernels: {', '.join(wanted)})")
