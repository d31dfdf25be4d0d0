"""Which tensor-core tiles a linear runs, by step rows: the offline tuning table, else defaults; and
what a tile is (TileConfig), which the tensor-core kernel (codegen/kernels/gpu/mma_source.py) is
generated for.

`tiles.json` maps "arch dtype NxK" to [[up to rows, tile name], ...] (the last entry for every
larger step). `bench/gemm_gpu.py --write-table` writes it from one run on the GPU machine: each
candidate below is built here, timed there, and the fastest per (shape, rows bucket) kept.
Shapes the table lacks take the first candidates whose tiles divide the shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .shapes import HOPPER_TILE_K, WEIGHT_BITS

TABLE = Path(__file__).with_name("tiles.json")
ELEMENT_BYTES = 2           # bf16 and fp16 activations


def weight_row_stride(weight: str, bk: int) -> int:
    """Bytes between rows of a stored-weight tile in shared memory: float weights are swizzled in
    place; quantised rows are padded by 16 bytes, so the eight rows a fragment load touches fall
    in different banks."""
    return bk * WEIGHT_BITS[weight] // 8 + (0 if weight == "float" else 16)


@dataclass(frozen=True)
class TileConfig:
    """A thread block's tile: BM x BN outputs over BK-wide input tiles, WM x WN warps, STAGES buffers."""
    bm: int
    bn: int
    bk: int
    wm: int
    wn: int
    stages: int

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}w{self.wm}x{self.wn}s{self.stages}"

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    def shared_bytes(self, weight: str = "float") -> int:
        """Shared memory of the pipeline: STAGES x (the x tile + the weight tile as stored)."""
        return self.stages * (self.bm * self.bk * ELEMENT_BYTES + self.bn * weight_row_stride(weight, self.bk))

    def check(self) -> None:
        """Refuse a tile the kernel cannot run (each warp needs whole 16 x 16 fragments)."""
        if self.bk not in (32, 64):
            raise ValueError(f"tile {self.name}: BK must be 32 or 64 (swizzle by 128-byte lines)")
        if self.bm % (16 * self.wm) or self.bn % (16 * self.wn):
            raise ValueError(f"tile {self.name}: each warp needs a multiple of 16 rows and 16 columns")
        if self.stages < 2:
            raise ValueError(f"tile {self.name}: the pipeline needs at least 2 stages")

# rows buckets the table distinguishes (a step with more rows than the last takes the last entry)
ROW_BUCKETS = (16, 64, 256, 1024)


def parse_tile(name: str) -> TileConfig:
    """'128x128x32w2x4s3' -> TileConfig(128, 128, 32, 2, 4, 3)."""
    shape, rest = name.split("w")
    warps, stages = rest.split("s")
    bm, bn, bk = (int(v) for v in shape.split("x"))
    wm, wn = (int(v) for v in warps.split("x"))
    return TileConfig(bm, bn, bk, wm, wn, int(stages))


# every tile a tuning run measures, small-row tiles first (each fits 99 KiB of shared memory)
CANDIDATES = tuple(parse_tile(n) for n in (
    "16x64x64w1x4s4", "32x64x64w1x4s4", "32x128x64w1x4s4", "64x64x64w2x2s4", "64x128x32w2x2s4",
    "64x128x64w2x2s3", "128x64x32w2x2s4", "128x128x32w2x4s3", "128x128x32w2x4s4", "128x256x32w2x4s3",
    "16x32x32w1x2s2"))

# without a table entry: (up to rows, preferred tiles); the first that divides the shape is taken
DEFAULTS = ((64, ("32x64x64w1x4s4", "16x32x32w1x2s2")),
            (0, ("128x128x32w2x4s3", "64x64x64w2x2s4", "16x32x32w1x2s2")))


@cache
def _table() -> dict:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def _fits(tile: TileConfig, n_out: int, n_in: int) -> bool:
    return n_out % tile.bn == 0 and n_in % tile.bk == 0


