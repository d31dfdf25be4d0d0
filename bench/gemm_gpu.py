"""kiln's tensor-core GEMM tiles beside torch.matmul (cuBLAS), and the tuning table from the winners.

    python bench/gemm_gpu.py build OUT [--arch sm_90] [--tests-only]      (here: TVM's compiler)
    python bench/gemm_gpu.py run OUT [--m 16 64 256 1024 4096] [--write-table FILE]   (the GPU machine)

`build` compiles, for every Llama-3.1-8B and Llama-3.2-1B linear (bf16, no bias), one kernel per
candidate tile of selection/tiles.py and one with the compiler's present choice by rows
("default"), plus the small kernels tests/gpu/test_mma_gemm.py checks (bias, residual, bf16 and
fp16), into OUT/gemm_kernels.so with OUT/kernels.json. For sm_90 it adds CUTLASS's Hopper GEMM
(codegen/kernels/gpu/hopper_gemm.py) in every candidate tile of HOPPER_CANDIDATES, called for every
row count, and tests/gpu/test_mma_gemm.py's Hopper kernels (the default tile over odd shapes); the
default is then the compiler's Hopper choice (mma's tiles up to HOPPER_FROM rows, wgmma above).
`run` needs only TVM's runtime and torch: each kernel and torch.matmul on the same device, weights
rotated through copies that exceed the L2 cache, median of CUDA-event timings. It prints TFLOP/s,
the share of cuBLAS and, for M <= 64, the weight bytes' share of the copy rate; --write-table writes
the fastest mma tile per shape and rows bucket in selection/tiles.json's format.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (N, K) of each linear: fused q/k/v, o, fused gate/up, down (and the 1B's)
SHAPES = {"llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
          "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]}
TEST_SHAPES = [(256, 512), (512, 256)]          # small shapes every candidate tile divides
TEST_ROWS = (1, 7, 16, 17, 64, 100, 1000)
QUANTISED = (("q8", 0), ("fp8", 0), ("q4", 32), ("q4", 128))     # weight formats the tests check
MINIMUM_FORMATS = (("q4a", 32), ("q4k", 32))     # with group minimums: linears only (experts are q4)
# the Hopper GEMM's test shapes besides TEST_SHAPES: outputs not a whole number of 128-wide tiles,
# inputs not of 64-wide ones (TMA fills the edges)
HOPPER_TEST_SHAPES = [(520, 264), (136, 1032)]
HOPPER_Q4_GROUP = 128                            # kiln's q4 group that CUTLASS's mixed-input loop takes
HOPPER_Q4_TEST_SHAPES = [(512, 256), (520, 384)]
EXPERTS = 4


def kernel_specs(tests_only: bool) -> list[dict]:
    """Every kernel `build` makes: name, shape, dtype, epilogue, tiles by rows."""
    from kiln.selection.tiles import CANDIDATES
    specs = []

    def add(n, k, dtype, bias, residual, label, tiles, weight="float", group=0, activation=None):
        suffix = ("_bias" if bias else "") + ("_residual" if residual else "") + (f"_{activation}" if activation else "")
        form = "" if weight == "float" else f"_{weight}{group or ''}"
        specs.append({"name": f"gemm_{dtype}{form}_{n}x{k}_{label}{suffix}", "n": n, "k": k, "dtype": dtype,
                      "bias": bias, "residual": residual, "tile": label, "weight": weight, "group": group,
                      "activation": activation, "tiles": [[rows, tile.name] for rows, tile in tiles]})
    shapes = [] if tests_only else [s for group in SHAPES.values() for s in group]
    for n, k in shapes:
        for tile in CANDIDATES:
            if n % tile.bn == 0 and k % tile.bk == 0:
                add(n, k, "bfloat16", False, False, tile.name, [(0, tile)])
    narrow = next(t for t in CANDIDATES if t.bk == 32)
    for n, k in TEST_SHAPES:
        for dtype in ("bfloat16", "float16"):
            for bias, residual in ((False, False), (True, True)):
                for tile in CANDIDATES:
                    add(n, k, dtype, bias, residual, tile.name, [(0, tile)])
            for weight, group in QUANTISED + MINIMUM_FORMATS:
                for tile in (CANDIDATES[0], narrow, CANDIDATES[-4]):
                    add(n, k, dtype, True, True, tile.name, [(0, tile)], weight, group)
            # a gated MLP's gate/up (weights stored 'gated'), its activation in the epilogue
            for (weight, group), activation in zip((("float", 0),) + QUANTISED, ("silu", "gelu_tanh") * 3):
                add(n, k, dtype, False, False, narrow.name, [(0, narrow)], weight, group, activation)
    # a mixture of experts' grouped GEMMs (EXPERTS experts, rows sorted by expert): gathered rows
    # without and weighted rows with each weight format, on a small-row tile and a large one
    for dtype in ("bfloat16", "float16"):
        for weight, group in (("float", 0),) + QUANTISED:
            for tile in (CANDIDATES[0], CANDIDATES[-4]):
                for gather in (True, False):
                    n, k = TEST_SHAPES[0]
                    form = "" if weight == "float" else f"_{weight}{group or ''}"
                    rows = "gather" if gather else "weighted"
                    specs.append({"name": f"experts_{dtype}{form}_{n}x{k}_{tile.name}_{rows}",
                                  "n": n, "k": k, "dtype": dtype, "bias": False, "residual": False, "tile": tile.name,
                                  "weight": weight, "group": group, "tiles": [[0, tile.name]], "experts": EXPERTS,
                                  "gather": gather, "weighted": not gather})
    return specs


def default_specs(arch: str, tests_only: bool) -> list[dict]:
    """The compiler's present choice by rows for each shape (what an artifact built now runs)."""
    from kiln.selection.shapes import wgmma_takes
    from kiln.selection.tiles import hopper_tiles, tiles_for
    out = []
    shapes = [(n, k, "bfloat16", False, False) for group in SHAPES.values() for n, k in group] if not tests_only else []
    shapes += [(n, k, d, True, True) for n, k in TEST_SHAPES for d in ("bfloat16", "float16")]
    for n, k, dtype, bias, residual in shapes:
        hopper = wgmma_takes(arch, dtype, dtype, n, k)
        tiles = (hopper_tiles if hopper else tiles_for)(arch, dtype, n, k)
        suffix = ("_bias" if bias else "") + ("_residual" if residual else "")
        out.append({"name": f"gemm_{dtype}_{n}x{k}_default{suffix}", "n": n, "k": k, "dtype": dtype, "bias": bias,
                    "residual": residual, "tile": "default", "weight": "float", "group": 0, "hopper": hopper,
                    "tiles": [[r, t.name] for r, t in tiles]})
    return out


