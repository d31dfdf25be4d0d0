"""`kiln compile --target cuda --attention flashinfer`: which layers FlashInfer's prefill takes (and the
fallbacks for those it cannot serve), what the artifact adds for the runtime to plan, the release
check, and (with nvcc and flashinfer-python) an artifact built with FlashInfer's objects linked in
that loads with TVM's runtime alone. Running it needs a GPU: tests/gpu/test_flashinfer_gpu.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.options import CompileOptions

ROOT = Path(__file__).resolve().parents[1]


def flashinfer_graph(model_dir, kv_dtype=None):
    """The model's graph after the pass pipeline for CUDA sm_90 with FlashInfer's order."""
    from kiln.frontend import load_hf_model
    from kiln.passes import run_pipeline
    from kiln.selection.order import CUDA_FLASHINFER_KERNELS
    from kiln.targets import target_defaults
    target = replace(target_defaults("cuda"), arch="sm_90", kernels=CUDA_FLASHINFER_KERNELS)
    graph = load_hf_model(model_dir).build_graph("bfloat16", target.page_size)
    options = CompileOptions(target=target, dtype="bfloat16", kv_dtype=kv_dtype, attention="flashinfer")
    return run_pipeline(graph, target, None, options=options)[0]


def attention_kernels(graph):
    from kiln.ir.ops import ATTENTION_OPS
    return {recorded_pair(n) for n in graph.nodes if n.op in ATTENTION_OPS}


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory):
    pytest.importorskip("transformers")
    from kiln.testing.tiny import make_tiny_model

    def make(family, **overrides):
        return make_tiny_model(tmp_path_factory.mktemp(family), family, head_dim=64, num_attention_heads=4,
                               num_key_value_heads=2, **overrides)
    return make


def test_flashinfer_runs_every_step_but_plain_decodes(head_dim_64):
    from kiln.codegen.lowering.flashinfer import flashinfer_use
    graph = flashinfer_graph(head_dim_64("llama"))
    # prompts, chunks beside decodes and verify rows: FlashInfer; decode steps keep kiln's split kernel
    assert attention_kernels(graph) == {("flashinfer", "kiln_gpu_decode")}
    use = flashinfer_use(graph, ["mixed", "decode"])
    assert (use.variant.name, use.windows, use.q_heads, use.kv_heads) == ("kiln_prefill_bfloat16_d64", (0,), 4, 2)
    record = use.manifest()
    assert record["release"] == "0.6.6" and [p["window_left"] for p in record["plans"]] == [-1]


def test_windows_and_soft_capped_scores_build_one_variant_with_a_plan_per_window(head_dim_64):
    """Gemma 2 alternates sliding-window and full layers and soft-caps its scores: one variant with
    both, and one plan per window (a window of W keys is FlashInfer's window_left W - 1)."""
    from kiln.codegen.lowering.flashinfer import flashinfer_use
    model = head_dim_64("gemma2", sliding_window=48)
    graph = flashinfer_graph(model)
    assert attention_kernels(graph) == {("flashinfer", "kiln_gpu_decode")}
    use = flashinfer_use(graph, ["mixed", "decode"])
    assert use.variant.window and use.variant.softcap and use.windows == (0, 48)
    assert [(p["input"], p["window_left"]) for p in use.manifest()["plans"]] == [
        ("flashinfer_plan_w0", -1), ("flashinfer_plan_w48", 47)]
    assert set(use.inputs()) == {"flashinfer_float_workspace", "flashinfer_int_workspace_w0",
                                 "flashinfer_int_workspace_w48", "flashinfer_plan_w0", "flashinfer_plan_w48"}


def test_mla_layers_of_deepseeks_widths_run_flashinfers_mla_kernel(tmp_path, make_model):
    """DeepSeek's latent widths (512 + 64 rope) take FlashInfer's MLA kernel outside plain decodes;
    other widths keep TVM's."""
    pytest.importorskip("transformers")
    from kiln.codegen.lowering.flashinfer import flashinfer_use
    from kiln.testing.tiny import make_tiny_model
    model = make_tiny_model(tmp_path / "deepseek", "deepseek_v2", kv_lora_rank=512, qk_rope_head_dim=64,
                            head_dim=64, qk_nope_head_dim=64, v_head_dim=64, num_attention_heads=4)
    graph = flashinfer_graph(model)
    latent = {recorded_pair(n) for n in graph.nodes if n.op in ("latent_append", "latent_attend")}
    assert latent == {("flashinfer_mla", "tvm_mla")}
    use = flashinfer_use(graph, ["mixed", "decode"])
    assert (use.variant.name, use.q_heads, use.kv_heads) == ("kiln_mla_bfloat16_512x64", 4, 1)
    assert use.manifest()["kind"] == "mla" and len(use.manifest()["plans"]) == 1
    other = flashinfer_graph(make_model("deepseek_v2"))           # the tiny preset's 32-wide latent
    assert {recorded_pair(n) for n in other.nodes if n.op == "latent_attend"} == {("tvm_mla", "tvm_mla")}


def recorded_pair(node):
    from kiln.selection.choice import recorded
    return recorded(node, "mixed"), recorded(node, "decode")


def test_layers_flashinfer_cannot_serve_take_cudas_kernels(head_dim_64, make_model):
    """int8 pages (FlashInfer has no int8 KV) and head dims it is not built for fall back to the
    kernels CUDA runs without it; the artifact then needs no FlashInfer at all."""
    from kiln.codegen.lowering.flashinfer import flashinfer_use
    int8 = flashinfer_graph(head_dim_64("llama"), kv_dtype="int8")
    assert attention_kernels(int8) == {("kiln_gpu", "kiln_gpu_decode")}
    assert flashinfer_use(int8, ["mixed", "decode"]) is None
    head_dim_32 = flashinfer_graph(make_model("llama"))           # the tiny preset's head dim
    assert attention_kernels(head_dim_32) == {("tvm_prefill", "kiln_gpu_decode")}


def test_a_missing_or_other_release_is_refused_naming_it_and_the_fallback(monkeypatch):
    from kiln.codegen.kernels.gpu import flashinfer

    def installed(version):
        monkeypatch.setattr(flashinfer, "installed_release", lambda name: version)
    installed(None)
    with pytest.raises(KilnError, match=r"flashinfer-python==0\.6\.6 .* not installed .* --attention builtin"):
        flashinfer.check_release()
    installed("0.7.2")
    other = r"needs flashinfer-python==0\.6\.6; 0\.7\.2 is installed .* --attention builtin"
    with pytest.raises(KilnError, match=other):
        flashinfer.check_release()


def test_flashinfer_is_for_cuda_only(tmp_path):
    with pytest.raises(KilnError, match="--attention flashinfer is for --target cuda, not cpu"):
        CompileOptions(target="cpu", attention="flashinfer")
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(tmp_path), "--target", "cpu",
                           "--attention", "flashinfer", "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--attention flashinfer is for --target cuda" in proc.stderr


# ---------------------------------------------------------------------------- built here

def _has_flashinfer() -> bool:
    try:
        from importlib import metadata
        return metadata.version("flashinfer-python") == "0.6.6"
    except Exception:
        return False


def needs_build_tools(test):
    """Built with TVM, nvcc and FlashInfer's JIT (make flashinfer-deps installs it)."""
    for mark in (pytest.mark.build,
                 pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed"),
                 pytest.mark.skipif(not _has_flashinfer(), reason="flashinfer-python 0.6.6 is not installed "
                                                                  "(make flashinfer-deps)")):
        test = mark(test)
    return test


def compile_flashinfer(model_dir, out, cache):
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model_dir), "--target", "cuda",
                           "--arch", "sm_90", "--dtype", "bfloat16", "--attention", "flashinfer", "-o", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def flashinfer_artifact(head_dim_64, tmp_path_factory):
    # FlashInfer's objects persist between runs (outside build/test-cache, which another checkout's
    # environment prunes): a second run builds none of them
    cache = ROOT / "build" / "kiln-cache"
    out = tmp_path_factory.mktemp("flashinfer") / "artifact"
    return head_dim_64("llama"), out, cache, compile_flashinfer(head_dim_64("llama"), out, cache)


