"""rocm and metal artifacts are built on this machine (no GPU): their libraries hold device code for every kernel.

rocm: an HSA code object (AMDGPU ELF) linked with ld.lld against ROCm's device bitcode.
metal: Metal Shading Language source inside an arm64 macOS dylib (linked with ld64.lld).
Each compile skips, naming what is missing, where the Debian tools are not installed (`make rocm-deps`).
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from kiln.errors import KilnError
from kiln.targets import metal, rocm

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

EM_AMDGPU, ABI_HSA_V5 = 224, 3


def compile_tiny(model_dir, out, *target_args):
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "compile", str(model_dir), *target_args, "-o", str(out)],
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "manifest.json").read_text())


def device_kernels(manifest) -> list[str]:
    kernels = manifest["kernels"]
    for name in ("paged_attention", "kv_append", "rms_norm"):
        assert name in kernels
    return kernels


def amdgpu_code_objects(library: bytes) -> list[bytes]:
    """The AMDGPU ELF images embedded in a host library (TVM packs device modules as blobs)."""
    found, i = [], 1
    while (i := library.find(b"\x7fELF", i)) != -1:
        if struct.unpack_from("<H", library, i + 18)[0] == EM_AMDGPU:
            shoff, = struct.unpack_from("<Q", library, i + 0x28)
            shentsize, shnum = struct.unpack_from("<HH", library, i + 0x3A)
            found.append(library[i:i + shoff + shentsize * shnum])
        i += 4
    return found


@pytest.mark.skipif(bool(rocm.missing_tools()), reason="; ".join(rocm.missing_tools()))
def test_rocm_artifact_holds_an_amdgpu_code_object(make_model, tmp_path):
    out = tmp_path / "rocm"
    m = compile_tiny(make_model("llama"), out, "--target", "rocm", "--arch", "gfx942")
    assert m["target"] == {**m["target"], "name": "rocm", "arch": "gfx942", "device": "rocm", "runs_here": False}
    assert m["dtype"] == "float16"
    (code_object,) = amdgpu_code_objects((out / "model.rocm.so").read_bytes())
    assert code_object[8] == ABI_HSA_V5                     # EI_ABIVERSION: code object v5, loadable by ROCm 5 and 6
    assert b"amdgcn-amd-amdhsa" in code_object and b"gfx942" in code_object
    for name in device_kernels(m):
        assert f"{name}_kernel.kd".encode() in code_object, f"{name} has no kernel descriptor in the code object"


@pytest.mark.skipif(metal.find_ld64() is None, reason="ld64.lld is missing (Debian: apt-get install lld-22)")
def test_metal_artifact_holds_msl_in_a_macos_library(make_model, tmp_path):
    out = tmp_path / "metal"
    m = compile_tiny(make_model("llama"), out, "--target", "metal")
    assert m["target"] == {**m["target"], "name": "metal", "arch": "m1", "device": "metal", "runs_here": False}
    assert "compiled by the Metal framework when the library is loaded" in m["target"]["note"]
    library = (out / "model.metal.so").read_bytes()
    magic, cputype = struct.unpack_from("<II", library)
    assert (magic, cputype) == (0xFEEDFACF, 0x0100000C)    # Mach-O 64-bit, arm64
    assert b"#include <metal_stdlib>" in library
    for name in device_kernels(m):
        assert f"kernel void {name}_kernel(".encode() in library, f"{name} has no Metal kernel in the library"


def test_bad_arch_and_missing_tools_fail_before_compiling(monkeypatch):
    with pytest.raises(KilnError, match="not supported"):
        rocm.make_target("gfx1100")
    with pytest.raises(KilnError, match="not supported"):
        metal.make_target("m9")
    monkeypatch.setattr(rocm, "find_lld", lambda: None)
    monkeypatch.setattr(rocm, "find_bitcode_dir", lambda: None)
    with pytest.raises(KilnError, match="missing ld.lld .*lld-22.*ocml.bc .*rocm-device-libs"):
        rocm.make_target("gfx90a")
    monkeypatch.setattr(metal, "find_ld64", lambda: None)
    with pytest.raises(KilnError, match="ld64.lld is missing .*lld-22"):
        metal.make_target(None)


def test_rocm_isa_bitcode_falls_back_within_the_family(tmp_path):
    for stem in ["ocml"] + [f"oclc_{o}" for o in rocm.OCLC_OPTIONS] + ["oclc_isa_version_90a",
                                                                        "oclc_isa_version_940",
                                                                        "oclc_isa_version_1030"]:
        (tmp_path / f"{stem}.bc").write_bytes(b"")
    assert rocm.bitcode_files("gfx942", tmp_path)[-1].endswith("oclc_isa_version_940.bc")
    assert rocm.bitcode_files("gfx90a", tmp_path)[-1].endswith("oclc_isa_version_90a.bc")
