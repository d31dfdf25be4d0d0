"""What every CUDA object kiln builds at `kiln compile` and links into an artifact shares (FlashInfer's,
codegen/kernels/gpu/flashinfer.py; CUTLASS's Hopper GEMMs, hopper_gemm.py): where they are cached,
and the link that binds CUDA's runtime library, which they call.
"""
from __future__ import annotations

import glob
import os
from importlib import metadata
from pathlib import Path

from kiln.errors import KilnError


def cache_dir() -> Path:
    """kiln's build cache: KILN_CACHE_DIR, else ~/.cache/kiln."""
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")


def installed_release(package: str) -> str | None:
    """The installed release of a compile-time package (flashinfer-python, nvidia-cutlass), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cudart_link_options() -> list[str]:
    """Link options that bind CUDA's runtime library: the linked objects' kernels register themselves
    with it when the library loads."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            if (Path(root) / sub / "libcudart.so").exists():
                return [f"-L{Path(root) / sub}", "-Wl,--no-as-needed", "-lcudart"]
    raise KilnError("linking CUDA objects (FlashInfer's attention, CUTLASS's Hopper GEMMs) needs CUDA's runtime "
                    "library (libcudart.so), which was not found under CUDA_HOME or /usr/local/cuda*: set CUDA_HOME")