def hopper_specs(arch: str, tests_only: bool) -> list[dict]:
    """On sm_90: the Hopper GEMM alone (every row count) in each candidate tile for the Llama shapes,
    bf16 and q4 (groups of 128; beside them mma's q4 tiles and the compiler's q4 choice), and in the
    default tile for the tests' shapes, plain and with bias and residual."""
    from kiln.selection.shapes import HOPPER_ARCHS
    from kiln.selection.tiles import HOPPER_CANDIDATES, HOPPER_DEFAULTS, hopper_tiles, tiles_for
    if arch not in HOPPER_ARCHS:
        return []
    specs = []

    def add(n, k, dtype, epilogue, label, tiles, weight="float", hopper=True):
        suffix = "_bias_residual" if epilogue else ""
        form, group = ("", 0) if weight == "float" else (f"_q4g{HOPPER_Q4_GROUP}", HOPPER_Q4_GROUP)
        specs.append({"name": f"gemm_{dtype}{form}_{n}x{k}_{label}{suffix}", "n": n, "k": k, "dtype": dtype,
                      "bias": epilogue, "residual": epilogue, "tile": label, "weight": weight, "group": group,
                      "hopper": hopper, "tiles": [[rows, t if isinstance(t, str) else t.name] for rows, t in tiles]})
    shapes = [] if tests_only else [s for group in SHAPES.values() for s in group]
    for n, k in shapes:
        for tile in HOPPER_CANDIDATES:
            add(n, k, "bfloat16", False, tile.name, [(0, tile)])
            add(n, k, "bfloat16", False, tile.name, [(0, tile)], "q4")
        add(n, k, "bfloat16", False, "default", hopper_tiles(arch, "bfloat16", n, k), "q4")
        add(n, k, "bfloat16", False, "mma", tiles_for(arch, "bfloat16", n, k), "q4", hopper=False)
    default = HOPPER_DEFAULTS[-1][1]
    for dtype in ("bfloat16", "float16"):
        for epilogue in (False, True):
            for n, k in TEST_SHAPES + HOPPER_TEST_SHAPES:
                add(n, k, dtype, epilogue, default, [(0, default)])
            for n, k in HOPPER_Q4_TEST_SHAPES:
                add(n, k, dtype, epilogue, default, [(0, default)], "q4")
    return specs


