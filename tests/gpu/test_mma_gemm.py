"""kiln's tensor-core GEMM (codegen/kernels/gpu/mma_gemm.py) on the GPU against torch's float32 product.

Every candidate tile of selection/tiles.py, and the compiler's choice by rows, in bf16 and fp16,
plain and with bias and residual; q8, fp8 and q4 (groups of 32 and 128) weights on three tiles; at
the row counts that cross the tiles' edges (1, 7, 16, 17, 64, 100, 1000). On sm_90 the compiler's
choice is the Hopper one (mma's tiles, then CUTLASS's wgmma GEMM from 65 rows), and CUTLASS's GEMM
alone runs every row count over shapes that leave partial tiles at both edges. The kernels come from
KILN_GEMM_KERNELS (`bench/gemm_gpu.py build DIR --tests-only` on a build machine) or are built here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from gemm_gpu import TEST_ROWS, default_specs, hopper_specs, kernel_specs, reference  # noqa: E402
from kernel_builds import kernel_folder  # noqa: E402

# one rounding of the output is 2^-8 (bf16) or 2^-11 (fp16) of its size; the sums' order differs
# from torch's, which moves a value across a rounding edge now and then
TOLERANCE = {"bfloat16": 1.6e-2, "float16": 2e-3}
# the kernels a build holds for every arch (the default's tiles differ by arch, not its name)
CASES = sorted({(s["tile"], s["weight"], s["group"], s["bias"])
                for s in kernel_specs(tests_only=True) + default_specs("sm_90", tests_only=True)
                if not s.get("experts") and not s.get("activation")})


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    import tvm

    from kiln.runtime.tvm_bridge import enable_cuda_runtime
    enable_cuda_runtime()
    arch = "sm_" + tvm.cuda(0).compute_version.replace(".", "")
    folder = kernel_folder("KILN_GEMM_KERNELS", "gemm_gpu.py", arch, tmp_path_factory)
    meta = json.loads((folder / "kernels.json").read_text())
    return tvm.runtime.load_module(str(folder / "gemm_kernels.so")), meta["kernels"]


def arg(torch, t):
    """A kernel argument: torch tensors pass by DLPack, but float8 ones may not (older exporters), so
    those go as TVM views of their bytes."""
    if t.dtype != torch.float8_e4m3fn:
        return t
    import tvm
    raw = tvm.runtime.tensor(t.view(torch.uint8).cpu().numpy(), tvm.cuda(0))
    return raw._create_view(tuple(t.shape), "float8_e4m3fn")


def check(torch, y, want, dtype: str, what: str) -> None:
    got = y.float()
    assert torch.isfinite(got).all(), f"{what}: rows left unwritten"
    err = ((got - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < TOLERANCE[dtype], f"{what}: max error {err:.2e} of the largest output"


def weights_of(torch, weight: str, group: int, n: int, k: int, dtype, gen):
    """(the kernel's weight tensors, W's float32 values, per-output scale or None); float weights
    in the activations' dtype."""
    if weight == "float":
        w = torch.randn(n, k, device="cuda", generator=gen).to(dtype) * 0.05
        return [w], w, None
    return stored_weight(torch, weight, group, n, k, gen)


