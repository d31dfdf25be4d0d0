"""Targets, found by name. Each is one small file declaring a subclass of targets.base.Target."""
from __future__ import annotations

from kiln.errors import KilnError

TARGET_NAMES = ("cpu", "cuda")


def get_target(name: str, arch: str | None = None):
    if name not in TARGET_NAMES:
        raise KilnError(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    if name == "cuda":
        from .cuda import CUDATarget, ensure_cuda_loader
        target = CUDATarget(arch=arch or "sm_80")
        ensure_cuda_loader()
        return target
    from .cpu import CPUTarget
    if arch:
        raise KilnError("target cpu takes no --arch (it compiles for this machine's CPU)")
    return CPUTarget()
