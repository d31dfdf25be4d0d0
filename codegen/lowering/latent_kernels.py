"""MLA attention kernels by name, what each can run, and the choice for a latent layer.

A latent (MLA) layer runs one kernel family in every step; a target's first family that runs the
layer's cache is chosen (`choose_latent_kernel`), by compile for the manifest and by codegen/lowering/mla.py
for the code it emits.
  kiln_latent   kiln's CPU kernels (codegen/lowering/mla.py): int8/float8 rows, MQA over the latent rows,
                and the expanded prefill form's kernels (latent_gather, expanded_attend).
  tvm_mla       TVM's MLA append and attention kernels (codegen/kernels/tvm_kernels.py): unquantised rows on
                GPUs; no expanded form.
No TVM import here: the compiler reads this table before TVM is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.ir.kv_spec import KVSpec


@dataclass(frozen=True)
class LatentKernel:
    name: str
    devices: tuple[str, ...]           # runtime devices it is built for
    quantized_kv: bool                 # reads int8/float8 rows
    expanded_prefill: bool             # has the expanded form's kernels (passes/specialize_mla.py)

    def supports(self, spec: KVSpec, device: str) -> bool:
        return device in self.devices and (self.quantized_kv or spec.scales == "none")


KERNELS = {k.name: k for k in (
    LatentKernel("kiln_latent", ("cpu",), quantized_kv=True, expanded_prefill=True),
    LatentKernel("tvm_mla", ("cuda", "rocm", "metal"), quantized_kv=False, expanded_prefill=False),
)}


def choose_latent_kernel(target, spec: KVSpec) -> LatentKernel:
    """The first kernel family that runs a latent layer whose cache is `spec` on `target`."""
    for kernel in KERNELS.values():
        if kernel.supports(spec, target.device):
            return kernel
    raise KilnError(f"target {target.name} has no MLA attention kernel for a latent KV cache of {spec.describe()} "
                    f"(kernels: {', '.join(k.name for k in KERNELS.values() if target.device in k.devices)})")
