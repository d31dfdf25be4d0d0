"""The CUDA LoRA kernel's PrimFunc (y, x, a, b, slots), y written in place: a block per TILE rows of the
step (blockIdx.y), launched from TIR so that it runs on TVM's stream and decode CUDA graphs capture it. The
kernel is CUDA source (lora_source.py)."""
from __future__ import annotations

from tvm import tirx

from .lora_source import THREADS, TILE, lora_name, lora_source, shared_bytes
from .mma_gemm import launch_lines, prim_func


def lora_kernel(n_in: int, rows: tuple[int, ...], rank: int, slots: int, dtype: str) -> tuple[tirx.PrimFunc, str]:
    """The PrimFunc and its kernel's name."""
    n_out, name = sum(rows), lora_name(dtype, n_in, rows, rank, slots)
    params = ["var_y: T.handle", "var_x: T.handle", f"a: T.Buffer(({slots}, {len(rows) * rank}, {n_in}), \"{dtype}\")",
              f"b: T.Buffer(({slots}, {rank}, {n_out}), \"{dtype}\")", "var_slots: T.handle"]
    buffers = [f"y = T.match_buffer(var_y, (m, {n_out}), \"{dtype}\")",
               f"x = T.match_buffer(var_x, (m, {n_in}), \"{dtype}\")",
               "row_slots = T.match_buffer(var_slots, (m,), \"int32\")"]
    pointers = ["y.data", "x.data", "a.data", "b.data", "row_slots.data"]

    def launch(kernel, _config, ptrs, indent):
        return launch_lines(kernel, 1, TILE, THREADS, shared_bytes(rows, rank), ptrs, indent)
    sources = {name: lora_source(dtype, n_in, rows, rank, slots)}
    return prim_func(params, buffers, pointers, [(0, None)], [name], sources, launch), name
