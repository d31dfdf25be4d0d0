"""kiln's decode GEMV (codegen/kernels/gpu/gemv.py) on the GPU against torch's float32 product.

Every weight format (bf16/fp16, q8, fp8, q4 in groups of 32 and 128), plain, with bias and
residual, and gated (act(gate) * up from rows stored interleaved), on a shape whose blocks hold
4 rows and one of a row each whose reduction splits raggedly over its threads, at 1 to 15 rows of x
(the batch buckets' edges). The kernels come from KILN_GEMV_KERNELS (`bench/gemv_gpu.py build DIR
--tests-only` on a build machine) or are built here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_gpu import reference  # noqa: E402
from gemv_gpu import TEST_ROWS, TEST_SHAPES, kernel_specs  # noqa: E402
from kernel_builds import kernel_folder  # noqa: E402
from test_mma_gemm import arg, check, weights_of  # noqa: E402

SPECS = kernel_specs(tests_only=True)
ACTIVATIONS = {"silu": lambda torch, g: torch.nn.functional.silu(g),
               "gelu_tanh": lambda torch, g: torch.nn.functional.gelu(g, approximate="tanh")}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    import tvm

    from kiln.runtime.tvm_bridge import enable_cuda_runtime
    enable_cuda_runtime()
    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    folder = kernel_folder("KILN_GEMV_KERNELS", "gemv_gpu.py", arch, tmp_path_factory)
    return tvm.runtime.load_module(str(folder / "gemv_kernels.so"))


@pytest.mark.parametrize("spec", [s for s in SPECS if (s["n"], s["k"]) in TEST_SHAPES], ids=lambda s: s["name"])
def test_gemv_matches_the_float32_product(kernels, spec):
    import torch
    dtype, n, k, weight, group = getattr(torch, spec["dtype"]), spec["n"], spec["k"], spec["weight"], spec["group"]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weights, values, scale = weights_of(torch, weight, group, n, k, dtype, gen)
    if spec["activation"]:          # stored 'gated' (selection/layouts.py): gate and up rows interleaved
        order = torch.stack([torch.arange(n // 2), torch.arange(n // 2) + n // 2], dim=1).reshape(-1).cuda()
        weights = [weights[0][order]] + [s[:, order] if s.dim() == 2 else s[order] for s in weights[1:]]
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if spec["bias"] else None
    func = kernels[spec["name"]]
    for m in TEST_ROWS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(dtype) if spec["residual"] else None
        y = torch.full((m, n // 2 if spec["activation"] else n), float("nan"), device="cuda", dtype=dtype)
        func(x, *[arg(torch, t) for t in weights], *[t for t in (bias, residual) if t is not None], y)
        torch.cuda.synchronize()
        want = reference(x, values, bias, residual, scale)
        if spec["activation"]:
            gate, up = want[:, :n // 2].float(), want[:, n // 2:].float()
            want = (ACTIVATIONS[spec["activation"]](torch, gate).to(dtype).float() * up).to(dtype)
        check(torch, y, want.float(), spec["dtype"], f"{spec['name']} at M={m}")
