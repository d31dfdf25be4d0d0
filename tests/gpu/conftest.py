"""GPU tests: they run where a CUDA device is visible and skip cleanly everywhere else.

Artifacts come from KILN_GPU_BUNDLE (a folder made by tests/gpu/make_bundle.py on
a build machine: a GPU machine may have only TVM's runtime) or are compiled here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cuda_arch() -> tuple[str | None, str]:
    """(arch, why not): the visible GPU's arch, or None and the reason there is none."""
    try:
        import tvm
        from kiln.runtime.tvm_bridge import enable_cuda_runtime
        enable_cuda_runtime()
        dev = tvm.cuda(0)
        if not dev.exist:
            return None, "no CUDA device visible to TVM"
        return "sm_" + dev.compute_version.replace(".", ""), ""
    except Exception as e:  # no CUDA runtime in this TVM build, or no driver
        return None, f"no CUDA device: {e}"


ARCH, WHY_NOT = _cuda_arch()


def pytest_collection_modifyitems(config, items):
    if ARCH is None:
        skip = pytest.mark.skip(reason=WHY_NOT)
        for item in items:
            if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_bundle(make_model, tmp_path_factory) -> Path:
    """A folder with model/ (HF) and cuda-<dtype>/ artifacts for the tiny GQA Llama."""
    if os.environ.get("KILN_GPU_BUNDLE"):
        return Path(os.environ["KILN_GPU_BUNDLE"])
    out = tmp_path_factory.mktemp("gpu-bundle")
    subprocess.run([sys.executable, str(Path(__file__).with_name("make_bundle.py")), str(out),
                    "--model", str(make_model("llama")), "--arch", ARCH], check=True)
    return out


@pytest.fixture(scope="session")
def gpu_family(make_model, tmp_path_factory):
    """gpu_family(family) -> a folder with model/ and cuda-float32/ for that tiny family: from
    KILN_GPU_BUNDLE's families/ when make_bundle.py --families put it there, else compiled here."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        bundled = Path(os.environ.get("KILN_GPU_BUNDLE", "/nonexistent")) / "families" / family
        if (bundled / "cuda-float32" / "manifest.json").exists():
            return bundled
        if family not in built:
            out = tmp_path_factory.mktemp(f"gpu-{family}")
            subprocess.run([sys.executable, str(Path(__file__).with_name("make_bundle.py")), str(out),
                            "--model", str(make_model(family)), "--arch", ARCH, "--variants", "float32"],
                           check=True)
            built[family] = out
        return built[family]
    return get


