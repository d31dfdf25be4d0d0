"""Every tensor-core tile builds (TVM and nvcc for sm_90; ptxas for sm_80, sm_89 and sm_90 over the
same source) with tensor-core instructions in its machine code, wide asynchronous copies,
ldmatrix, and no register spills; the tuning table names only tiles that are built here.
(Running them needs a GPU: tests/gpu/test_mma_gemm.py; their logic runs emulated in
tests/test_mma_emulated.py.)"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.build,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")]


def nvdisasm() -> str | None:
    try:
        import nvidia
        found = [p / "cu13" / "bin" / "nvdisasm" for p in map(Path, nvidia.__path__)]
    except ImportError:
        found = []
    return next((str(p) for p in found if p.exists()), shutil.which("nvdisasm"))


def test_tuning_table_names_built_tiles():
    """The committed table's tiles and the defaults' are among the candidates the test below builds
    (before a GPU run writes the table, the defaults alone)."""
    from kiln.selection.tiles import CANDIDATES, DEFAULTS, HOPPER_CANDIDATES, _table, parse_any_tile, parse_tile
    assert all(parse_tile(name) in CANDIDATES for _, names in DEFAULTS for name in names)
    for key, entry in _table().items():
        assert [rows for rows, _ in entry][-1] == 0, f"{key}: the last tile must take every larger step"
        for _, name in entry:       # mma's tiles; a wgmma entry's Hopper tiles too (built by bench/gemm_gpu.py)
            built = CANDIDATES + (HOPPER_CANDIDATES if key.endswith(" wgmma") else ())
            assert parse_any_tile(name) in built, f"{key}: {name} is not a candidate this test builds"


def test_each_rows_bucket_launches_its_own_tile_over_its_own_grid():
    """A table entry may name one tile for two buckets apart (the 1B's 2048x2048: A, B, A, C): each
    bucket's branch launches the kernel of its tile, over N / BN blocks of that tile. (Kernels were
    once paired with buckets by position among the distinct tiles: the third bucket launched C's
    kernel over A's grid, and an H200 faulted on an illegal address.)"""
    from kiln.codegen.kernels.gpu.mma_gemm import mma_linear_kernel
    from kiln.selection.tiles import parse_tile
    tiles = [(16, parse_tile("32x64x64w1x4s4")), (64, parse_tile("16x64x64w1x4s4")),
             (256, parse_tile("32x64x64w1x4s4")), (0, parse_tile("64x128x64w2x2s3"))]
    func, names = mma_linear_kernel(2048, 2048, "bfloat16", False, False, tiles)
    assert len(names) == 3
    script = func.script()
    grids = [int(g) for g in re.findall(r'launch_thread\("blockIdx.x", (\d+)\)', script)]
    launched = re.findall(r'func_call\("(kiln_mma_[^"]+)"', script)
    assert len(launched) == len(tiles) == len(grids)
    for (_, tile), name, grid in zip(tiles, launched, grids):
        assert name.endswith(tile.name) and grid == 2048 // tile.bn, (name, grid, tile.name)


def test_default_choices_are_candidates_for_the_llama_shapes():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gemm_gpu import SHAPES

    from kiln.selection.tiles import CANDIDATES, tiles_for
    for n, k in [s for group in SHAPES.values() for s in group]:
        tiles = tiles_for("sm_90", "bfloat16", n, k)
        assert tiles and all(t in CANDIDATES for _, t in tiles), (n, k, tiles)
        assert tiles[-1][0] == 0 and [r for r, _ in tiles[:-1]] == sorted(r for r, _ in tiles[:-1])


@pytest.fixture(scope="module")
def cuda_source(tmp_path_factory):
    """source(arch) -> (the CUDA source TVM generated for every tile, the kernels' names). TVM
    builds it for sm_80 (no fp8) and sm_90; sm_89 compiles sm_90's source (the same fp8 headers)."""
    built = {}

    def source(arch: str):
        base = "sm_80" if arch == "sm_80" else "sm_90"
        if base not in built:
            folder = tmp_path_factory.mktemp(f"mma-build-{base}")
            script = Path(__file__).with_name("build_mma.py")
            out = subprocess.run([sys.executable, str(script), base, str(folder)], capture_output=True, text=True)
            assert out.returncode == 0, out.stderr[-3000:]
            built[base] = folder / "kernels.cu", out.stdout.split()
        return built[base]
    return source


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_every_tile_builds_with_tensor_core_instructions(arch, cuda_source, tmp_path):
    source, kernels = cuda_source(arch)
    cubin = tmp_path / "kernels.cubin"
    ptxas = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", str(source), "-o", str(cubin)],
                           capture_output=True, text=True)
    assert ptxas.returncode == 0, ptxas.stderr[-3000:]
    spills = dict(re.findall(r"Function properties for (\S+)\n\s*\d+ bytes stack frame, (\d+) bytes spill stores",
                             ptxas.stderr))
    assert sorted(spills) == sorted(kernels)
    # the dense tiles keep everything in registers; an experts kernel may spill a few bytes (ptxas
    # holds some at 64 registers: the expert loop's pointers)
    assert all(int(spilled) == 0 for name, spilled in spills.items() if "_experts_" not in name), ptxas.stderr
    assert all(int(spilled) <= 32 for spilled in spills.values()), ptxas.stderr
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout
    parts = re.split(r"^\.text\.(\S+):$", sass, flags=re.M)[1:]
    functions = dict(zip(parts[::2], parts[1::2]))
    assert sorted(functions) == sorted(kernels)
    for name, body in functions.items():
        # fp16 inputs are HMMA's default: no type suffix
        mma = r"HMMA\.16816\.F32 " if name.startswith("t_float16") else r"HMMA\.16816\.F32\.BF16 "
        assert re.search(mma, body), f"{name}: no tensor-core instruction"
        assert "LDGSTS.E.BYPASS.128" in body, f"{name}: no 16-byte asynchronous copy"
        assert "LDSM.16.M88.4" in body, f"{name}: no ldmatrix"
