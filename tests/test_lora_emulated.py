"""The CUDA LoRA kernel's own source (codegen/kernels/gpu/lora_source.py) compiled for the CPU with g++ and run
over tests/mma_emulator.h's threads, against the interpreter's lora op (ir/lora_ops.py) on the same arrays:
one, two and three modules a projection, bf16 and fp16, rows on no adapter and rows sharing one (runs the
block takes together), a step of one row and of many. tests/gpu/test_lora.py runs the built kernel on a GPU."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from test_mma_emulated import NUMPY, compile_emulated, pointer

pytestmark = [pytest.mark.build, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")]

SLOTS = 3
# (dtype, inputs, the modules' output columns, rank)
CASES = [("bfloat16", 256, (256, 64, 64), 8), ("float16", 128, (96,), 16), ("bfloat16", 64, (128, 128), 4)]
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3}


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    from kiln.codegen.kernels.gpu.lora_source import THREADS, TILE, lora_name, lora_source, shared_bytes
    parts = ['#include "mma_emulator.h"']
    for index, (dtype, n_in, rows, rank) in enumerate(CASES):
        source = lora_source(dtype, n_in, rows, rank, SLOTS)
        if index:                                          # the template once: its guard is for nvcc's one file
            source = source[source.index("\n__device__ __forceinline__ void kiln_lora_"):]
        parts.append(source.replace("#include <cuda_bf16.h>", "").replace("#include <cuda_fp16.h>", ""))
        name = lora_name(dtype, n_in, rows, rank, SLOTS)
        parts.append(f'extern "C" void run_{index}(void* y, void* x, void* a, void* b, void* slots, int M) {{\n'
                     f"  launch(1, (M + {TILE - 1}) / {TILE}, {THREADS}, {shared_bytes(rows, rank)}, "
                     f"[&] {{ {name}(y, x, a, b, slots, M, block->shared.data()); }});\n}}\n")
    return compile_emulated(parts, tmp_path_factory.mktemp("lora-emulated"))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_emulated_lora_matches_the_interpreter(library, index):
    from kiln.ir import GraphBuilder, interpret
    dtype, n_in, rows, rank = CASES[index]
    n_out, rng = sum(rows), np.random.default_rng(50 + index)
    a = (rng.standard_normal((SLOTS, len(rows) * rank, n_in)) / np.sqrt(n_in)).astype(NUMPY[dtype])
    b = (rng.standard_normal((SLOTS, rank, n_out)) * 0.5).astype(NUMPY[dtype])
    # one row; rows on mixed slots (runs of one); a prompt's rows (runs across a block's 4 and past M's end)
    for slots in ([1], [2, -1, 0, 2, 2, -1, 1], [0] * 6 + [2] * 5 + [-1] * 2 + [1] * 3):
        m = len(slots)
        x = rng.standard_normal((m, n_in)).astype(NUMPY[dtype])
        y = rng.standard_normal((m, n_out)).astype(NUMPY[dtype])
        row_slots = np.array(slots, np.int32)
        g = GraphBuilder("lora")
        inputs = [g.input(n, s, d) for n, s, d in (("y", ("tokens", n_out), dtype), ("x", ("tokens", n_in), dtype),
                                                  ("a", a.shape, dtype), ("b", b.shape, dtype),
                                                  ("slots", ("tokens",), "int32"))]
        graph = g.output(g.op("lora", *inputs, name="out", modules=tuple(f"m{j}" for j in range(len(rows))),
                              rows=rows, rank=rank))
        want = interpret(graph, {"y": y, "x": x, "a": a, "b": b, "slots": row_slots}, lambda _: None)["out"]
        got = y.copy()
        getattr(library, f"run_{index}")(*map(pointer, (got, x, a, b, row_slots)), ctypes.c_int(m))
        base = row_slots < 0
        assert (got[base] == y[base]).all()                          # rows on no adapter untouched
        err = np.abs(got.astype(np.float32) - want.astype(np.float32)).max() / np.abs(want.astype(np.float32)).max()
        assert err < TOLERANCE[dtype] and np.abs(got.astype(np.float32) - y.astype(np.float32))[~base].max() > 0.1
