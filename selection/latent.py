"""MLA (latent) attention kernels: what each family can run. A latent layer runs the first family of
its target's order that serves it in each step kind (the families share the latent pages' layout);
its expanded prefill form (passes/specialize_mla.py) runs the family's expanded kernels.

  kiln_latent   kiln's CPU kernels (codegen/kernels/cpu/mla.py): int8/float8 rows, MQA over the
                latent rows; its expanded form's kernels are kiln_expanded (latent_gather,
                expanded_attend).
  tvm_mla       TVM's MLA append and attention kernels (codegen/kernels/tvm_kernels.py): unquantised
                rows; no expanded form.
  flashinfer_mla  FlashInfer's MLA attention over the latent pages (codegen/kernels/gpu/flashinfer.py,
                `--attention flashinfer`) after TVM's append, in the steps that are not plain decodes
                (decode steps keep tvm_mla, in CUDA graphs): float16/bfloat16 rows of DeepSeek's
                widths (a 512-wide latent and 64 rope dims).
codegen/lowering/mla.py emits each by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.interface import KVSpec


@dataclass(frozen=True)
class LatentKernel:
    name: str
    quantized_kv: bool                 # reads int8/float8 rows
    expanded: str | None               # the kernels of its expanded prefill form (None: it has none)
    steps: tuple[str, ...] = ("mixed", "decode")       # the step kinds it runs
    widths: tuple[tuple[int, int], ...] = ()           # (latent, rope) widths it is built for (empty: any)
    page_dtypes: tuple[str, ...] = ()                  # the row dtypes it reads (empty: any it reads)

    def supports(self, spec: KVSpec, step: str = "mixed") -> bool:
        widths = (spec.v_head_dim, spec.k_head_dim - spec.v_head_dim)
        return (step in self.steps and (self.quantized_kv or spec.scales == "none")
                and (not self.widths or widths in self.widths)
                and (not self.page_dtypes or spec.dtype in self.page_dtypes))


LATENT_KERNELS = {k.name: k for k in (
    LatentKernel("kiln_latent", quantized_kv=True, expanded="kiln_expanded"),
    LatentKernel("tvm_mla", quantized_kv=False, expanded=None),
    LatentKernel("flashinfer_mla", quantized_kv=False, expanded=None, steps=("mixed",), widths=((512, 64),),
                 page_dtypes=("float16", "bfloat16")),
)}
EXPANDED_KERNELS = tuple(k.expanded for k in LATENT_KERNELS.values() if k.expanded)