def stored_weight(torch, weight: str, group: int, n: int, k: int, gen):
    """(the kernel's weight tensors, W's float32 values, per-output scale or None) for q8, fp8, q4, q4a, q4k."""
    if weight == "q8":
        levels = torch.randint(-127, 128, (n, k), device="cuda", generator=gen, dtype=torch.int8)
        scale = torch.rand(n, device="cuda", generator=gen) * 0.01 + 1e-3
        return [levels, scale], levels.float(), scale
    if weight == "fp8":
        values = (torch.randn(n, k, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda", generator=gen) * 0.01 + 1e-3
        return [values, scale], values.float(), scale
    if weight in ("q4a", "q4k"):
        return minimum_weight(torch, weight, group, n, k, gen)
    assert weight == "q4", weight
    nibbles = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)          # input k in byte k / 2, odd k high
    scale = (torch.rand(k // group, n, device="cuda", generator=gen) * 0.01 + 1e-3).half()
    values = (nibbles.float() - 8) * scale.float().repeat_interleave(group, dim=0).T
    return [packed, scale], values, None


def minimum_weight(torch, weight: str, group: int, n: int, k: int, gen):
    """q4a or q4k as ir/quant.py stores them, with W's float32 values: tests/test_mma_emulated.py's, on
    the device."""
    import numpy as np
    from test_mma_emulated import stored
    seed = int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda"))
    (packed, table), values, _ = stored(np.random.default_rng(seed), weight, group, (n, k))
    return [torch.from_numpy(packed).cuda(), torch.from_numpy(table).cuda()], torch.from_numpy(values).cuda(), None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tile,weight,group,epilogue", CASES)
def test_tile_matches_the_float32_product(kernels, dtype, tile, weight, group, epilogue):
    import torch
    library, specs = kernels
    torch_dtype = getattr(torch, dtype)
    chosen = [s for s in specs if (s["dtype"], s["bias"], s["tile"], s["weight"], s["group"])
              == (dtype, epilogue, tile, weight, group) and not s.get("experts") and not s.get("activation")]
    assert chosen, f"the kernel library lacks {dtype} {weight}{group or ''} {tile} (bench/gemm_gpu.py build)"
    for spec in chosen:
        n, k = spec["n"], spec["k"]
        func = library[spec["name"]]
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        weights, values, scale = weights_of(torch, weight, group, n, k, torch_dtype, gen)
        bias = torch.randn(n, device="cuda", generator=gen).to(torch_dtype) if epilogue else None
        for m in TEST_ROWS:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch_dtype)
            residual = torch.randn(m, n, device="cuda", generator=gen).to(torch_dtype) if epilogue else None
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch_dtype)
            func(x, *[arg(torch, t) for t in weights], *[t for t in (bias, residual) if t is not None], y)
            torch.cuda.synchronize()
            want = reference(x, values, bias, residual, scale).float()
            check(torch, y, want, dtype, f"{spec['name']} at M={m}")


HOPPER_CASES = sorted({(s["n"], s["k"], s["bias"], s["weight"], s["group"])
                       for s in hopper_specs("sm_90", tests_only=True)})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n,k,epilogue,weight,group", HOPPER_CASES)
def test_hopper_gemm_matches_the_float32_product(kernels, dtype, n, k, epilogue, weight, group):
    """CUTLASS's Hopper GEMM alone at every row count (codegen/kernels/gpu/hopper_gemm.cu: operands
    swapped, the bias a per-row broadcast, the residual its source), over whole and partial tiles;
    q4 weights as kiln stores them, widened in registers with their scales and zeros (-8 scales)."""
    import torch
    library, specs = kernels
    torch_dtype = getattr(torch, dtype)
    spec = next((s for s in specs if s.get("hopper") and s["tile"] != "default"
                 and (s["dtype"], s["n"], s["k"], s["bias"], s["weight"]) == (dtype, n, k, epilogue, weight)), None)
    if spec is None:
        pytest.skip("the kernel library has no Hopper GEMM: it was built for this GPU's arch, which is not sm_90")
    func = library[spec["name"]]
    gen = torch.Generator(device="cuda").manual_seed(n * k)
    stored, values, _ = weights_of(torch, weight, group, n, k, torch_dtype, gen)
    if weight == "q4":
        stored.append(stored[1] * -8)           # CUTLASS's zeros (selection/layouts.py Q4_ZEROS)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch_dtype) if epilogue else None
    for m in TEST_ROWS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch_dtype)
        residual = torch.randn(m, n, device="cuda", generator=gen).to(torch_dtype) if epilogue else None
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch_dtype)
        func(x, *stored, *[t for t in (bias, residual) if t is not None], y)
        torch.cuda.synchronize()
        check(torch, y, reference(x, values, bias, residual).float(), dtype, f"{spec['name']} at M={m}")


EXPERT_CASES = sorted({(s["tile"], s["weight"], s["group"], s["gather"])
                       for s in kernel_specs(tests_only=True) if s.get("experts")})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tile,weight,group,gather", EXPERT_CASES)
