"""Where tests/gpu's kernel tests find their kernels (tests/gpu/test_mma_gemm.py, test_gemv.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def kernel_folder(variable: str, script: str, arch: str, tmp_path_factory) -> Path:
    """The kernels a kernel test runs: the folder `variable` names (built by `bench/SCRIPT build
    DIR --tests-only` on a build machine), else built here by the script, which needs TVM's
    compiler. A GPU machine with TVM's runtime alone and no folder named skips: the tool is absent."""
    if os.environ.get(variable):
        return Path(os.environ[variable])
    import tvm
    if not (Path(tvm.__file__).parent / "lib" / "libtvm_compiler.so").exists():
        pytest.skip(f"{variable} names no prebuilt kernels and this TVM has no compiler to build them")
    folder = tmp_path_factory.mktemp(Path(script).stem)
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "bench" / script), "build", str(folder),
                    "--arch", arch, "--tests-only"], check=True)
    return folder
