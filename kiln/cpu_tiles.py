"""Intel AMX tiles for an artifact's kernels, asked of Linux. TVM-free: the runtime asks before the
first step (runtime/model.py), and the kernels' own check (codegen/kernels/cpu/tile_micro.py,
kiln_tiles_ready) asks the same of the same process, so what `kiln run --json` reports is what the
kernels do.

Linux hands a process the tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
(kernel 5.16 on); a CPU or kernel without AMX refuses it, and the tile kernels then run their
AVX-512 micro-kernels. KILN_CPU_TILES=off makes the same choice without asking: to compare the two
paths of one artifact.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass

ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18     # Linux x86-64's numbers
OFF_SWITCH, OFF = "KILN_CPU_TILES", "off"
TILE_ISA = ("amx",)             # LLVM feature prefixes only tile kernels use, each after asking


@dataclass(frozen=True)
class TileState:
    """What an artifact's tile kernels run on in this process."""
    kind: str              # the manifest's: "amx", or "emulated" (tests: no tile instructions)
    granted: bool
    reason: str = ""       # why not, in words

    def as_json(self) -> dict:
        return {"kind": self.kind, "granted": self.granted, **({"reason": self.reason} if self.reason else {})}

    def describe(self) -> str:
        if self.granted:
            return f"CPU tiles: {self.kind}"
        return f"CPU tiles: none ({self.reason}): the {self.kind} kernels run AVX-512 micro-kernels"


def request_tiles(kind: str) -> TileState:
    """Ask Linux for the tile state kind "amx" needs, once per process (asking again is harmless);
    "emulated" tiles are granted without asking."""
    if os.environ.get(OFF_SWITCH) == OFF:
        return TileState(kind, False, f"{OFF_SWITCH}={OFF}")
    if kind == "emulated":
        return TileState(kind, True)
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return TileState(kind, False, f"AMX is Linux x86-64's, not {platform.system()} {platform.machine()}'s")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long          # syscall(long number, ...): every argument a long
    if libc.syscall(*map(ctypes.c_long, (ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))) == 0:
        return TileState(kind, True)
    code = ctypes.get_errno()
    return TileState(kind, False, f"Linux refused AMX's tile state: {errno.errorcode.get(code, code)}, "
                                  f"{os.strerror(code)}")
