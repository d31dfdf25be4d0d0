"""The tensor-core kernel's own source (codegen/kernels/gpu/mma_source.py) compiled for the CPU with g++ and run
there, its PTX primitives emulated as the PTX ISA specifies them (tests/mma_emulator.h), against
NumPy's float32 product with the same epilogue: every format, tiles of both input widths and of 2,
3 and 4 stages, ragged row counts, bias and residual, and the experts' grouped form. What this
cannot see (timing, bank conflicts, the real instructions' behaviour) tests/gpu/test_mma_gemm.py
checks on a GPU."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

# builds kiln's CUDA kernels for the CPU emulator (g++) and runs them: the build tier, not make test-fast
pytestmark = [pytest.mark.build, pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")]

EMULATOR = Path(__file__).with_name("mma_emulator.h")
N, K, EXPERTS = 128, 256, 3
TILES = ("16x64x64w1x4s4", "64x128x32w2x2s4", "128x128x32w2x4s3", "16x32x32w1x2s2")
# (dtype, weight format, q4 group, bias + residual, tile)
CASES = [("bfloat16", "float", 0, True, t) for t in TILES] + [
    ("float16", "float", 0, False, TILES[1]), ("float16", "q8", 0, True, TILES[0]), ("bfloat16", "q8", 0, False, TILES[2]),
    ("bfloat16", "fp8", 0, True, TILES[1]), ("float16", "fp8", 0, False, TILES[0]),
    ("float16", "q4", 32, True, TILES[2]), ("bfloat16", "q4", 128, False, TILES[1]),
    ("float16", "q4", 128, True, TILES[3]),
    ("float16", "q4a", 32, True, TILES[2]), ("bfloat16", "q4a", 128, False, TILES[0]),
    ("bfloat16", "q4k", 32, True, TILES[1]), ("float16", "q4k", 32, False, TILES[3])]
# (dtype, weight format, q4 group, gathered rows (else weighted), tile)
EXPERT_CASES = [("bfloat16", "float", 0, True, TILES[0]), ("float16", "q8", 0, False, TILES[1]),
                ("bfloat16", "fp8", 0, True, TILES[2]), ("float16", "q4", 32, False, TILES[0])]
# a gated MLP's gate/up linear with its activation in the epilogue (weights stored 'gated'):
# (dtype, weight format, q4 group, activation, tile)
GATED_CASES = [("bfloat16", "float", 0, "silu", TILES[0]), ("float16", "q4", 32, "gelu_tanh", TILES[2]),
               ("bfloat16", "q4k", 32, "silu", TILES[2]),
               ("bfloat16", "fp8", 0, "silu", TILES[1])]
ROWS = (1, 17, 100)
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3}
NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def case_name(index: int, experts: bool) -> str:
    return f"{'experts' if experts else 'linear'}_{index}"


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """Every case's kernel and a C entry point that launches it over the emulated grid."""
    from kiln.codegen.kernels.gpu.mma_source import KERNEL_TEMPLATES, experts_kernel_source, kernel_source
    from kiln.selection.tiles import parse_tile
    parts = ['#include "mma_emulator.h"', "namespace kiln_mma {", KERNEL_TEMPLATES, "}"]
    for index, (dtype, weight, group, epilogue, tile_name) in enumerate(CASES):
        tile, name = parse_tile(tile_name), case_name(index, False)
        source = kernel_source(name, dtype, tile, N, K, epilogue, epilogue, weight, group)
        parts.append(source[source.index(f"\n__device__ __forceinline__ void {name}("):])
        args = ["x", "w"] + (["scale"] if weight != "float" else []) + (["bias", "residual"] if epilogue else []) + ["y"]
        parts.append(_entry(name, args, tile, weight))
    for index, (dtype, weight, group, gather, tile_name) in enumerate(EXPERT_CASES):
        tile, name = parse_tile(tile_name), case_name(index, True)
        source = experts_kernel_source(name, dtype, tile, N, K, weight, group, gather, not gather)
        parts.append(source[source.index(f"\n__device__ __forceinline__ void {name}("):])
        args = ["x"] + (["row_token"] if gather else []) + ["row_expert", "w"] \
            + (["scale"] if weight != "float" else []) + ([] if gather else ["row_weight"]) + ["y"]
        parts.append(_entry(name, args, tile, weight))
    for index, (dtype, weight, group, activation, tile_name) in enumerate(GATED_CASES):
        tile, name = parse_tile(tile_name), f"gated_{index}"
        source = kernel_source(name, dtype, tile, N, K, False, False, weight, group, activation)
        parts.append(source[source.index(f"\n__device__ __forceinline__ void {name}("):])
        parts.append(_entry(name, ["x", "w"] + (["scale"] if weight != "float" else []) + ["y"], tile, weight))
    return compile_emulated(parts, tmp_path_factory.mktemp("mma-emulated"))


