"""Targets, found by name: `kiln.targets.<name>` is one small file whose `make_target(arch)`
returns a targets.base.Target subclass instance."""
from __future__ import annotations

import importlib

from kiln.errors import KilnError

from .script_frames import remember_files_without_modules

remember_files_without_modules()        # before any TVMScript is parsed: see script_frames.py

TARGET_NAMES = ("cpu", "cuda", "rocm", "metal")


def _module(name: str):
    if name not in TARGET_NAMES:
        raise KilnError(f"unknown target {name!r} (known: {', '.join(TARGET_NAMES)})")
    return importlib.import_module(f"{__name__}.{name}")


def get_target(name: str, arch: str | None = None):
    return _module(name).make_target(arch)


def target_defaults(name: str):
    """The target `name` with its default settings, without the side effects of `get_target` (CUDA's
    loader, tool checks): what passes read to plan a pipeline for it."""
    return _module(name).TARGET_CLASS()


def planned_target(name: str, arch: str | None, activation_block: int):
    """The target as compile planned an artifact's passes (its manifest's target, arch and activation
    block), made without asking this machine's CPU or GPU anything: for `kiln attach-weights`."""
    return _module(name).TARGET_CLASS.as_planned(arch, activation_block)
