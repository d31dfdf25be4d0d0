"""Intel AMX tiles on CPUs: the bf16 tile micro-kernels (codegen/kernels/cpu/tile_micro.py) as LLVM
compiles them for Sapphire Rapids, the bf16 kernel with tiles (codegen/kernels/cpu/bf16_linear.py)
against the reference interpreter on emulated tiles, on real ones where the CPU has AMX and on its
AVX-512 fallback where Linux refuses them (every CPU without AMX), where it is chosen, and a bf16
artifact whose prompts run it against the interpreter, with what `kiln run --json` and `kiln inspect`
say of it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

X86 = platform.machine() == "x86_64"


def _sapphire_rapids():
    import tvm
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "sapphirerapids"})


def _function(asm: str, name: str) -> str:
    body = asm[asm.index(f"{name}:"):]
    return body[:body.index(".Lfunc_end")]


@pytest.mark.skipif(not X86, reason="x86-64 only: AMX is Intel's")
@pytest.mark.parametrize("row_tiles,col_tiles", [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_tile_micro_kernels_select_amx_for_sapphire_rapids(row_tiles, col_tiles):
    """The LLVM IR kiln writes for a micro-kernel parses, and LLVM selects one tdpbf16ps per C tile and
    step, loads each A and B tile once per step, keeps every tile in a register (no tile goes through
    the stack), and configures and releases the tiles itself."""
    from kiln.codegen.kernels.cpu.tile_micro import bf16_name, tile_module
    asm = tile_module([(row_tiles, col_tiles)], _sapphire_rapids()).inspect_source("asm")
    body = _function(asm, bf16_name(row_tiles, col_tiles))
    products = row_tiles * col_tiles
    assert body.count("tdpbf16ps") == products
    assert body.count("tileloadd") == products + row_tiles + col_tiles     # C once, A and B per step
    assert body.count("tilestored") == products
    assert body.count("ldtilecfg") == 1 and body.count("tilerelease") == 1
    assert not [line for line in body.splitlines() if line.strip().startswith(("tileloadd", "tilestored"))
                and "(%rsp" in line]


@pytest.mark.skipif(not X86, reason="x86-64 only: AMX is Intel's")
def test_tiles_ready_asks_linux_for_the_tile_state():
    """kiln_tiles_ready asks arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) through syscall(2),
    with the numbers Linux's headers give (arch/x86/include/uapi/asm/prctl.h, asm/unistd_64.h)."""
    from kiln.codegen.kernels.cpu.tile_micro import READY, tile_module
    body = _function(tile_module([], _sapphire_rapids()).inspect_source("asm"), READY)
    assert "movl\t$158, %edi" in body and "movl\t$4131, %esi" in body and "movl\t$18, %edx" in body
    assert "syscall@PLT" in body and "getenv@PLT" in body


def _amx_in_cpuinfo() -> bool:
    from kiln.cpu_features import cpuinfo_features
    return "amxtile" in cpuinfo_features()


@pytest.mark.skipif(not X86 or platform.system() != "Linux", reason="AMX's tile state is Linux x86-64's")
def test_linux_grants_tiles_exactly_where_the_cpu_has_amx(monkeypatch):
    """request_tiles: granted where /proc/cpuinfo lists amx_tile (Linux 5.16 and later), refused with
    Linux's reason elsewhere; KILN_CPU_TILES=off refuses without asking."""
    from kiln.cpu_tiles import TileState, request_tiles
    state = request_tiles("amx")
    assert state.granted == _amx_in_cpuinfo(), state
    if not state.granted:
        assert "Linux refused AMX's tile state" in state.reason
    monkeypatch.setenv("KILN_CPU_TILES", "off")
    assert request_tiles("amx") == TileState("amx", False, "KILN_CPU_TILES=off")
    assert not request_tiles("emulated").granted


@pytest.mark.parametrize("tiles", ["emulated", "amx", "amx-switched-off"])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_bf16_tile_kernel_equals_the_interpreter(tiles, bias, residual, tmp_path, monkeypatch):
    """codegen/kernels/cpu/bf16_linear.py with tiles, its micro-kernels linked in as the artifact links
    them, at row counts that leave partial tiles, row groups and tasks: on emulated tiles; on AMX (this
    CPU's tiles where it has them, else the AVX-512 micro-kernels Linux's refusal leaves); with
    KILN_CPU_TILES=off (the AVX-512 micro-kernels)."""
    from test_gemm import N_IN, N_OUT, NB, check_against_interpreter

    from kiln.codegen.kernels.cpu.bf16_linear import bf16_linear_kernel, micro_kernels, tile_kernels
    from kiln.codegen.kernels.cpu.bf16_micro import micro_module
    from kiln.codegen.kernels.cpu.tile_micro import tile_module
    from kiln.host_cpu import has_bf16_dot
    from kiln.targets.cpu import host_cpu_target
    if not has_bf16_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX-512 BF16 (vdpbf16ps), which the tile kernel falls back on")
    if tiles == "amx-switched-off":
        monkeypatch.setenv("KILN_CPU_TILES", "off")
    target = host_cpu_target()
    linked = [micro_module(micro_kernels(NB), target), tile_module(tile_kernels(NB), target, tiles == "emulated")]
    check_against_interpreter("linear", "bfloat16", bias, residual, {}, lambda fmt, weight_dtype: bf16_linear_kernel(
        N_OUT, N_IN, NB, bias, residual, tiles=True), layout=f"packed{NB}x2", link=(linked, tmp_path))


