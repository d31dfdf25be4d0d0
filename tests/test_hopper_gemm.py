"""CUTLASS's Hopper GEMM (codegen/kernels/gpu/hopper_gemm.py): the rows each kernel of a wgmma linear
serves, and its object built here with wgmma and TMA in its machine code. (Running it needs an sm_90
GPU: tests/gpu/test_mma_gemm.py, through bench/gemm_gpu.py's kernel library.)"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.selection.tiles import (HOPPER_CANDIDATES, HOPPER_DEFAULTS, HOPPER_FROM, HopperTile, TileConfig, _table,
                                  hopper_key, hopper_tiles, parse_hopper_tile, tiles_for)


@pytest.mark.parametrize("shape", [(28672, 4096), (4096, 14336), (2048, 2048), (512, 256)])
def test_steps_of_few_rows_keep_mmas_tiles_and_larger_ones_take_the_hopper_gemm(shape):
    """Without a tuned entry: mma's own tiles up to HOPPER_FROM rows, the default Hopper tile above."""
    chosen = hopper_tiles("sm_90", "bfloat16", *shape)
    tuned = _table().get(hopper_key("sm_90", "bfloat16", *shape))
    if tuned:
        assert [(rows, t.name) for rows, t in chosen] == [tuple(e) for e in tuned]
        return
    small = [(rows, t) for rows, t in chosen if isinstance(t, TileConfig)]
    large = [(rows, t) for rows, t in chosen if isinstance(t, HopperTile)]
    assert chosen == small + large
    # mma's own table up to HOPPER_FROM rows: the same tile for every row count it covers
    mma = tiles_for("sm_90", "bfloat16", *shape)
    for rows in (1, 16, 17, 64):
        assert _tile_for(chosen, rows) == _tile_for(mma, rows)
    assert small[-1][0] == HOPPER_FROM
    assert [(rows, t.name) for rows, t in large] == list(HOPPER_DEFAULTS)
    assert hopper_tiles("sm_90", "bfloat16", 100, 100) is None        # no mma tile divides it


def _tile_for(tiles, rows):
    return next(t for bound, t in tiles if bound == 0 or rows <= bound)


def test_tile_names_round_trip():
    for tile in HOPPER_CANDIDATES:
        assert parse_hopper_tile(tile.name) == tile
    assert parse_hopper_tile("wg128x256x64c2") == HopperTile(128, 256, 64, 2, True)
    assert parse_hopper_tile("wg128x128x64c1p") == HopperTile(128, 128, 64, 1, False)


@pytest.mark.parametrize("bias,residual,code", [(False, False, 0), (True, False, 1), (False, True, 2),
                                                (True, True, 3)])
def test_a_wgmma_linear_launches_mma_tiles_for_few_rows_and_calls_the_hopper_gemm_above(bias, residual, code):
    from kiln.codegen.kernels.gpu.mma_gemm import wgmma_linear_kernel
    tiles = hopper_tiles("sm_90", "bfloat16", 512, 256)
    func, variants = wgmma_linear_kernel(512, 256, "bfloat16", bias, residual, tiles)
    assert [v.name for v in variants] == ["kiln_hopper_gemm_bf16_wg128x128x64c1"]
    host = re.sub(r'source_code="(?:[^"\\]|\\.)*"', "", func.script())
    # the branch on the step's rows m: mma's tile at m <= HOPPER_FROM, CUTLASS's function above it
    small_branch, _, large_branch = host.partition(f"if m <= T.int64({HOPPER_FROM}):")[2].partition("else:")
    assert "T.cuda.func_call(\"kiln_mma_bf16_512x256_" in small_branch and "call_packed" not in small_branch
    packed = re.findall(r'T\.call_packed\("(\w+)", (.*)\)', large_branch)
    assert [name for name, _ in packed] == ["kiln_hopper_gemm_bf16_wg128x128x64c1"]
    operands = [a.split("(")[-1] for a in re.findall(r"T\.tvm_stack_make_array\((\w+)\.data", packed[0][1])]
    assert operands == ["x", "w", "y", "bias" if bias else "y", "residual" if residual else "y"]
    assert packed[0][1].rstrip().endswith(f", {code}")