@needs_build_tools
def test_the_artifact_links_flashinfer_and_loads_with_tvms_runtime_alone(flashinfer_artifact):
    _, out, _, manifest = flashinfer_artifact
    assert manifest["attention_kernels"] == {"mixed": ["flashinfer"], "decode": ["kiln_gpu_decode"]}
    assert manifest["flashinfer"]["variant"] == "kiln_prefill_bfloat16_d64"
    assert manifest["inputs"][-3:] == ["flashinfer_float_workspace", "flashinfer_int_workspace_w0",
                                       "flashinfer_plan_w0"]
    library = out / "model.cuda.so"
    symbols = subprocess.run(["nm", "-D", str(library)], capture_output=True, text=True).stdout
    for name in ("kiln_flashinfer_plan", "kiln_flashinfer_attend"):
        assert f"T __tvm_ffi_{name}" in symbols, name
    assert "libcudart" in symbols and "BatchPrefillWithPagedKVCacheRun" in subprocess.run(
        ["nm", "-C", str(library)], capture_output=True, text=True).stdout
    assert b"kiln_flashinfer_attend" in library.read_bytes()        # the entries call it by name
    # a process that cannot import torch or flashinfer loads the library and finds both functions
    check = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['flashinfer'] = None\n"
        "from kiln.targets.cuda import ensure_cuda_loader\n"
        "ensure_cuda_loader()\n"
        "from kiln.runtime.tvm_bridge import library_function\n"
        f"for name in ('kiln_flashinfer_plan', 'kiln_flashinfer_attend'):\n"
        f"    assert library_function({str(library)!r}, name) is not None, name\n"
        "print('resolved')\n")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert proc.returncode == 0 and "resolved" in proc.stdout, proc.stderr[-3000:]


@needs_build_tools
def test_a_second_compile_builds_no_flashinfer_object(flashinfer_artifact, tmp_path):
    model, _, cache, _ = flashinfer_artifact
    objects = {p: p.stat().st_mtime_ns for p in cache.rglob("*.o")}
    # the causal paged kernels, FlashInfer's plan/run, kiln's binding; and the sm_90 linears' Hopper GEMM
    assert len([p for p in objects if "flashinfer" in p.parts]) == 3, sorted(objects)
    assert {p.parent.name for p in objects if "flashinfer" not in p.parts} == {"hopper_gemm"}, sorted(objects)
    compile_flashinfer(model, tmp_path / "again", cache)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.o")} == objects
