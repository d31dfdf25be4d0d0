"""MLA (latent) attention kernels: what each family can run. A latent layer runs one family in every
step; its expanded prefill form (passes/specialize_mla.py) runs the family's expanded kernels.

  kiln_latent   kiln's CPU kernels (codegen/kernels/cpu/mla.py): int8/float8 rows, MQA over the
                latent rows; its expanded form's kernels are kiln_expanded (latent_gather,
                expanded_attend).
  tvm_mla       TVM's MLA append and attention kernels (codegen/kernels/tvm_kernels.py): unquantised
                rows; no expanded form.
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

    def supports(self, spec: KVSpec) -> bool:
        return self.quantized_kv or spec.scales == "none"


LATENT_KERNELS = {k.name: k for k in (
    LatentKernel("kiln_latent", quantized_kv=True, expanded="kiln_expanded"),
    LatentKernel("tvm_mla", quantized_kv=False, expanded=None),
)}
EXPANDED_KERNELS = tuple(k.expanded for k in LATENT_KERNELS.values() if k.expanded)
