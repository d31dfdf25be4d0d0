"""kiln's GPU paged attention (codegen/kernels/gpu/attention_source.py) compiled for the CPU with g++ and run
over tests/mma_emulator.h's threads, against the `paged_attention` op's reference (ir/kv_ops.py) on
the same pages, over tests/attention_cases.py's cases; the quantising append's pages and scales
must equal the reference's exactly. tests/gpu/test_gpu_attention.py runs the same cases on a GPU."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from attention_cases import CASES, PAGE, SCALE, case_id, check, numpy_dtype, random_step, reference, shape_of
from test_mma_emulated import compile_emulated, pointer

# builds kiln's CUDA kernels for the CPU emulator (g++) and runs them: the build tier, not make test-fast
pytestmark = [pytest.mark.build, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    from kiln.codegen.kernels.gpu.attention_source import NAMESPACE, WARPS, append_source, attention_source
    parts = ['#include "mma_emulator.h"', NAMESPACE]
    for index, case in enumerate(CASES):
        shape, (window, cap, splits) = shape_of(case), case[5:]
        assert shape.problem() is None
        name = f"attention_{index}"
        source = attention_source(name, shape, splits, SCALE, cap, window)
        parts.append(source[source.index(f"\n#ifndef {name.upper()}"):])
        quantized = shape.kv_code != 0
        args = ["q", "pages"] + (["scales"] if quantized else []) + ["q_indptr", "page_indptr", "page_values",
                                                                     "last_page_len", "out"]
        args += ["partial", "lse"] if splits > 1 else []
        body = (f"  launch_grid(tokens, {shape.kv_heads}, {splits}, {32 * WARPS}, {shape.shared_bytes()}, "
                f"[&] {{ {name}({', '.join(args)}, seqs, block->shared.data()); }});\n")
        if splits > 1:
            body += f"  launch_grid(tokens, {shape.q_heads}, 1, 32, 0, [&] {{ {name}_merge(partial, lse, out); }});\n"
        parts.append(f'extern "C" void run_{name}({", ".join(f"void* {a}" for a in args)}, int tokens, int seqs) {{\n'
                     f"{body}}}\n")
        if quantized:
            source = append_source(f"append_{index}", shape)
            parts.append(source[source.index(f"\n#ifndef APPEND_{index}"):])
            parts.append(f'extern "C" void run_append_{index}(void* pages, void* scales, void* k, void* v, '
                         f"void* slots, int tokens) {{\n  launch_grid(tokens, {shape.kv_heads}, 2, 32, 0, "
                         f"[&] {{ append_{index}(pages, scales, k, v, slots); }});\n}}\n")
    return compile_emulated(parts, tmp_path_factory.mktemp("gpu-attention-emulated"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_emulated_attention_matches_the_reference(library, index):
    case = CASES[index]
    dtype, hq, d, splits = case[0], case[2], case[4], case[7]
    inputs, pages, scales, q, k, v = random_step(500 + index, case)
    want, want_pages, want_scales = reference(case, inputs, pages, scales, q, k, v)
    tokens, seqs, slots = len(q), len(inputs["q_indptr"]) - 1, inputs["slot_mapping"]
    pages, scales = pages.copy(), None if scales is None else scales.copy()
    if scales is None:                      # TVM's append runs before the kernel: written here
        pages[slots // PAGE, 0, :, slots % PAGE] = k
        pages[slots // PAGE, 1, :, slots % PAGE] = v
    else:
        getattr(library, f"run_append_{index}")(pointer(pages), pointer(scales), pointer(k), pointer(v),
                                                pointer(slots), ctypes.c_int(tokens))
        assert np.array_equal(scales, want_scales), "the append's row scales differ from the reference's"
        assert np.array_equal(pages.view(np.uint8), want_pages.view(np.uint8)), "the append's codes differ"
    out = np.full(q.shape, np.nan, numpy_dtype(dtype))
    table = [inputs[n] for n in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
    args = [q, pages] + ([scales] if scales is not None else []) + table + [out]
    if splits > 1:
        args += [np.full((tokens, hq, splits, d), np.nan, np.float32), np.full((tokens, hq, splits), np.nan, np.float32)]
    getattr(library, f"run_attention_{index}")(*map(pointer, args), ctypes.c_int(tokens), ctypes.c_int(seqs))
    check(out, want, dtype)