def cuobjdump() -> str | None:
    try:
        import nvidia
        found = [Path(p) / "cu13" / "bin" / "cuobjdump" for p in nvidia.__path__]
    except ImportError:
        found = []
    return next((str(p) for p in found if p.exists()), shutil.which("cuobjdump"))


def test_a_q4_wgmma_linear_passes_its_scales_and_zeros():
    from kiln.codegen.kernels.gpu.mma_gemm import wgmma_linear_kernel
    tiles = hopper_tiles("sm_90", "bfloat16", 512, 256)
    func, variants = wgmma_linear_kernel(512, 256, "bfloat16", False, True, tiles, "q4", 128)
    assert [v.name for v in variants] == ["kiln_hopper_gemm_bf16_q4_wg128x128x64c1"]
    assert [p.name for p in func.params] == ["x", "w", "scale", "zeros", "residual", "y"]
    host = re.sub(r'source_code="(?:[^"\\]|\\.)*"', "", func.script())
    for name in ("scale", "zeros"):                                    # [K / 128, out]
        assert f'{name}: T.Buffer((2, 512), "float16")' in host
    call = re.search(r'T\.call_packed\("kiln_hopper_gemm_bf16_q4_wg128x128x64c1", (.*)\)', host).group(1)
    operands = re.findall(r"T\.tvm_stack_make_array\((\w+)\.data", call)
    assert operands == ["x", "w", "scale", "zeros", "y", "y", "residual"]
    # mma's q4 tiles for the few-row steps read the nibbles and scales alone
    assert "T.cuda.func_call(\"kiln_mma_bf16_q4g128_512x256_" in host


@pytest.mark.build
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("weight", ["float", "q4"])
def test_the_hopper_gemm_object_runs_wgmma_on_tma_loads(weight):
    """The default tile's float16 variants (tests/test_cuda_build.py's sm_90 artifact links the q4 one)
    built by nvcc for sm_90a: warp-group MMAs on fp16 (q4 levels widened in registers: the MMA's A
    operand from registers), TMA loads and stores, no local-memory spills, and the global function
    its linears call registered by name."""
    from kiln.codegen.kernels.gpu.hopper_gemm import HopperGemm, build_objects
    if weight == "q4":              # built by that artifact's compile (a minute of nvcc): not twice at once
        from artifact_cache import cuda_artifact
        cuda_artifact("gemma2-fp8kv-sm_90")
    variant = HopperGemm("float16", parse_hopper_tile(HOPPER_DEFAULTS[-1][1]), weight)
    obj, = build_objects([variant])
    assert variant.name.encode() in obj.read_bytes()
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)")
    sass = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    assert "arch = sm_90a" in sass
    tile = variant.tile
    operands = r"R\d+, gdesc" if weight == "q4" else r"gdesc"        # A from registers, or both from shared memory
    assert re.search(rf"HGMMA\.64x{tile.n}x16\.F32 R\d+, {operands}\[UR\d+\]", sass), \
        "no fp16 warp-group MMA over the tile's rows"
    assert "UTMALDG" in sass and "UTMASTG" in sass, "no TMA loads and stores"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory: registers spilled"


@pytest.mark.parametrize("release,message", [(None, r"nvidia-cutlass's headers are not installed: pip install "
                                                    r"--no-deps nvidia-cutlass==4\.2\.0\.0"),
                                             ("4.1.0", r"against nvidia-cutlass 4\.2\.0\.0; 4\.1\.0 is installed")])
def test_compile_refuses_cutlass_headers_it_was_not_written_against(monkeypatch, release, message):
    from kiln.codegen.kernels.gpu import hopper_gemm
    from kiln.errors import KilnError
    monkeypatch.setattr(hopper_gemm, "installed_release", lambda name: release)
    with pytest.raises(KilnError, match=message):
        hopper_gemm.cutlass_include()
