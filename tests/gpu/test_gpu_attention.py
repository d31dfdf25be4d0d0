"""kiln's GPU paged attention (codegen/kernels/gpu/attention_source.py) on the GPU: each case of
tests/attention_cases.py compiled (CuPy, with nvcc where it is installed) and run against the
`paged_attention` op's reference (ir/kv_ops.py) on the same pages; the quantising append's pages and
scales must equal the reference's exactly. The emulated test runs the same cases on the CPU."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_cases import CASES, PAGE, SCALE, case_id, check, numpy_dtype, random_step, reference, shape_of  # noqa: E402

cupy = pytest.importorskip("cupy", reason="CuPy (the GPU extra) is not installed")


def module(case):
    """The case's kernels behind __global__ entry points: run_attention, run_merge, run_append."""
    from kiln.codegen.kernels.gpu.attention_source import append_source, attention_source
    shape, (window, cap, splits) = shape_of(case), case[5:]
    quantized = shape.kv_code != 0
    params = ["const void* q", "const void* pages"] + (["const void* scales"] if quantized else []) + [
        "const void* q_indptr", "const void* page_indptr", "const void* page_values", "const void* last_page_len",
        "void* out"] + (["void* partial", "void* lse"] if splits > 1 else [])
    names = [p.split()[-1].lstrip("*") for p in params]
    source = attention_source("attention", shape, splits, SCALE, cap, window)
    source += (f'extern "C" __global__ void run_attention({", ".join(params)}, int seqs) {{\n'
               f"  extern __shared__ float shared[];\n  attention({', '.join(names)}, seqs, shared);\n}}\n")
    if splits > 1:
        source += ('extern "C" __global__ void run_merge(const void* partial, const void* lse, void* out) {\n'
                   "  attention_merge(partial, lse, out);\n}\n")
    if quantized:
        source += append_source("append", shape)
        source += ('extern "C" __global__ void run_append(void* pages, void* scales, const void* k, const void* v, '
                   "const void* slots) {\n  append(pages, scales, k, v, slots);\n}\n")
    backend = "nvcc" if shutil.which("nvcc") else "nvrtc"
    return cupy.RawModule(code=source, options=("-std=c++17",), backend=backend)


def device(a: np.ndarray):
    """`a` on the GPU, 16-bit and 8-bit floats as their bits (CuPy has no bfloat16 or float8)."""
    bits = {2: np.uint16, 1: np.uint8}.get(a.dtype.itemsize) if a.dtype.kind == "V" or a.dtype.name in (
        "bfloat16", "float8_e4m3fn") else None
    return cupy.asarray(a.view(bits) if bits else a)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_gpu_attention_matches_the_reference(index):
    case = CASES[index]
    dtype, hq, d, splits = case[0], case[2], case[4], case[7]
    shape = shape_of(case)
    inputs, pages, scales, q, k, v = random_step(500 + index, case)
    want, want_pages, want_scales = reference(case, inputs, pages, scales, q, k, v)
    tokens, seqs, slots = len(q), len(inputs["q_indptr"]) - 1, inputs["slot_mapping"]
    kernels = module(case)
    if scales is None:                      # TVM's append runs before the kernel: written here
        pages = pages.copy()
        pages[slots // PAGE, 0, :, slots % PAGE] = k
        pages[slots // PAGE, 1, :, slots % PAGE] = v
        pages_gpu, scales_gpu = device(pages), None
    else:
        pages_gpu, scales_gpu = device(pages), cupy.asarray(scales)
        kernels.get_function("run_append")((tokens, shape.kv_heads, 2), (32,),
                                           (pages_gpu, scales_gpu, device(k), device(v), cupy.asarray(slots)))
        assert np.array_equal(scales_gpu.get(), want_scales), "the append's row scales differ from the reference's"
        # codes as bytes: int8 pages come back as int8, e4m3 ones as their bits
        assert np.array_equal(pages_gpu.get().view(np.uint8), want_pages.view(np.uint8)), "the append's codes differ"
    # NaN where the kernel writes nothing: as bits for bfloat16, which CuPy holds as uint16
    out = cupy.full(q.shape, 0xFFFF if device(q).dtype == np.uint16 else np.nan, device(q).dtype)
    table = [cupy.asarray(inputs[n]) for n in ("q_indptr", "page_indptr", "page_values", "last_page_len")]
    args = [device(q), pages_gpu] + ([scales_gpu] if scales_gpu is not None else []) + table + [out]
    if splits > 1:
        args += [cupy.full((tokens, hq, splits, d), np.nan, np.float32), cupy.full((tokens, hq, splits), np.nan, np.float32)]
    kernels.get_function("run_attention")((tokens, shape.kv_heads, splits), (128,), (*args, np.int32(seqs)),
                                          shared_mem=shape.shared_bytes())
    if splits > 1:
        kernels.get_function("run_merge")((tokens, hq), (32,), (args[-2], args[-1], out))
    got = out.get()
    check(got.view(numpy_dtype(dtype)) if got.dtype != numpy_dtype(dtype) else got, want, dtype)