def test_tile_kernel_is_chosen_for_bf16_steps_of_many_rows():
    """amx_bf16 runs bf16 linears in steps that bring many rows (prompts, chunks, wide decode steps) on
    a target with tiles and whole tile rows of inputs; decode steps, targets without tiles and inputs
    that are not a multiple of 32 keep bf16dot."""
    from kiln.selection.formats import WeightFormat
    from kiln.selection.linear import LINEAR_KERNELS, LinearSite
    from kiln.selection.order import CPU_KERNELS
    from kiln.targets.cpu import CPUTarget

    def chosen(tiles: str, step: str, n_in: int = 256) -> str:
        target = CPUTarget(int8_dot="vnni", bf16_dot=True, tiles=tiles)
        site = LinearSite(target, step, "packed64x2", 128, n_in, "bfloat16", "bfloat16", WeightFormat())
        return next(name for name in CPU_KERNELS.linear if LINEAR_KERNELS[name].supports(site))

    assert [chosen("amx", step) for step in ("mixed", "prefill", "decode")] == ["amx_bf16", "amx_bf16", "bf16dot"]
    assert [chosen("", step) for step in ("mixed", "decode")] == ["bf16dot", "bf16dot"]
    assert chosen("amx", "mixed", n_in=272) == "bf16dot"


def test_artifacts_with_tile_kernels_need_no_amx():
    """An artifact records the CPU's AMX features, and a CPU without them runs it (its tile kernels
    ask first); every other missing instruction set still refuses it."""
    from kiln.cpu_features import missing_features, missing_in_cpuinfo
    built_on = ["amx-bf16", "amx-int8", "amx-tile", "avx512bf16", "avx512f"]
    assert missing_features(built_on, {"avx512f": True, "avx512bf16": True}) == []
    assert missing_features(built_on, {"avx512f": True}) == ["avx512bf16"]
    assert missing_in_cpuinfo(built_on, {"avx512f"}) == ["avx512bf16"]


@pytest.fixture(scope="module")
def tiled_llama(make_model, tmp_path_factory):
    """A tiny bf16 Llama compiled with emulated tiles (its prompts' linears amx_bf16)."""
    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    from kiln.targets.cpu import CPUTarget
    if not CPUTarget().bf16_dot:
        pytest.skip("this CPU has no AVX-512 BF16 (vdpbf16ps), which the tile kernels fall back on")
    model_dir = make_model("llama")
    out = tmp_path_factory.mktemp("tiles") / "artifact"
    compile_model(model_dir, out, CompileOptions(target=CPUTarget(tiles="emulated"), dtype="bfloat16"), show=None)
    return model_dir, out


def test_tiled_artifact_equals_the_interpreter(tiled_llama):
    """A prompt (amx_bf16's emulated tiles) and the decode steps after it (bf16dot) against the
    interpreter on the same bfloat16 graph, within the bound tests/test_compiled_families.py measured
    for the bf16 dots (about 4 bf16 ulps of the largest logit)."""
    from paging import kv_pages_for, make_step_inputs
    from test_compiled_families import open_artifact

    from kiln.frontend import load_hf_model
    from kiln.ir import interpret, weight_loader
    from kiln.passes import run_pipeline
    model_dir, artifact = tiled_llama
    model = open_artifact(artifact)
    assert model.manifest.linear_kernels["mixed"] == ["amx_bf16"]
    assert model.manifest.linear_kernels["decode"] == ["bf16dot"]
    assert model.manifest.target.tiles == "emulated" and model.tiles.granted
    ids = np.random.default_rng(4).integers(3, 500, 40).tolist()
    pages = [2, 5, 7]
    steps = [make_step_inputs([(ids[:37], 0, pages)], model.page_size)]
    steps += [make_step_inputs([([ids[t]], t, pages)], model.page_size) for t in range(37, 40)]
    hf_model = load_hf_model(model_dir)
    graph, _ = run_pipeline(hf_model.build_graph("bfloat16", model.page_size), "cpu")
    kv = kv_pages_for(graph.kv_specs, 8)
    weights = weight_loader(graph, lambda name: hf_model.weight(name, "bfloat16"))
    for step in steps:
        got = model.forward(step)[0]
        want = interpret(graph, {**step, **kv}, weights)["logits"][0].astype(np.float32)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-2


def test_run_json_and_inspect_say_what_the_tiles_did(tiled_llama):
    """`kiln run --json` reports the tiles granted, or switched off (KILN_CPU_TILES=off); `kiln inspect`
    names the kernels with tiles."""
    _, artifact = tiled_llama
    kiln = [sys.executable, "-m", "kiln.cli"]
    args = ["run", str(artifact), "--prompt", "def main():", "--max-tokens", "4", "--json"]
    on = subprocess.run([*kiln, *args], capture_output=True, text=True, timeout=600)
    assert on.returncode == 0, on.stderr
    assert json.loads(on.stdout)["cpu_tiles"] == {"kind": "emulated", "granted": True}
    off = subprocess.run([*kiln, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KILN_CPU_TILES": "off"})
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout)["cpu_tiles"] == {"kind": "emulated", "granted": False, "reason": "KILN_CPU_TILES=off"}
    shown = subprocess.run([*kiln, "inspect", str(artifact)], capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith("tiles"))
    assert "emulated tiles in amx_bf16" in line and "AVX-512 BF16" in line
