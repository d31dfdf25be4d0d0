"""CUTLASS's Hopper GEMM (codegen/kernels/gpu/hopper_gemm.py): the rows each kernel of a wgmma linear
serves, the operands it passes, and the CUTLASS release it is built against. (Its objects' machine
code: tests/test_cuda_build.py, beside the sm_90 artifact that links them; running it needs an
sm_90 GPU: tests/gpu/test_mma_gemm.py, through bench/gemm_gpu.py's kernel library.)"""
from __future__ import annotations

import re

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


@pytest.mark.parametrize("release,message", [(None, r"nvidia-cutlass's headers are not installed: pip install "
                                                    r"--no-deps nvidia-cutlass==4\.2\.0\.0"),
                                             ("4.1.0", r"against nvidia-cutlass 4\.2\.0\.0; 4\.1\.0 is installed")])
def test_compile_refuses_cutlass_headers_it_was_not_written_against(monkeypatch, release, message):
    from kiln.codegen.kernels.gpu import hopper_gemm
    from kiln.errors import KilnError
    monkeypatch.setattr(hopper_gemm, "installed_release", lambda name: release)
    with pytest.raises(KilnError, match=message):
        hopper_gemm.cutlass_include()
