"""Memory sizes as users write them (--kv-memory), and the host's free memory.

No TVM here: the CLI checks an option with it before anything loads.
"""
from __future__ import annotations

import os
import re

from kiln.errors import KilnError

FRACTION = re.compile(r"\s*0?\.\d+\s*|\s*1(\.0*)?\s*")     # a share of free memory: .3, 0.3, 1, 1.0


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '1.5g' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise KilnError(f"cannot read a memory size from {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def check_kv_memory(spec: str) -> str:
    """`spec` if it is a KV budget the runtime reads ('auto', a fraction in (0, 1], a size above
    zero), else KilnError saying what it is not."""
    if spec == "auto":
        return spec
    if FRACTION.fullmatch(spec):
        if not 0 < float(spec) <= 1:
            raise KilnError(f"{spec!r} is not a fraction of free memory in (0, 1]")
    elif re.fullmatch(r"\s*\d*\.\d*\s*", spec):        # a number with a point is no count of bytes
        raise KilnError(f"{spec!r} is neither a fraction of free memory in (0, 1] nor a size (512MiB, 2GiB)")
    elif parse_bytes(spec) <= 0:
        raise KilnError(f"{spec!r} leaves no memory for the KV cache")
    return spec


def host_available_memory() -> int:
    """Bytes the host can still give without swapping (MemAvailable), or 0 where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
