"""kiln's decode GEMV (codegen/kernels/gpu/gemv.py) at the memory's speed: each kernel's weight GB/s against the
device's copy rate, beside torch.matmul (cuBLAS) on the same device, and the tuning table.

    python bench/gemv_gpu.py build OUT [--arch sm_90] [--tests-only]     (here: TVM's compiler)
    python bench/gemv_gpu.py run OUT [--m 1 8] [--write-table FILE]      (the GPU machine)

`build` compiles, for every Llama-3.1-8B and Llama-3.2-1B linear in bf16 and q4 (groups of 32), one
kernel per candidate (rows a block x threads, codegen/kernels/gpu/gemv.py) and one with the compiler's present
choice ("default"), plus the small kernels tests/gpu/test_gemv.py checks (every format, bias and
residual, the gated activation), into OUT/gemv_kernels.so with OUT/kernels.json. `run` needs only
TVM's runtime and torch: weights rotated through copies that exceed the L2 cache, median of
CUDA-event timings; --write-table writes the fastest candidate per shape, format and batch bucket.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_gpu import SHAPES, copy_rate, kernel_bench_main, reference, timed  # noqa: E402

FORMATS = (("float", 0), ("q4", 32))                  # what the bench times: bf16 and q4 weights
# 96 outputs: one row a block; 1056 inputs: 132 bf16 chunks (33 q4 ones) a row over 64 threads, a
# split that does not divide
TEST_SHAPES = [(256, 512), (96, 1056)]
TEST_FORMATS = (("float", 0), ("q8", 0), ("fp8", 0), ("q4", 32), ("q4", 128), ("q4a", 32), ("q4k", 32))
TEST_ROWS = (1, 3, 4, 5, 8, 9, 15)


def _spec(n, k, dtype, weight, group, bias, residual, label, configs, activation=None) -> dict:
    suffix = ("_bias" if bias else "") + ("_residual" if residual else "") + (f"_{activation}" if activation else "")
    form = "" if weight == "float" else f"_{weight}{group or ''}"
    return {"name": f"gemv_{dtype}{form}_{n}x{k}_{label}{suffix}", "n": n, "k": k, "dtype": dtype, "weight": weight,
            "group": group, "bias": bias, "residual": residual, "activation": activation, "label": label,
            "configs": [[rows, c.name] for rows, c in configs]}


def kernel_specs(tests_only: bool, arch: str = "sm_90") -> list[dict]:
    from kiln.codegen.kernels.gpu.gemv_source import GemvConfig
    from kiln.codegen.kernels.gpu.gemv_tuning import CANDIDATE_ROWS, CANDIDATE_THREADS, default_configs
    from kiln.selection.shapes import gemv_takes, stored_dtype
    specs = []
    shapes = [] if tests_only else [s for group in SHAPES.values() for s in group]
    for n, k in shapes:
        for weight, group in FORMATS:
            for rows in CANDIDATE_ROWS:
                for threads in CANDIDATE_THREADS:
                    if n % rows == 0:
                        configs = [(1, GemvConfig(rows, threads, 1)), (0, GemvConfig(rows, threads, 8))]
                        specs.append(_spec(n, k, "bfloat16", weight, group, False, False, f"r{rows}t{threads}",
                                           configs))
            specs.append(_spec(n, k, "bfloat16", weight, group, False, False, "default",
                               default_configs(n, k, weight, False, arch, group)))
    for n, k in TEST_SHAPES:
        for dtype in ("bfloat16", "float16"):
            for weight, group in TEST_FORMATS:
                if not gemv_takes(dtype, stored_dtype(weight, dtype), n, k, weight, group):
                    continue
                for bias in (False, True):
                    specs.append(_spec(n, k, dtype, weight, group, bias, bias, "default",
                                       default_configs(n, k, weight, False, arch, group)))
                specs.append(_spec(n, k, dtype, weight, group, False, False, "default",
                                   default_configs(n, k, weight, True, arch, group), "silu" if weight != "q8" else "gelu_tanh"))
    return specs


def build(out: Path, arch: str, tests_only: bool) -> None:
    from kiln.targets.cuda import make_target
    target = make_target(arch)          # before TVM loads: else the module holds CUDA source, not a fatbin
    import tvm

    from kiln.codegen.kernels.gpu.gemv import gemv_kernel
    from kiln.codegen.kernels.gpu.gemv_source import GemvConfig
    specs = kernel_specs(tests_only, arch)
    funcs = {}
    for spec in specs:
        configs = [(rows, GemvConfig(*map(int, name[1:].replace("t", " ").replace("b", " ").split())))
                   for rows, name in spec["configs"]]
        func, _ = gemv_kernel(spec["n"], spec["k"], spec["dtype"], spec["bias"], spec["residual"], spec["weight"],
                              spec["group"], spec["activation"], configs)
        funcs[spec["name"]] = func.with_attr("global_symbol", spec["name"])
    with target.tvm_target():
        library = tvm.tirx.build(tvm.IRModule(funcs), target=target.tvm_target())
    out.mkdir(parents=True, exist_ok=True)
    library.export_library(str(out / "gemv_kernels.so"))
    if b"__global__" in (out / "gemv_kernels.so").read_bytes():
        raise SystemExit("the kernels were kept as CUDA source, not compiled: TVM loaded before kiln's CUDA loader")
    (out / "kernels.json").write_text(json.dumps({"arch": arch, "kernels": specs}, indent=1))
    print(f"{len(specs)} kernels for {arch} in {out / 'gemv_kernels.so'}")


def q4_weight(torch, n: int, k: int, group: int, gen):
    """(packed nibbles [n, k / 2], fp16 scales [k / group, n], float32 values)."""
    nibbles = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    scale = (torch.rand(k // group, n, device="cuda", generator=gen) * 0.01 + 1e-3).half()
    return packed, scale, (nibbles.float() - 8) * scale.float().repeat_interleave(group, dim=0).T


def run(out: Path, batches: list[int], write_table: Path | None, reps: int) -> None:
    import torch
    import tvm

    from kiln.runtime.tvm_bridge import enable_cuda_runtime
    enable_cuda_runtime()
    meta = json.loads((out / "kernels.json").read_text())
    library = tvm.runtime.load_module(str(out / "gemv_kernels.so"))
    rate = copy_rate(torch)
    print(f"# {torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s, kernels for {meta['arch']}\n")
    print("| N×K | weights | M | kernel | µs | weight GB/s | of copy rate | cuBLAS bf16 µs | max rel. err |")
    print("|---|---|---|---|---|---|---|---|---|")
    specs = [s for s in meta["kernels"] if (s["n"], s["k"]) not in [tuple(t) for t in TEST_SHAPES]]
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in sorted({(s["n"], s["k"]) for s in specs}, key=lambda s: -s[0] * s[1]):
        for weight, group in FORMATS:
            nbytes = n * k * 2 if weight == "float" else n * k // 2 + n * k // group * 2
            copies = max(2, -(-(256 << 20) // nbytes))
            if weight == "float":
                ws = [[torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02]
                      for _ in range(copies)]
                values = ws[0][0].float()
            else:
                made = [q4_weight(torch, n, k, group, gen) for _ in range(copies)]
                ws, values = [[p, s] for p, s, _ in made], made[0][2]
            dense = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2)]
            for m in batches:
                x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                want = reference(x, values, None, None).float()
                cublas = timed(torch, lambda i: torch.matmul(x, dense[i % 2].T), reps)
                for spec in [s for s in specs if (s["n"], s["k"], s["weight"]) == (n, k, weight)]:
                    func = library[spec["name"]]
                    func(x, *ws[0], y)
                    torch.cuda.synchronize()
                    err = ((y.float() - want).abs().max() / want.abs().max()).item()
                    seconds = timed(torch, lambda i: func(x, *ws[i % copies], y), reps)
                    results.append({"n": n, "k": k, "weight": weight, "group": group, "m": m, "kernel": spec["label"],
                                    "seconds": seconds, "error": err})
                    print(f"| {n}×{k} | {weight}{group or ''} | {m} | {spec['label']} | {seconds * 1e6:.1f} | "
                          f"{nbytes / seconds / 1e9:.0f} | {nbytes / seconds / rate:.0%} | {cublas * 1e6:.1f} | "
                          f"{err:.1e} |", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if write_table:
        write_tuning_table(results, meta["arch"], write_table)


def write_tuning_table(results: list[dict], arch: str, path: Path) -> None:
    """The fastest correct candidate per (shape, format, batch): codegen/kernels/gpu/gemv.py's table."""
    table = json.loads(path.read_text()) if path.exists() else {}
    for n, k, weight, group in sorted({(r["n"], r["k"], r["weight"], r["group"]) for r in results}):
        for m in sorted({r["m"] for r in results}):
            rows = [r for r in results if (r["n"], r["k"], r["weight"], r["m"]) == (n, k, weight, m)
                    and r["kernel"] != "default" and r["error"] < 2e-2]
            if rows:
                best = min(rows, key=lambda r: r["seconds"])["kernel"]
                form = weight + (str(group) if group else "")
                table[f"{arch} {form} {n}x{k} m{m}"] = best
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {len(table)} entries to {path}")


def main() -> None:
    kernel_bench_main(__doc__, build, run, "tests/gpu/test_gemv.py", [1, 8])


if __name__ == "__main__":
    main()