def compile_emulated(parts: list[str], folder: Path) -> ctypes.CDLL:
    """The cases' C++ (kernels over tests/mma_emulator.h and their entry points), built with g++."""
    (folder / "cases.cpp").write_text("\n".join(parts))
    shutil.copy(EMULATOR, folder)
    compiled = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                               "-o", str(folder / "cases.so"), str(folder / "cases.cpp")], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    return ctypes.CDLL(str(folder / "cases.so"))


def _entry(name: str, args: list[str], tile, weight: str) -> str:
    params = ", ".join(f"void* {a}" for a in args)
    return (f'extern "C" void run_{name}({params}, int M) {{\n'
            f"  launch({N // tile.bn}, (M + {tile.bm - 1}) / {tile.bm}, {tile.threads}, {tile.shared_bytes(weight)}, "
            f"[&] {{ {name}({', '.join(args)}, M, block->shared.data()); }});\n}}\n")


def stored(rng, weight: str, group: int, shape: tuple[int, int]):
    """(the kernel's weight arrays, W's float32 values, per-output scale or None)."""
    n, k = shape
    if weight == "q8":
        levels = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
        scale = (rng.random(n) * 0.01 + 1e-3).astype(np.float32)
        return [levels, scale], levels.astype(np.float32), scale
    if weight == "fp8":
        values = (rng.standard_normal((n, k)) * 4).astype(ml_dtypes.float8_e4m3fn)
        scale = (rng.random(n) * 0.01 + 1e-3).astype(np.float32)
        return [values.view(np.uint8), scale], values.astype(np.float32), scale
    nibbles = rng.integers(0, 16, size=(n, k)).astype(np.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)         # input k in byte k / 2, odd k high
    if weight == "q4k":            # 6-bit scales and depths, float16 factors per super-block of 256
        from kiln.ir.quant import q4k_scale_table
        d = (rng.random((n, k // 256)) * 3e-4 + 1e-5).astype(np.float16)
        negative_dmin = (-rng.random((n, k // 256)) * 2e-3).astype(np.float16)
        sub, depth = (rng.integers(0, 64, (n, k // 256, 8)) for _ in range(2))
        scale = (d.astype(np.float32)[..., None] * sub).reshape(n, -1)
        minimum = (negative_dmin.astype(np.float32)[..., None] * depth).reshape(n, -1)
        table = q4k_scale_table(d, negative_dmin, sub, depth)
    else:
        scale = (rng.random((n, k // group)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
        minimum = (-scale * rng.uniform(6, 9, scale.shape)).astype(np.float16).astype(np.float32)
        table = np.ascontiguousarray(scale.T.astype(np.float16))
        if weight == "q4a":        # group g's scale in row 2g, its minimum in 2g + 1
            table = np.empty((2 * (k // group), n), np.float16)
            table[0::2], table[1::2] = scale.T, minimum.T
    levels = nibbles.astype(np.float32) - (8 if weight == "q4" else 0)
    values = levels * np.repeat(scale, group, axis=1)
    if weight != "q4":
        values = values + np.repeat(minimum, group, axis=1)
    return [packed, table], values, None


def expected(x, values, scale, bias, residual, dtype):
    """codegen/kernels/weight_format.py's epilogue: float32 sum, * scale, + bias, round, + residual, round."""
    y = x.astype(np.float32) @ values.T
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias.astype(np.float32)
    y = y.astype(NUMPY[dtype])
    return y if residual is None else (y.astype(np.float32) + residual.astype(np.float32)).astype(NUMPY[dtype])


def pointer(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def check(got, want, dtype, what):
    got, want = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(got).all(), f"{what}: rows left unwritten"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOLERANCE[dtype], f"{what}: max error {err:.2e} of the largest output"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-{c[1]}{c[2] or ''}-{c[4]}" + ("-epilogue" if c[3]
                                                                                                    else "") for c in CASES])
def test_emulated_kernel_matches_numpy(library, index):
    dtype, weight, group, epilogue, tile = CASES[index]
    rng = np.random.default_rng(index)
    if weight == "float":
        w = (rng.standard_normal((N, K)) * 0.05).astype(NUMPY[dtype])
        weights, values, scale = [w], w.astype(np.float32), None
    else:
        weights, values, scale = stored(rng, weight, group, (N, K))
    bias = rng.standard_normal(N).astype(NUMPY[dtype]) if epilogue else None
    for m in ROWS:
        x = rng.standard_normal((m, K)).astype(NUMPY[dtype])
        residual = rng.standard_normal((m, N)).astype(NUMPY[dtype]) if epilogue else None
        y = np.full((m, N), np.nan, dtype=NUMPY[dtype])
        arrays = [x, *weights, *[a for a in (bias, residual) if a is not None], y]
        getattr(library, f"run_{case_name(index, False)}")(*map(pointer, arrays), ctypes.c_int(m))
        check(y, expected(x, values, scale, bias, residual, dtype), dtype, f"{CASES[index]} at M={m}")


@pytest.mark.parametrize("index", range(len(EXPERT_CASES)),
                         ids=[f"{c[0]}-{c[1]}{c[2] or ''}-{c[4]}-{'gather' if c[3] else 'weighted'}"
                              for c in EXPERT_CASES])
def test_emulated_experts_kernel_matches_numpy(library, index):
    """Rows sorted by expert, one expert absent, blocks whose rows span experts."""
    dtype, weight, group, gather, tile = EXPERT_CASES[index]
    rng = np.random.default_rng(100 + index)
    if weight == "float":
        ws = [(rng.standard_normal((N, K)) * 0.05).astype(NUMPY[dtype]) for _ in range(EXPERTS)]
        weights, values, scales = [np.stack(ws)], [w.astype(np.float32) for w in ws], [None] * EXPERTS
    else:
        per = [stored(rng, weight, group, (N, K)) for _ in range(EXPERTS)]
        weights = [np.ascontiguousarray(np.stack([p[0][i] for p in per])) for i in range(2)]
        values, scales = [p[1] for p in per], [p[2] for p in per]
    for m in ROWS:
        row_expert = np.sort(rng.choice([0, 2], size=m)).astype(np.int32)      # expert 1 routed nothing
        tokens = max(1, m // 2)
        row_token = rng.integers(0, tokens, size=m).astype(np.int32)
        row_weight = rng.random(m).astype(np.float32)
        x = rng.standard_normal((tokens if gather else m, K)).astype(NUMPY[dtype])
        y = np.full((m, N), np.nan, dtype=NUMPY[dtype])
        arrays = [x] + ([row_token] if gather else []) + [row_expert, *weights] + ([] if gather else [row_weight]) + [y]
        getattr(library, f"run_{case_name(index, True)}")(*map(pointer, arrays), ctypes.c_int(m))
        rows = x[row_token] if gather else x
        want = np.empty((m, N), dtype=NUMPY[dtype])
        for e in range(EXPERTS):
            mine = row_expert == e
            out = expected(rows[mine], values[e], scales[e], None, None, dtype)
            if not gather:
                out = (out.astype(np.float32) * row_weight[mine, None]).astype(NUMPY[dtype])
            want[mine] = out
        check(y, want, dtype, f"{EXPERT_CASES[index]} at M={m}")


ACTIVATIONS = {"silu": lambda g: g / (1 + np.exp(-g)),
               "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}


@pytest.mark.parametrize("index", range(len(GATED_CASES)), ids=[f"{c[0]}-{c[1]}{c[2] or ''}-{c[3]}-{c[4]}"
                                                                 for c in GATED_CASES])
def test_emulated_gated_kernel_matches_the_gated_op(library, index):
    """Weights stored 'gated' (gate and up rows interleaved, selection/layouts.py); the output is
    act(gate) * up, rounded as ir/ops.py's swiglu / geglu round it, half as wide."""
    from kiln.selection.layouts import GATED, GATED_COLUMNS, apply_layout
    dtype, weight, group, activation, tile = GATED_CASES[index]
    rng = np.random.default_rng(200 + index)
    if weight == "float":
        w = (rng.standard_normal((N, K)) * 0.05).astype(NUMPY[dtype])
        weights, values, scale = [w], w.astype(np.float32), None
    else:
        weights, values, scale = stored(rng, weight, group, (N, K))
    stored_weights = [apply_layout(GATED, weights[0])] + [apply_layout(GATED_COLUMNS, a) for a in weights[1:]]
    for m in ROWS:
        x = rng.standard_normal((m, K)).astype(NUMPY[dtype])
        y = np.full((m, N // 2), np.nan, dtype=NUMPY[dtype])
        getattr(library, f"run_gated_{index}")(*map(pointer, [x, *stored_weights, y]), ctypes.c_int(m))
        full = expected(x, values, scale, None, None, dtype).astype(np.float32)       # [m, N]: gate | up
        gate, up = full[:, :N // 2], full[:, N // 2:]
        act = ACTIVATIONS[activation](gate).astype(NUMPY[dtype]).astype(np.float32)
        check(y, (act * up).astype(NUMPY[dtype]), dtype, f"{GATED_CASES[index]} at M={m}")
