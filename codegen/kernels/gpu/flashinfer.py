"""FlashInfer's attention kernels, compiled at `kiln compile` and linked into a CUDA artifact's library:
its batch prefill over paged KV, and its MLA attention over a paged latent cache.

flashinfer-python (a compile-time extra, release FLASHINFER_RELEASE) generates the CUDA sources of
one variant (kind, dtypes, head dim; for the prefill a sliding window and soft-capped scores)
through its JIT, and nvcc builds them. kiln builds only what its graphs call: for the prefill the
paged kernels of the causal mask (a decode row is a causal row of one query) and FlashInfer's
plan/run, about a third of FlashInfer's whole prefill module (the run's dispatch to the other masks
stays unresolved in the library: the dynamic loader binds a function when it is first called, which
kiln never does); for MLA its plan and run. kiln's own bindings (flashinfer_binding.cc,
flashinfer_mla_binding.cc) export the two functions an artifact uses: `kiln_flashinfer_plan` (the
runtime plans each step on the host; one signature for both kinds) and `kiln_flashinfer_attend`
(destination-passing, for the graph). The runtime needs neither torch nor flashinfer.

The objects are cached under FlashInfer's JIT directory inside kiln's cache (KILN_CACHE_DIR, else
~/.cache/kiln), keyed by release, arch and variant: a second compile builds nothing.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

from .cuda_objects import cache_dir, installed_release

FLASHINFER_RELEASE = "0.6.6"      # its plan/run signatures are the ones flashinfer_binding.cc declares
FALLBACK = "--attention builtin (kiln's and TVM's kernels)"
HERE = Path(__file__).parent
BINDINGS = {"prefill": HERE / "flashinfer_binding.cc", "mla": HERE / "flashinfer_mla_binding.cc"}
VIEWS = HERE / "flashinfer_views.h"      # what both include
# the objects kiln builds of FlashInfer's sources, by kind (its bindings are kiln's)
OBJECTS = {"prefill": ("batch_prefill_paged_kernel_mask_1.cuda.o", "batch_prefill.cuda.o"),
           "mla": ("batch_mla_plan.cuda.o", "batch_mla_run.cuda.o")}
EXPORTS = ("kiln_flashinfer_plan", "kiln_flashinfer_attend")
SCALARS = ["logits_soft_cap", "sm_scale", "rope_rcp_scale", "rope_rcp_theta"]     # the binding's order


@dataclass(frozen=True)
class FlashInferVariant:
    """One build of FlashInfer's kernels: every FlashInfer layer of an artifact runs it."""
    kind: str                  # "prefill": paged attention; "mla": attention over a latent cache
    dtype: str                 # q, pages and output alike
    head_dim: int              # prefill: the heads' dim; mla: the latent width
    rope: int = 0              # mla: the rope width after the latent
    window: bool = False       # prefill: built with its sliding-window mask (window_left < 0: full layers)
    softcap: bool = False      # prefill: built with soft-capped scores

    @property
    def name(self) -> str:
        if self.kind == "mla":
            return f"kiln_mla_{self.dtype}_{self.head_dim}x{self.rope}"
        return f"kiln_prefill_{self.dtype}_d{self.head_dim}{'_window' if self.window else ''}" \
               f"{'_softcap' if self.softcap else ''}"

    @property
    def binding(self) -> Path:
        return BINDINGS[self.kind]


def check_release() -> None:
    """flashinfer-python must be the release whose functions the binding declares."""
    found = installed_release("flashinfer-python")
    if found is None:
        raise KilnError(f"--attention flashinfer needs flashinfer-python=={FLASHINFER_RELEASE} at compile time, and it "
                        f"is not installed (`make flashinfer-deps` installs it); or compile with {FALLBACK}")
    if found != FLASHINFER_RELEASE:
        raise KilnError(f"--attention flashinfer needs flashinfer-python=={FLASHINFER_RELEASE}; {found} is installed "
                        f"(its plan/run signatures differ): install {FLASHINFER_RELEASE}, or compile with {FALLBACK}")
    if ninja() is None:
        raise KilnError(f"--attention flashinfer builds with ninja, which is not installed (`make flashinfer-deps` "
                        f"installs it); or compile with {FALLBACK}")


def ninja() -> str | None:
    """The ninja FlashInfer's build runs: on PATH, or the pip package's beside this Python."""
    beside = Path(sys.executable).with_name("ninja")
    return shutil.which("ninja") or (str(beside) if beside.exists() else None)


def arch_list(arch: str) -> str:
    """FlashInfer's FLASHINFER_CUDA_ARCH_LIST entry for a kiln arch (sm_90 -> 9.0a: Hopper's
    arch-specific instructions)."""
    number = arch.removeprefix("sm_")
    return f"{number[:-1]}.{number[-1]}" + ("a" if number in ("90", "100") else "")


def _spec(variant: FlashInferVariant):
    """FlashInfer's JIT spec of the variant (its sources written under its JIT directory)."""
    import torch     # flashinfer's JIT names dtypes as torch's (compile time only)
    from flashinfer.jit.attention.modules import gen_batch_mla_module, gen_customize_batch_prefill_module
    dtype = getattr(torch, variant.dtype)
    if variant.kind == "mla":
        return gen_batch_mla_module("fa2", dtype, dtype, dtype, torch.int32, variant.head_dim, variant.rope, False)
    return gen_customize_batch_prefill_module(
        "fa2", variant.name, dtype, dtype, dtype, torch.int32, variant.head_dim, variant.head_dim, [], [],
        SCALARS, ["double"] * len(SCALARS),
        f"DefaultAttention<false, {str(variant.window).lower()}, {str(variant.softcap).lower()}, false>",
        "#include <flashinfer/attention/variants.cuh>", pos_encoding_mode=0, use_sliding_window=variant.window,
        use_logits_soft_cap=variant.softcap)


def build_objects(variant: FlashInferVariant, arch: str) -> list[Path]:
    """The object files of `variant` for `arch` (built where missing or stale): FlashInfer's, then kiln's binding."""
    check_release()
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(cache_dir())
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = arch_list(arch)
    spec = _spec(variant)
    spec.write_ninja()
    objects = [o for o in spec.get_object_paths() if o.name in OBJECTS[variant.kind]]
    built = subprocess.run([ninja(), "-C", str(spec.build_dir), "-f", str(spec.ninja_path),
                            *(str(o) for o in objects)], capture_output=True, text=True)
    if built.returncode != 0:
        raise KilnError(f"building FlashInfer's {variant.name} for {arch} failed: {built.stdout[-1500:]}")
    source = variant.binding
    binding = Path(spec.build_dir) / f"kiln_{source.stem}.o"
    if not binding.exists() or binding.stat().st_mtime < max(source.stat().st_mtime, VIEWS.stat().st_mtime):
        import tvm_ffi.libinfo
        includes = [f"-I{p}" for p in tvm_ffi.libinfo.include_paths()]
        compiled = subprocess.run(["g++", "-std=c++17", "-O2", "-fPIC", "-c", str(source), *includes,
                                   "-o", str(binding)], capture_output=True, text=True)
        if compiled.returncode != 0:
            raise KilnError(f"building kiln's FlashInfer binding failed: {compiled.stderr[-1500:]}")
    return [*objects, binding]


def static_libraries(variant: FlashInferVariant, arch: str) -> list:
    """The variant's objects as TVM static libraries, for the Relax build's external_mods."""
    import tvm
    return [tvm.runtime.load_static_library(str(o), func_names=list(EXPORTS) if o.name.startswith("kiln_") else [])
            for o in build_objects(variant, arch)]
