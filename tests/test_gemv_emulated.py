"""The decode GEMV's own source (codegen/kernels/gpu/gemv_source.py) compiled for the CPU with g++ and run
over tests/mma_emulator.h's threads (its one PTX load read plainly), against NumPy's float32
product with codegen/kernels/weight_format.py's epilogue: every weight format, both activation types, 1 to 8 rows
a block, 32 to 256 threads, batches of x that do not fill the last pass, bias and residual, and the
gated MLP's act(gate) * up. tests/gpu/test_gemv.py runs the built kernels on a GPU."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from test_mma_emulated import ACTIVATIONS, NUMPY, check, compile_emulated, expected, pointer, stored

# builds kiln's CUDA kernels for the CPU emulator (g++) and runs them: the build tier, not make test-fast
pytestmark = [pytest.mark.build, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")]

N, K = 64, 512
# (dtype, weight format, q4 group, bias + residual, activation, (rows a block, threads, batch))
CASES = [("bfloat16", "float", 0, True, None, (4, 64, 1)), ("float16", "float", 0, False, None, (1, 32, 4)),
         ("bfloat16", "float", 0, False, None, (4, 128, 8)), ("bfloat16", "q8", 0, True, None, (2, 64, 4)),
         ("float16", "q8", 0, False, None, (4, 128, 1)), ("bfloat16", "fp8", 0, False, None, (2, 32, 8)),
         ("float16", "fp8", 0, True, None, (1, 64, 1)), ("float16", "q4", 32, True, None, (4, 32, 4)),
         ("bfloat16", "q4", 128, False, None, (2, 64, 1)), ("bfloat16", "q4", 64, False, None, (8, 64, 8)),
         ("bfloat16", "float", 0, False, "silu", (2, 64, 1)), ("float16", "q4", 32, False, "gelu_tanh", (4, 32, 4)),
         ("bfloat16", "fp8", 0, False, "silu", (8, 64, 8)), ("float16", "q4a", 32, True, None, (4, 32, 4)),
         ("bfloat16", "q4a", 128, False, None, (2, 64, 1)), ("bfloat16", "q4k", 32, True, None, (4, 64, 8)),
         ("float16", "q4k", 32, False, "silu", (2, 32, 1))]
ROWS = (1, 3, 9)
# a GEMV sums in another order than NumPy: float32 differences, then one rounding to the dtype
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3}

GEMV_EMULATED = """
namespace kiln_gemv {
inline uint4 load_stream(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
"""


def case_id(case) -> str:
    dtype, weight, group, epilogue, activation, config = case
    return f"{dtype}-{weight}{group or ''}-r{config[0]}t{config[1]}b{config[2]}" + ("-epilogue" if epilogue else "") \
        + (f"-{activation}" if activation else "")


@pytest.fixture(scope="module")
def gemv_library(tmp_path_factory):
    from kiln.codegen.kernels.gpu.gemv_source import GEMV_TEMPLATE, GemvConfig, gemv_source
    from kiln.codegen.kernels.gpu.mma_source import KERNEL_TEMPLATES
    parts = ['#include "mma_emulator.h"', "namespace kiln_mma {", KERNEL_TEMPLATES, "}",
             GEMV_EMULATED, GEMV_TEMPLATE, "}"]
    for index, (dtype, weight, group, epilogue, activation, shape) in enumerate(CASES):
        config, name = GemvConfig(*shape), f"gemv_{index}"
        source = gemv_source(name, dtype, config, N, K, epilogue, epilogue, weight, group, activation)
        parts.append(source[source.index(f"\n__device__ __forceinline__ void {name}("):])
        args = ["x", "w"] + (["scale"] if weight != "float" else []) + (["bias", "residual"] if epilogue else []) + ["y"]
        params = ", ".join(f"void* {a}" for a in args)
        parts.append(f'extern "C" void run_{name}({params}, int M) {{\n'
                     f"  launch({N // config.rows}, 1, {config.threads}, {config.shared_bytes()}, "
                     f"[&] {{ {name}({', '.join(args)}, M, block->shared.data()); }});\n}}\n")
    return compile_emulated(parts, tmp_path_factory.mktemp("gemv-emulated"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_emulated_gemv_matches_numpy(gemv_library, index):
    from kiln.selection.layouts import GATED, GATED_COLUMNS, apply_layout
    dtype, weight, group, epilogue, activation, _ = CASES[index]
    rng = np.random.default_rng(300 + index)
    if weight == "float":
        w = (rng.standard_normal((N, K)) * 0.05).astype(NUMPY[dtype])
        weights, values, scale = [w], w.astype(np.float32), None
    else:
        weights, values, scale = stored(rng, weight, group, (N, K))
    if activation:          # stored 'gated': gate and up rows interleaved
        weights = [apply_layout(GATED, weights[0])] + [apply_layout(GATED_COLUMNS, a) for a in weights[1:]]
    bias = rng.standard_normal(N).astype(NUMPY[dtype]) if epilogue else None
    for m in ROWS:
        x = rng.standard_normal((m, K)).astype(NUMPY[dtype])
        residual = rng.standard_normal((m, N)).astype(NUMPY[dtype]) if epilogue else None
        y = np.full((m, N // 2 if activation else N), np.nan, dtype=NUMPY[dtype])
        arrays = [x, *weights, *[a for a in (bias, residual) if a is not None], y]
        getattr(gemv_library, f"run_gemv_{index}")(*map(pointer, arrays), ctypes.c_int(m))
        want = expected(x, values, scale, bias, residual, dtype)
        if activation:
            full = want.astype(np.float32)
            gate, up = full[:, :N // 2], full[:, N // 2:]
            act = ACTIVATIONS[activation](gate).astype(NUMPY[dtype]).astype(np.float32)
            want = (act * up).astype(NUMPY[dtype])
        check(y, want, dtype, f"{CASES[index]} at M={m}")


def test_tuning_table_names_candidates_the_bench_builds():
    """Each entry of codegen/kernels/gpu/gemv_tuning.json is one of the candidates bench/gemv_gpu.py times, and
    every configuration the compiler takes from it (gated ones included) is one the kernel accepts."""
    from kiln.codegen.kernels.gpu.gemv_tuning import CANDIDATE_ROWS, CANDIDATE_THREADS, _table, default_configs
    for key, name in _table().items():
        arch, form, shape, batch = key.split()
        rows, threads = (int(v) for v in name[1:].split("t"))
        assert rows in CANDIDATE_ROWS and threads in CANDIDATE_THREADS, key
        n, k = (int(v) for v in shape.split("x"))
        weight, group = ("q4", int(form[2:])) if form.startswith("q4") else (form, 0)
        for gated in (False, True):
            for _, config in default_configs(n, k, weight, gated, arch, group):
                config.check()
                assert n % config.rows == 0 and (not gated or config.rows % 2 == 0), (key, config)
