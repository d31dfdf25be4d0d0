"""A cuda artifact is built on this machine (no GPU): its library holds compiled kernels for every kernel listed.

The artifacts come from tests/artifact_cache.py, which builds all of them in one process.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from artifact_cache import cuda_artifact

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_artifact_is_built_with_its_kernels():
    out = cuda_artifact("llama-sm_80")          # kiln compile TINY_LLAMA --target cuda --arch sm_80
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == {**manifest["target"], "name": "cuda", "arch": "sm_80", "device": "cuda"}
    assert manifest["dtype"] == "float16"
    library = (out / "model.cuda.so").read_bytes()
    for name in ("kv_append", "mma", "gemv"):             # kiln's own kernels (TVM names its own as it likes)
        assert any(name in k for k in manifest["kernels"]), (name, manifest["kernels"])
    for name in manifest["kernels"]:
        assert f"{name}_kernel".encode() in library, f"{name} has no compiled kernel in the library"
    assert b"__global__" not in library        # a binary (fatbin from nvcc), not CUDA source to JIT later
    assert b"sm_80" in library
    # decode-only steps have their own entry, with TVM's decode kernel in place of the prefill one, and
    # a second one whose kernels TVM's RewriteCUDAGraph captured: all but the LM head (which writes the
    # step's output) replay as one CUDA graph
    # ... and wide decode steps a third, whose linears run on tensor cores as the mixed steps' do
    # (codegen/kernels/gpu/mma_gemm.py), also captured
    assert manifest["entries"] == {"mixed": "forward", "decode": "decode", "decode_graph": "decode_graph",
                                   "decode_wide": "decode_wide", "decode_wide_graph": "decode_wide_graph"}
    assert manifest["decode_mma_from"] == 16
    assert manifest["linear_kernels"] == {"mixed": ["mma"], "decode": ["gemv"], "decode_wide": ["mma"]}
    assert {k for k in manifest["kernels"] if k.startswith("mma_")} == {
        "mma_512x256", "mma_256x256_residual", "mma_1024x256_silu", "mma_256x512_residual", "mma_384x256"}
    # the gate/up linear applies the SwiGLU in its epilogue: its weights are stored gate and up
    # rows interleaved, and no separate activation kernel runs in mixed steps
    assert {w["param"] for w in manifest["weights"] if w["layout"] == "gated"} == {
        f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(2)}
    assert not any("silu" in k for k in manifest["launches_per_step"]["by_kernel"] if not k.startswith("mma_"))
    assert manifest["attention_kernels"] == {"mixed": ["tvm_prefill"], "decode": ["kiln_gpu_decode"]}
    launches = manifest["launches_per_step"]["entries"]
    assert launches["decode"]["kernels"] == launches["decode"]["host_launches"]
    # decode steps' linears are kiln's streaming GEMVs (codegen/kernels/gpu/gemv.py), one per shape; the gate/up
    # one applies the SwiGLU as the tensor-core kernel does
    assert {k for k in manifest["kernels"] if k.startswith("gemv_")} == {
        "gemv_512x256", "gemv_256x256_residual", "gemv_1024x256_silu", "gemv_256x512_residual", "gemv_384x256"}
    assert not any(k.startswith("dlgemv_") for k in manifest["kernels"])
    # the graph runs the decode entry's kernels in fewer host launches
    assert launches["decode_graph"]["kernels"] == launches["decode"]["kernels"]
    assert launches["decode_graph"]["host_launches"] < launches["decode"]["host_launches"]
    assert manifest["graph_batches"] == [1, 2, 4, 8, 16, 32, 64]
    assert b"vm.builtin.cuda_graph.run_or_capture" in library


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_fp8_artifact_is_built_for_hopper():
    """fp8 weights build for sm_90: the e4m3 weights are stored as such and the kernels are compiled."""
    out = cuda_artifact("llama-fp8-sm_90")      # kiln compile TINY_LLAMA --target cuda --arch sm_90 --quant fp8
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["weights"] == "fp8"
    assert manifest["quantization"]["embedding"] == "fp8"
    # per layer qkv, o, gate_up, down; the LM head; the embedding table (untied), gathered by a device kernel
    assert sum(w["dtype"] == "float8_e4m3fn" for w in manifest["weights"]) == 2 * 4 + 2
    assert any("embed_fp8" in k for k in manifest["kernels"])
    library = (out / "model.cuda.so").read_bytes()
    assert b"sm_90" in library and b"__global__" not in library
    for name in manifest["kernels"]:
        assert f"{name}_kernel".encode() in library


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("family,kernels", [("qwen3", ("rms_norm", "rope", "kiln_lora_f16_")),
                                            ("olmo2", ("rms_norm", "rope", "mma_q4kg32_", "gemv_q4kg32_")),
                                            ("gemma3", ("kiln_paged_attention_window5",
                                                        "kiln_paged_attention_decode_window5", "gelu_tanh")),
                                            ("qwen2_moe", ("moe_router_softmax_topk", "moe_plan", "moe_gate_up",
                                                           "moe_down", "moe_combine", "sigmoid")),
                                            ("deepseek_v3", ("tvm_mla_append", "tvm_mla_attention", "head_linear",
                                                             "moe_router_sigmoid_group_top2"))])
def test_new_families_build_for_cuda(family, kernels):
    """Qwen3's per-head and OLMo 2's all-head q/k norms lower for CUDA (Qwen3 with 2 LoRA slots: every
    projection's adapters the CUDA LoRA kernel's; OLMo 2 in q4k: its linears the
    tensor-core GEMM's and the GEMV's q4k forms); Gemma 3's sliding layers run
    kiln's GPU attention (TVM's mask causally only; its decode steps split the keys over blocks) and
    its global layer TVM's kernels; DeepSeek's
    latent cache takes TVM's MLA append and attention kernels, its experts kiln's own."""
    out = cuda_artifact(f"{family}-sm_80")      # kiln compile TINY_FAMILY --target cuda --arch sm_80
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["config"]["model_type"] == {"gemma3": "gemma3_text"}.get(family, family)
    assert all(any(name in k for k in manifest["kernels"]) for name in kernels), manifest["kernels"]
    library = (out / "model.cuda.so").read_bytes()
    assert all(f"{k}_kernel".encode() in library for k in manifest["kernels"])
    assert (out / "model.cuda.so").stat().st_size > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_quantised_kv_cache_builds_for_cuda_with_kilns_attention():
    """Gemma 2 with an fp8 KV cache on sm_90: every layer (windowed or not, soft-capped scores)
    appends through kiln's quantising append and attends with kiln's GPU kernel in every step; no
    layer is left to the fallback, and the pages are stored as e4m3 with a scale per row."""
    out = cuda_artifact("gemma2-fp8kv-sm_90")   # kiln compile TINY_GEMMA2 --target cuda --arch sm_90 --kv-dtype fp8 ...
    manifest = json.loads((out / "manifest.json").read_text())
    kernels = manifest["kernels"]
    assert manifest["quantization"]["kv_cache"] == "fp8"
    assert "kv_append_fp8" in kernels and not any("fallback" in k or k == "kv_append" for k in kernels), kernels
    for name in ("kiln_paged_attention_softcap_fp8", "kiln_paged_attention_window6_softcap_fp8",
                 "kiln_paged_attention_decode_softcap_fp8", "kiln_paged_attention_decode_window6_softcap_fp8"):
        assert name in kernels, kernels
    library = (out / "model.cuda.so").read_bytes()
    assert all(f"{k}_kernel".encode() in library for k in kernels)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_hopper_linears_link_cutlass_wgmma_gemms():
    """On sm_90 the fp16 linears (q4 in groups of 128 here) of steps with many rows call CUTLASS's
    Hopper GEMM (built by nvcc, linked into the library with CUDA's runtime, which its kernels
    register with), mma's tiles below HOPPER_FROM rows; decode steps keep the streaming GEMV, and the
    gated MLP's activation runs apart in those steps (the GEMV applies it). Each q4 linear's scales are
    stored a second time, times -8, as CUTLASS's zeros (in the gate/up's interleaved column order): by
    compile from the checkpoint and by fill-weights from the drawn scales."""
    from safetensors.numpy import load_file

    from kiln.interface import StoredWeight
    from kiln.selection.tiles import HOPPER_FROM
    from kiln.weights.generated import _Drawer
    out = cuda_artifact("gemma2-fp8kv-sm_90")   # ... --quant q4 --group-size 128, LM head float16
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["linear_kernels"] == {"mixed": ["wgmma"], "decode": ["gemv"], "decode_wide": ["wgmma"]}
    hopper = manifest["hopper_gemms"]
    assert hopper["variants"] == ["kiln_hopper_gemm_f16_q4_wg128x128x64c1", "kiln_hopper_gemm_f16_wg128x128x64c1"]
    assert hopper["from_rows"] == HOPPER_FROM + 1
    weights = [StoredWeight(**{**w, "shape": tuple(w["shape"])}) for w in manifest["weights"]]
    zeros = [i for i, w in enumerate(weights) if w.layout.startswith("q4zeros")]
    scales = [next(i for i, s in enumerate(weights) if s.param == weights[z].param and s.layout in ("nk", "gatedcols"))
              for z in zeros]
    # per layer qkv, o, gate_up (its scales' columns gated), down; the LM head is float16
    assert sorted(weights[z].layout for z in zeros) == ["q4zeros"] * 6 + ["q4zerosgated"] * 2
    stored = load_file(out / "weights.safetensors")
    with ThreadPoolExecutor(2) as pool:        # fill-weights' drawer: the scales drawn as every tensor is
        drawer = _Drawer(pool, tuple(weights), manifest["model"]["config"], seed=3)
        for z, s in zip(zeros, scales):
            assert weights[z].dtype == weights[s].dtype == "float16"
            assert np.array_equal(stored[weights[z].name], stored[weights[s].name] * np.float16(-8))
            # the scales as fill-weights draws them, into an array of their own: take() hands out its two
            # buffers in order only, and this walk skips about (a tensor it started may still be drawing)
            drawn = drawer.draw(s)
            assert np.array_equal(drawer.take(z), drawn * np.float16(-8))
    library = (out / "model.cuda.so").read_bytes()
    assert all(v.encode() in library for v in hopper["variants"])
    needed = subprocess.run(["readelf", "-d", str(out / "model.cuda.so")], capture_output=True, text=True).stdout
    assert "libcudart.so" in needed
    assert {k for k in manifest["kernels"] if k.endswith("_gelu_tanh")} == {"gemv_q4g128_1024x256_gelu_tanh"}
    assert any(k.startswith("wgmma_") for k in manifest["launches_per_step"]["by_kernel"])


def cuobjdump() -> str | None:
    try:
        import nvidia
        found = [Path(p) / "cu13" / "bin" / "cuobjdump" for p in nvidia.__path__]
    except ImportError:
        found = []
    return next((str(p) for p in found if p.exists()), shutil.which("cuobjdump"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("weight", ["float", "q4"])
def test_the_hopper_gemm_objects_run_wgmma_on_tma_loads(weight):
    """The variants the sm_90 artifact links (its compile built them; taken here from the cache), as
    nvcc built them for sm_90a: warp-group MMAs on fp16 over the tile's rows (q4 levels widened in
    registers: the MMA's A operand from registers), TMA loads and stores, no local-memory spills,
    and the global function the linears call registered by name."""
    from kiln.codegen.kernels.gpu.hopper_gemm import HopperGemm, build_objects
    from kiln.selection.tiles import HOPPER_DEFAULTS, parse_hopper_tile
    cuda_artifact("gemma2-fp8kv-sm_90")
    variant = HopperGemm("float16", parse_hopper_tile(HOPPER_DEFAULTS[-1][1]), weight)
    obj, = build_objects([variant])
    assert variant.name.encode() in obj.read_bytes()
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)")
    sass = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    assert "arch = sm_90a" in sass
    operands = r"R\d+, gdesc" if weight == "q4" else r"gdesc"        # A from registers, or both from shared memory
    assert re.search(rf"HGMMA\.64x{variant.tile.n}x16\.F32 R\d+, {operands}\[UR\d+\]", sass), \
        "no fp16 warp-group MMA over the tile's rows"
    assert "UTMALDG" in sass and "UTMASTG" in sass, "no TMA loads and stores"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory: registers spilled"
