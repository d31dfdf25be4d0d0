"""A cuda artifact is built on this machine (no GPU): its library holds compiled kernels for every kernel listed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_artifact_is_built_with_its_kernels(make_model, tmp_path):
    out = tmp_path / "cuda"
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(make_model("llama")), "--target", "cuda",
                           "--arch", "sm_80", "-o", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == {**manifest["target"], "name": "cuda", "arch": "sm_80", "device": "cuda"}
    assert manifest["dtype"] == "float16"
    library = (out / "model.cuda.so").read_bytes()
    device_kernels = [k for k in manifest["kernels"] if k != "shape_func"]   # shape_func runs on the host
    for name in ("paged_attention", "kv_append", "rms_norm", "rope", "linear", "silu"):
        assert any(name in k for k in device_kernels), (name, device_kernels)
    for name in device_kernels:
        assert f"{name}_kernel".encode() in library, f"{name} has no compiled kernel in the library"
    assert b"__global__" not in library        # a binary (fatbin from nvcc), not CUDA source to JIT later
    assert b"sm_80" in library