def build(out: Path, arch: str, tests_only: bool) -> None:
    from kiln.targets.cuda import make_target
    target = make_target(arch)
    import tvm

    from kiln.codegen.kernels.gpu import hopper_gemm
    from kiln.codegen.kernels.gpu.cuda_objects import cudart_link_options
    from kiln.codegen.kernels.gpu.mma_gemm import mma_experts_kernel, mma_linear_kernel, wgmma_linear_kernel
    from kiln.selection.tiles import parse_hopper_tile, parse_tile
    specs = kernel_specs(tests_only) + default_specs(arch, tests_only) + hopper_specs(arch, tests_only)
    funcs, variants = {}, set()
    for spec in specs:
        tiles = [(rows, parse_hopper_tile(name) if name.startswith("wg") else parse_tile(name))
                 for rows, name in spec["tiles"]]
        assert all(spec["n"] % t.bn == 0 and spec["k"] % t.bk == 0 for _, t in tiles if not spec.get("hopper")), spec
        if spec.get("hopper"):
            func, used = wgmma_linear_kernel(spec["n"], spec["k"], spec["dtype"], spec["bias"], spec["residual"], tiles,
                                             spec["weight"], spec["group"])
            variants.update(used)
        elif spec.get("experts"):
            func = mma_experts_kernel(spec["experts"], spec["n"], spec["k"], spec["dtype"], tiles, spec["weight"],
                                      spec["group"], spec["gather"], spec["weighted"])
        else:
            func, _ = mma_linear_kernel(spec["n"], spec["k"], spec["dtype"], spec["bias"], spec["residual"], tiles,
                                        spec["weight"], spec["group"], spec.get("activation"))
        funcs[spec["name"]] = func.with_attr("global_symbol", spec["name"])
    with target.tvm_target():
        library = tvm.tirx.build(tvm.IRModule(funcs), target=target.tvm_target())
    for static in hopper_gemm.static_libraries(variants):      # CUTLASS's objects (a minute of nvcc each, cached)
        library.import_module(static)
    out.mkdir(parents=True, exist_ok=True)
    library.export_library(str(out / "gemm_kernels.so"), options=cudart_link_options() if variants else None)
    (out / "kernels.json").write_text(json.dumps({"arch": arch, "kernels": specs}, indent=1))
    print(f"{len(specs)} kernels for {arch} in {out / 'gemm_kernels.so'}")


def reference(x, w, bias, residual, scale=None):
    """The epilogue of codegen/kernels/weight_format.py in torch: float32 sum, (* scale), + bias, round, + residual,
    round. `w`: float32 values (q4: level x group scale), `scale`: q8/fp8's per-output scale."""
    y = x.float() @ w.float().T
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if residual is None else (y.float() + residual.float()).to(x.dtype)


