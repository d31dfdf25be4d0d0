"""Intel AMX tiles on CPUs: the tile micro-kernels (codegen/kernels/cpu/tile_micro.py) as LLVM
compiles them for Sapphire Rapids, the bf16 kernel and the q8 (VNNI) kernel with tiles
(codegen/kernels/cpu/bf16_linear.py, vnni_linear.py) against the reference interpreter on emulated
tiles, on real ones where the CPU has AMX and on their AVX-512 fallback where Linux refuses them
(every CPU without AMX), where they are chosen, and a bf16 artifact whose prompts run them against
the interpreter, with what `kiln run --json` and `kiln inspect` say of it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

X86 = platform.machine() == "x86_64"
builds = pytest.mark.build      # builds with TVM or LLVM, or runs what it built (not in make test-fast)
# partial tiles, a last row group of one and of two tiles, a second task of a panel and its leftover rows
TILE_ROW_COUNTS = (1, 13, 50, 97, 177)


def _sapphire_rapids():
    import tvm
    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "sapphirerapids"})


def _function(asm: str, name: str) -> str:
    body = asm[asm.index(f"{name}:"):]
    return body[:body.index(".Lfunc_end")]


@builds
@pytest.mark.skipif(not X86, reason="x86-64 only: AMX is Intel's")
@pytest.mark.parametrize("row_tiles,col_tiles", [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_tile_micro_kernels_select_amx_for_sapphire_rapids(row_tiles, col_tiles):
    """The LLVM IR kiln writes for a micro-kernel parses, and LLVM selects one tdpbf16ps per C tile and
    step, loads each A and B tile once per step, keeps every tile in a register (no tile goes through
    the stack), and configures and releases the tiles itself."""
    from kiln.codegen.kernels.cpu.tile_micro import bf16_name, tile_module
    asm = tile_module([("bf16", row_tiles, col_tiles)], _sapphire_rapids()).inspect_source("asm")
    body = _function(asm, bf16_name(row_tiles, col_tiles))
    products = row_tiles * col_tiles
    assert body.count("tdpbf16ps") == products
    assert body.count("tileloadd") == products + row_tiles + col_tiles     # C once, A and B per step
    assert body.count("tilestored") == products
    assert body.count("ldtilecfg") == 1 and body.count("tilerelease") == 1
    assert not [line for line in body.splitlines() if line.strip().startswith(("tileloadd", "tilestored"))
                and "(%rsp" in line]


@builds
@pytest.mark.skipif(not X86, reason="x86-64 only: AMX is Intel's")
@pytest.mark.parametrize("row_tiles,col_tiles,block", [(2, 2, 32), (1, 2, 32), (1, 1, 64)])
def test_int8_tile_micro_kernels_select_amx_for_sapphire_rapids(row_tiles, col_tiles, block):
    """Per activation block: one tilezero and tdpbssd per C tile, each A and B tile loaded once and
    every C tile stored, no tile through the stack."""
    from kiln.codegen.kernels.cpu.tile_micro import int8_name, tile_module
    asm = tile_module([("s8", row_tiles, col_tiles, block)], _sapphire_rapids()).inspect_source("asm")
    body = _function(asm, int8_name(row_tiles, col_tiles, block))
    products = row_tiles * col_tiles
    assert body.count("tdpbssd") == products and body.count("tilezero") == products
    assert body.count("tileloadd") == row_tiles + col_tiles and body.count("tilestored") == products
    assert not [line for line in body.splitlines() if line.strip().startswith(("tileloadd", "tilestored"))
                and "(%rsp" in line]


@builds
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


@builds
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
        N_OUT, N_IN, NB, bias, residual, tiles=True), layout=f"packed{NB}x2", link=(linked, tmp_path),
        row_counts=TILE_ROW_COUNTS)


INT8_CASES = [("linear_q8", "float32", False, False), ("linear_q8", "bfloat16", True, True),
              ("linear_q8g", "float32", True, True), ("linear_q4", "float32", False, True),
              ("linear_q4", "bfloat16", True, False), ("linear_q4a", "float32", True, True),
              ("linear_q4k", "bfloat16", False, True)]


@builds
@pytest.mark.parametrize("tiles", ["emulated", "amx", "amx-switched-off"])
@pytest.mark.parametrize("op,dtype,bias,residual", INT8_CASES)
def test_int8_tile_kernel_equals_the_interpreter(tiles, op, dtype, bias, residual, tmp_path, monkeypatch):
    """codegen/kernels/cpu/vnni_linear.py with tiles on q8 and q8g weights in byte quads and q4, q4a, q4k
    nibbles in them, as the bf16 kernel's test runs it: the interpreter's int8-activation scheme."""
    from test_gemm import GROUPED, N_IN, N_OUT, NB, NIBBLES, check_against_interpreter

    from kiln.codegen.kernels.cpu.tile_micro import tile_module
    from kiln.codegen.kernels.cpu.vnni_linear import tile_kernels, vnni_linear_kernel
    from kiln.host_cpu import has_quad_dot
    from kiln.selection.formats import WeightFormat
    from kiln.targets.cpu import host_cpu_target
    if not has_quad_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX-512 VNNI (vpdpbusd), which the tile kernel falls back on")
    if tiles == "amx-switched-off":
        monkeypatch.setenv("KILN_CPU_TILES", "off")
    fmt = WeightFormat(op.partition("_")[2], act_block=32)
    linked = [tile_module(tile_kernels(NB, fmt), host_cpu_target(), tiles == "emulated")]
    check_against_interpreter(op, dtype, bias, residual, {"act_block": 32}, lambda fmt, _: vnni_linear_kernel(
        N_OUT, N_IN, NB, dtype, fmt, bias, residual, tiles=True),
        layout=f"packed{NB}x4" + ("n32" if op in NIBBLES else ""),
        scale_layout=f"panels{NB}" if op in GROUPED else "nk", link=(linked, tmp_path), row_counts=TILE_ROW_COUNTS)


def test_tile_kernels_are_chosen_for_steps_of_many_rows():
    """amx_bf16 runs bf16 linears in steps that bring many rows (prompts, chunks, wide decode steps) on
    a target with tiles and whole tile rows of inputs; decode steps, targets without tiles and inputs
    that are not a multiple of 32 keep bf16dot. amx_int8 likewise runs q8 and q4 linears, vnni their
    decode steps."""
    import dataclasses

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
    for fmt, layout in ((WeightFormat("q8", act_block=32), "packed64x4"),
                        (WeightFormat("q4", group_size=32, act_block=32), "packed64x4n32")):
        site = LinearSite(CPUTarget(int8_dot="vnni", bf16_dot=True, tiles="amx"), "mixed", layout, 128, 256,
                          "float32", "int8", fmt)
        assert next(n for n in CPU_KERNELS.linear if LINEAR_KERNELS[n].supports(site)) == "amx_int8"
        assert next(n for n in CPU_KERNELS.linear if LINEAR_KERNELS[n].supports(
            dataclasses.replace(site, step="decode"))) == "vnni"


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


@builds
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


@builds
def test_q4_tiles_give_the_vnni_kernels_logits_exactly(make_model, tmp_path):
    """A q4 artifact whose prompts' linears run amx_int8 on emulated tiles gives the same logits, bit for
    bit, as one built without tiles (vnni's vpdpbusd): the same integer dots per block, the same float
    steps in the same order."""
    from paging import make_step_inputs
    from test_compiled_families import open_artifact

    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    from kiln.targets.cpu import CPUTarget
    if CPUTarget().int8_dot != "vnni":
        pytest.skip("this CPU has no AVX-512 VNNI (vpdpbusd), which the tile kernels fall back on")
    model_dir = make_model("llama")
    logits = {}
    for tiles in ("emulated", ""):
        out = tmp_path / f"q4{tiles}"
        compile_model(model_dir, out, CompileOptions(target=CPUTarget(tiles=tiles), quant="q4"), show=None)
        model = open_artifact(out)
        assert model.manifest.linear_kernels["mixed"] == (["amx_int8"] if tiles else ["vnni"])
        ids = np.random.default_rng(5).integers(3, 500, 45).tolist()
        logits[tiles] = model.forward(make_step_inputs([(ids, 0, [3, 1, 4])], model.page_size))[0]
    np.testing.assert_array_equal(logits["emulated"], logits[""])


@builds
def test_run_json_and_inspect_say_what_the_tiles_did(tiled_llama):
    """`kiln run --json` reports the tiles granted, or switched off (KILN_CPU_TILES=off); `kiln serve`'s
    start line says what they are; `kiln inspect` names the kernels with tiles."""
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
    from kiln.serve.app import ServerConfig, open_engine
    started = open_engine(ServerConfig(artifact=str(artifact)))[2]          # kiln serve's start line
    assert started.endswith("; CPU tiles: emulated")
    shown = subprocess.run([*kiln, "inspect", str(artifact)], capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0, shown.stderr
    line = next(line for line in shown.stdout.splitlines() if line.startswith("tiles"))
    assert "emulated tiles in amx_bf16" in line and "KILN_CPU_TILES=off" in line