def tiles_for(arch: str, dtype: str, n_out: int, n_in: int) -> list[tuple[int, TileConfig]] | None:
    """(up to rows, tile) in ascending rows for one linear, or None where no tile divides it."""
    entry = _table().get(f"{arch} {dtype} {n_out}x{n_in}")
    if entry:
        return [(rows, parse_tile(name)) for rows, name in entry]
    chosen = []
    for rows, names in DEFAULTS:
        tile = next((t for t in map(parse_tile, names) if _fits(t, n_out, n_in)), None)
        if tile is None:
            return None
        if not chosen or chosen[-1][1] != tile:
            chosen.append((rows, tile))
    chosen[-1] = (0, chosen[-1][1])
    return chosen


# -- Hopper (sm_90a): CUTLASS's warp-specialised wgmma GEMM (codegen/kernels/gpu/hopper_gemm.cu) ----------
@dataclass(frozen=True)
class HopperTile:
    """A Hopper GEMM's tile. The kernel swaps its operands (the weight is its A), so M runs over the
    linear's outputs and N over the step's rows; clusters of CLUSTER tiles along the outputs share
    the activations' TMA loads. Cooperative: two consumer warp groups split one tile (M >= 128);
    else ping-pong, two tiles in flight."""
    m: int
    n: int
    k: int
    cluster: int = 1
    cooperative: bool = True

    @property
    def name(self) -> str:
        return f"wg{self.m}x{self.n}x{self.k}c{self.cluster}{'' if self.cooperative else 'p'}"


def parse_hopper_tile(name: str) -> HopperTile:
    """'wg128x256x64c2' -> HopperTile(128, 256, 64, 2); a trailing 'p': ping-pong."""
    shape, cluster = name.removeprefix("wg").split("c")
    m, n, k = (int(v) for v in shape.split("x"))
    return HopperTile(m, n, k, int(cluster.removesuffix("p")), not cluster.endswith("p"))


# Without a table entry, steps of up to HOPPER_FROM rows keep the mma tiles (at 64 rows and fewer they
# matched or beat cuBLAS on an H100, docs/BENCHMARKS.md) and larger ones take these (up to rows, tile):
# one tile, as each variant is a minute of nvcc at a cold compile. The table's "arch dtype NxK wgmma"
# entries (bench/gemm_gpu.py --write-table: the fastest of mma's and the Hopper candidates per rows
# bucket) replace both.
HOPPER_FROM = 64
HOPPER_DEFAULTS = ((0, "wg128x128x64c1"),)
HOPPER_CANDIDATES = tuple(parse_hopper_tile(n) for n in (
    "wg128x128x64c1", "wg128x64x64c1", "wg128x128x64c2", "wg128x256x64c2", "wg128x128x64c1p", "wg256x128x64c1"))
assert all(t.k == HOPPER_TILE_K for t in HOPPER_CANDIDATES)      # q4 groups are taken by this K (shapes.py)


def parse_any_tile(name: str) -> TileConfig | HopperTile:
    return parse_hopper_tile(name) if name.startswith("wg") else parse_tile(name)


def hopper_key(arch: str, dtype: str, n_out: int, n_in: int) -> str:
    return f"{arch} {dtype} {n_out}x{n_in} wgmma"


def hopper_tiles(arch: str, dtype: str, n_out: int, n_in: int) -> list[tuple[int, object]] | None:
    """The Hopper GEMM's (up to rows, tile) list for one linear: its table entry, else the mma tiles
    of steps up to HOPPER_FROM rows, then the default Hopper tiles; None where no mma tile divides it
    (the Hopper kernel's few-row steps run mma's)."""
    small = tiles_for(arch, dtype, n_out, n_in)
    if small is None:
        return None
    entry = _table().get(hopper_key(arch, dtype, n_out, n_in))
    if entry:
        return [(rows, parse_any_tile(name)) for rows, name in entry]
    chosen = []
    for rows, tile in small:
        bound = HOPPER_FROM if rows == 0 or rows >= HOPPER_FROM else rows
        if not chosen or chosen[-1][1] != tile:
            chosen.append((bound, tile))
        else:
            chosen[-1] = (bound, tile)
        if bound == HOPPER_FROM:
            break
    return chosen + [(rows, parse_hopper_tile(name)) for rows, name in HOPPER_DEFAULTS]