def q4_weight(torch, n: int, k: int, group: int):
    """kiln's q4 weight on the device: (nibbles [n, k / 2], scales [k / group, n] float16, CUTLASS's
    zeros = -8 scales, the float32 values (nibble - 8) x scale)."""
    nibbles = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)          # input k in byte k / 2, odd k high
    scale = (torch.rand(k // group, n, device="cuda") * 0.01 + 1e-3).half()
    values = (nibbles.float() - 8) * scale.float().repeat_interleave(group, dim=0).T
    return packed.contiguous(), scale, scale * -8, values


def copy_rate(torch) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 5."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() / statistics.median(times[1:])


def timed(torch, call, reps: int) -> float:
    """Median seconds of `call(i)` over reps (i selects the weight copy), after a warm-up."""
    for i in range(3):
        call(i)
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run(out: Path, rows: list[int], write_table: Path | None, reps: int) -> None:
    import torch
    import tvm

    from kiln.runtime.tvm_bridge import enable_cuda_runtime
    enable_cuda_runtime()
    meta = json.loads((out / "kernels.json").read_text())
    library = tvm.runtime.load_module(str(out / "gemm_kernels.so"))
    rate = copy_rate(torch)
    print(f"# {torch.cuda.get_device_name()}, copy rate {rate / 1e12:.2f} TB/s, kernels for {meta['arch']}\n")
    print("| N×K | M | kernel | µs | TFLOP/s | cuBLAS µs | cuBLAS TFLOP/s | of cuBLAS | weight GB/s | of copy rate "
          "| max rel. err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    tests = [tuple(t) for t in TEST_SHAPES + HOPPER_TEST_SHAPES + HOPPER_Q4_TEST_SHAPES]
    specs = [s for s in meta["kernels"] if not s["bias"] and s["dtype"] == "bfloat16" and s["weight"] in ("float", "q4")
             and not s.get("experts") and not s.get("activation") and (s["n"], s["k"]) not in tests]
    shapes = sorted({(s["n"], s["k"]) for s in specs}, key=lambda s: -s[0] * s[1])
    for n, k in shapes:
        copies = max(2, -(-(256 << 20) // (n * k * 2)))        # weights that overflow L2 together
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        q4s = [q4_weight(torch, n, k, HOPPER_Q4_GROUP) for _ in range(copies * 4)] \
            if any(s["weight"] == "q4" for s in specs) else []

        def weights(spec, i):       # the kernel's weight arguments from copy i, and their bytes
            if spec["weight"] == "float":
                return (ws[i % copies],), n * k * 2
            packed, scale, zeros, _ = q4s[i % len(q4s)]
            return (packed, scale, zeros) if spec.get("hopper") else (packed, scale), n * k // 2 + scale.numel() * 2
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            want = {"float": reference(x, ws[0], None, None).float()}
            if q4s:
                want["q4"] = reference(x, q4s[0][3], None, None).float()
            cublas = timed(torch, lambda i: torch.matmul(x, ws[i % copies].T, out=y), reps)
            flops = 2 * m * n * k
            for spec in [s for s in specs if (s["n"], s["k"]) == (n, k)]:
                func = library[spec["name"]]
                func(x, *weights(spec, 0)[0], y)
                torch.cuda.synchronize()
                err = ((y.float() - want[spec["weight"]]).abs().max() / want[spec["weight"]].abs().max()).item()
                seconds = timed(torch, lambda i: func(x, *weights(spec, i)[0], y), reps)
                label = spec["tile"] + ("" if spec["weight"] == "float" else f" q4g{spec['group']}")
                row = {"n": n, "k": k, "m": m, "kernel": spec["tile"], "weight": spec["weight"], "seconds": seconds,
                       "cublas_seconds": cublas, "error": err}
                results.append(row)
                nbytes = weights(spec, 0)[1]
                share = f"{nbytes / seconds / rate:.0%}" if m <= 64 else ""
                print(f"| {n}×{k} | {m} | {label} | {seconds * 1e6:.1f} | {flops / seconds / 1e12:.1f} | "
                      f"{cublas * 1e6:.1f} | {flops / cublas / 1e12:.1f} | {cublas / seconds:.0%} | "
                      f"{nbytes / seconds / 1e9:.0f} | {share} | {err:.1e} |", flush=True)
        del ws, q4s
    (Path(out) / "results.json").write_text(json.dumps(results, indent=1))
    if write_table:
        write_tuning_table(results, meta["arch"], write_table)


def write_tuning_table(results: list[dict], arch: str, path: Path) -> None:
    """The fastest correct tile per (shape, rows bucket) of selection/tiles.py, as its table: mma's
    tiles alone, and on sm_90 also the fastest of mma's and the Hopper GEMM's (the wgmma entries)."""
    from kiln.selection.shapes import HOPPER_ARCHS
    from kiln.selection.tiles import hopper_key
    table = json.loads(path.read_text()) if path.exists() else {}
    for n, k in sorted({(r["n"], r["k"]) for r in results}):
        measured = [r for r in results if (r["n"], r["k"]) == (n, k) and r["kernel"] not in ("default", "mma")
                    and r["weight"] == "float" and r["error"] < 2e-2]
        mma = _fastest_by_bucket([r for r in measured if not r["kernel"].startswith("wg")])
        both = _fastest_by_bucket(measured)
        for dtype in ("bfloat16", "float16"):            # same bytes and tensor-core rate
            if mma:
                table[f"{arch} {dtype} {n}x{k}"] = mma
            if arch in HOPPER_ARCHS and both and any(name.startswith("wg") for _, name in both):
                table[hopper_key(arch, dtype, n, k)] = both
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {len(table)} entries to {path}")


def _fastest_by_bucket(rows: list[dict]) -> list[list]:
    """[[up to rows, kernel], ...] over ROW_BUCKETS: the fastest at the measured row count nearest
    each bucket, neighbours that agree merged, the last for every larger step."""
    from kiln.selection.tiles import ROW_BUCKETS
    entry = []
    for bucket in ROW_BUCKETS:
        measured = sorted({r["m"] for r in rows}, key=lambda m: (abs(m - bucket), m))
        if not measured:
            continue
        best = min((r for r in rows if r["m"] == measured[0]), key=lambda r: r["seconds"])["kernel"]
        if entry and entry[-1][1] == best:
            entry[-1][0] = bucket
        else:
            entry.append([bucket, best])
    if entry:
        entry[-1][0] = 0
    return entry


def kernel_bench_main(doc: str, build_fn, run_fn, test_file: str, rows: list[int]) -> None:
    """The `build OUT` / `run OUT` command line of a kernel bench (this one's and bench/gemv_gpu.py's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--arch", default="sm_90")
    b.add_argument("--tests-only", action="store_true", help=f"only {test_file}'s kernels")
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--m", type=int, nargs="+", default=rows)
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--write-table", type=Path, default=None)
    args = ap.parse_args()
    if args.command == "build":
        build_fn(args.out, args.arch, args.tests_only)
    else:
        run_fn(args.out, args.m, args.write_table, args.reps)


def main() -> None:
    kernel_bench_main(__doc__, build, run, "tests/gpu/test_mma_gemm.py", [16, 64, 256, 1024, 4096])


if __name__ == "__main__":
    main()