def test_experts_kernel_matches_each_rows_expert(kernels, dtype, tile, weight, group, gather):
    """A mixture of experts' grouped GEMM: rows sorted by expert (some experts absent, one block's
    rows spanning several), gathered rows read x[row_token], weighted rows are scaled after rounding."""
    import torch
    library, specs = kernels
    torch_dtype = getattr(torch, dtype)
    spec = next(s for s in specs if s.get("experts") and (s["dtype"], s["tile"], s["weight"], s["group"], s["gather"])
                == (dtype, tile, weight, group, gather))
    n, k, experts = spec["n"], spec["k"], spec["experts"]
    func = library[spec["name"]]
    gen = torch.Generator(device="cuda").manual_seed(7)
    per_expert = [weights_of(torch, weight, group, n, k, torch_dtype, gen) for _ in range(experts)]
    weights = [torch.stack([p[0][i] for p in per_expert]) for i in range(len(per_expert[0][0]))]
    values, scales = [p[1] for p in per_expert], [p[2] for p in per_expert]
    for m in TEST_ROWS:
        row_expert = torch.sort(torch.randint(0, experts - 1, (m,), device="cuda", generator=gen)).values.int()
        tokens = max(1, m // 2)
        row_token = torch.randint(0, tokens, (m,), device="cuda", generator=gen).int()
        row_weight = torch.rand(m, device="cuda", generator=gen)
        x = torch.randn(tokens if gather else m, k, device="cuda", generator=gen).to(torch_dtype)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch_dtype)
        args = [x] + ([row_token] if gather else []) + [row_expert, *[arg(torch, t) for t in weights]] \
            + ([] if gather else [row_weight]) + [y]
        func(*args)
        torch.cuda.synchronize()
        rows = x[row_token.long()] if gather else x
        want = torch.empty(m, n, device="cuda")
        for e in range(experts):
            mine = row_expert == e
            out = reference(rows[mine], values[e], None, None, scales[e])
            if not gather:
                out = (out.float() * row_weight[mine, None]).to(torch_dtype)
            want[mine] = out.float()
        check(torch, y, want, dtype, f"{spec['name']} at M={m}")


GATED_CASES = sorted({(s["tile"], s["weight"], s["group"], s["activation"])
                      for s in kernel_specs(tests_only=True) if s.get("activation")})


def activation_of(torch, name: str, gate):
    if name == "silu":
        return gate / (1 + torch.exp(-gate))
    return 0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tile,weight,group,activation", GATED_CASES)
def test_gated_kernel_applies_the_activation(kernels, dtype, tile, weight, group, activation):
    """gate/up weights stored 'gated' (rows interleaved); y = act(gate) * up, half as wide, each
    step rounded as ir/ops.py's swiglu / geglu."""
    import torch

    from kiln.selection.layouts import GATED, GATED_COLUMNS, apply_layout
    library, specs = kernels
    torch_dtype = getattr(torch, dtype)
    spec = next(s for s in specs if (s["dtype"], s["tile"], s["weight"], s["group"], s.get("activation"))
                == (dtype, tile, weight, group, activation))
    n, k = spec["n"], spec["k"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    weights, values, scale = weights_of(torch, weight, group, n, k, torch_dtype, gen)

    def laid_out(t, layout):           # the layout in NumPy, float8 through its bytes
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        out = torch.from_numpy(apply_layout(layout, raw.cpu().numpy())).cuda()
        return out.view(t.dtype) if t.dtype == torch.float8_e4m3fn else out
    if torch_dtype == torch.bfloat16 and weights[0].dtype == torch.bfloat16:
        first = weights[0].view(torch.int16)             # NumPy has no bf16: move its bits
        gated = [laid_out(first, GATED).view(torch.bfloat16)]
    else:
        gated = [laid_out(weights[0], GATED)]
    gated += [laid_out(t, GATED_COLUMNS) for t in weights[1:]]
    for m in TEST_ROWS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch_dtype)
        y = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch_dtype)
        library[spec["name"]](x, *[arg(torch, t) for t in gated], y)
        torch.cuda.synchronize()
        full = reference(x, values, None, None, scale).float()
        gate, up = full[:, :n // 2], full[:, n // 2:]
        want = (activation_of(torch, activation, gate).to(torch_dtype).float() * up).to(torch_dtype).float()
        check(torch, y, want, dtype, f"{spec['name']} at M={m}")
