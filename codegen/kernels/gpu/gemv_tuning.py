"""Which decode GEMV (codegen/kernels/gpu/gemv.py) a linear runs: rows a block and threads a block, by shape.

The offline tuning table `gemv_tuning.json` maps "arch format NxK mB" to "rRtT" (B = 1 for batch-1
steps, 8 for the rest; format "float", "q8", "fp8", "q4G"); `bench/gemv_gpu.py run --write-table`
writes it from one run on the GPU machine, where it times each candidate below. Shapes the table
lacks take a heuristic: enough blocks to fill the SMs several times over, and threads enough that
each walks only a few chunks of a row. Pure Python (no TVM): the GPU machine's tests import it.
"""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from kiln.selection.shapes import NIBBLE_FORMATS, inputs_per_chunk

from .gemv_source import GemvConfig

BATCH_BUCKETS = ((1, 1), (4, 4), (0, 8))      # (up to rows, MB): the last for every larger step
MIN_BLOCKS = 528                               # 4 blocks on each of an H100's 132 SMs
CANDIDATE_ROWS, CANDIDATE_THREADS = (1, 2, 4), (128, 256)     # what bench/gemv_gpu.py times


def rows_per_block(n_out: int) -> int:
    """The most rows a block (of 1, 2, 4) that still leaves MIN_BLOCKS blocks."""
    return next((r for r in (4, 2) if n_out % r == 0 and n_out // r >= MIN_BLOCKS), 1)


def threads_for(n_in: int, weight: str) -> int:
    """Threads a block: half a row's 16-byte chunks (64 to 256), so each thread loads 2 to 8
    chunks of each of its block's rows (1 for q4 rows under 1 KiB)."""
    chunks = n_in // inputs_per_chunk(weight)
    return max(64, min(256, chunks // 2 // 32 * 32))


TABLE = Path(__file__).with_name("gemv_tuning.json")


@cache
def _table() -> dict:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def default_configs(n_out: int, n_in: int, weight: str, gated: bool, arch: str | None = None,
                    group_size: int = 0) -> list[tuple[int, GemvConfig]]:
    """(up to rows, config) for each batch bucket: the table's measured winner where it has the
    shape (bf16 and fp16 read the same bytes), else the shape's heuristic choice."""
    form = weight + (str(group_size) if weight in NIBBLE_FORMATS else "")
    configs = []
    for bound, batch in BATCH_BUCKETS:
        measured = _table().get(f"{arch} {form} {n_out}x{n_in} m{1 if batch == 1 else 8}")
        if measured:
            rows, threads = (int(v) for v in measured[1:].split("t"))
        else:
            rows, threads = rows_per_block(n_out), threads_for(n_in, weight)
        rows = max(rows, 2) if gated else rows
        threads = max(threads, -(-rows * batch // 32) * 32)        # a thread for each of the block's sums
        configs.append((bound, GemvConfig(rows, threads, batch)))
    return configs
