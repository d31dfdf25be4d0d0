"""kiln's CPU linear kernels at one projection shape beside the machine's peak for their instruction.

    python bench/cpu_linear.py [--shape 8192x2048] [--rows 1,8,128,512] [--threads 2] [--repeats 9] [--only bf16]

Kernels (on the same random weights, stored as the CPU target stores them):
- bf16 weights, bf16 x: the packed GEMV schedule (decode steps) and the register-blocked GEMM
  (codegen/kernels/cpu/gemm.py), both in fp32 FMAs, and on AVX-512 BF16 codegen/kernels/cpu/bf16_linear.py (vdpbf16ps,
  every step), which a default CPU artifact runs there;
- q8 and q4 weights, float32 x: the GEMV and GEMM with float activations, and the int8-activation
  GEMM (codegen/kernels/cpu/int8_gemm.py, vpmaddwd: steps with chunks) and GEMV (codegen/kernels/cpu/int8_gemv.py: decode
  steps), which a default CPU artifact runs on AVX2; on AVX-512 VNNI, codegen/kernels/cpu/vnni_linear.py (vpdpbusd,
  every step), which it runs there.
Peaks, measured here on registers only (no memory): fp32 FMA (12 independent 8-lane FMA chains),
vpmaddwd (12 independent chains of a pair dot and its int32 add, each dot reading its chain's
accumulator so none can be hoisted) and, on AVX-512 VNNI, vpdpbusd (12 chains of 512-bit byte-quad
dots) and, on AVX-512 BF16, vdpbf16ps (12 chains of 512-bit bf16-pair dots, in LLVM IR as kiln's
micro-kernels are). TVM sizes its thread pool once per process, so each thread count is its own run.
GOP/s counts a multiply-add as 2 operations; `% peak` is against the instruction the kernel uses.
"""
from __future__ import annotations

import argparse
import statistics
import time

CHAINS, STEPS = 12, 1 << 20     # independent accumulators and steps per thread of a peak kernel


def _bf16_dot_peak_ir(triple: str, cpu: str) -> str:
    """LLVM IR of `void bf16_dot_peak(ptr out, i64 steps)`: CHAINS vdpbf16ps accumulators, registers only."""
    from kiln.codegen.kernels.cpu.bf16_micro import DOT
    vec, bvec = "<16 x float>", "<32 x bfloat>"
    lines = [f'target triple = "{triple}"', f"declare {vec} @{DOT}({vec}, {bvec}, {bvec})",
             "define void @bf16_dot_peak(ptr %out, i64 %steps) #0 {", "entry:",
             f"  %one = bitcast <16 x i32> splat (i32 1065369472) to {bvec}",      # bf16 pairs (1.0, 1.0)
             "  br label %loop", "loop:", "  %i = phi i64 [ 0, %entry ], [ %i_next, %loop ]"]
    lines += [f"  %a{c} = phi {vec} [ zeroinitializer, %entry ], [ %b{c}, %loop ]" for c in range(CHAINS)]
    lines += [f"  %b{c} = call {vec} @{DOT}({vec} %a{c}, {bvec} %one, {bvec} %one)" for c in range(CHAINS)]
    lines += ["  %i_next = add i64 %i, 1", "  %done = icmp eq i64 %i_next, %steps",
              "  br i1 %done, label %exit, label %loop", "exit:"]
    lines += [f"  %p{c} = getelementptr {vec}, ptr %out, i64 {c}\n  store {vec} %b{c}, ptr %p{c}" for c in range(CHAINS)]
    lines += ["  ret void", "}", f'attributes #0 = {{ nounwind "target-cpu"="{cpu}" }}']
    return "\n".join(lines) + "\n"


def _linked(func, module, target):
    """func (a PrimFunc calling into `module`) built, exported with it and loaded."""
    import os
    import tempfile

    import tvm
    library = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    library.import_module(module)
    with tempfile.TemporaryDirectory() as tmp:
        library.export_library(os.path.join(tmp, "kernel.so"))
        return tvm.runtime.load_module(os.path.join(tmp, "kernel.so"))["main"]


def _peak(threads: int, kind: str) -> float:
    """GOP/s of CHAINS independent 8-lane fp32 FMAs, vpmaddwd + int32 adds, vpdpbusd or vdpbf16ps, per thread."""
    import numpy as np
    import tvm
    from tvm.script import tirx as T

    from kiln.codegen.kernels.cpu.int8_gemm import PAIR_DOT
    from kiln.codegen.kernels.cpu.vnni_linear import QUAD_DOT
    from kiln.targets.cpu import host_cpu_target

    @T.prim_func(s_tir=True)
    def fma(a: T.Buffer((8,), "float32"), out: T.Buffer((threads, CHAINS, 8), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(threads):
            for c in T.unroll(CHAINS):
                out[t, c, T.ramp(0, 1, 8)] = T.broadcast(T.float32(0), 8)
            for _ in range(STEPS):
                for c in T.unroll(CHAINS):
                    out[t, c, T.ramp(0, 1, 8)] = T.call_llvm_pure_intrin(
                        "float32x8", "llvm.fma.v8f32", out[t, c, T.ramp(0, 1, 8)], a[T.ramp(0, 1, 8)],
                        a[T.ramp(0, 1, 8)])

    @T.prim_func(s_tir=True)
    def pair_dot(a: T.Buffer((16,), "int16"), out: T.Buffer((threads, CHAINS, 8), "int32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(threads):
            for c in T.unroll(CHAINS):
                out[t, c, T.ramp(0, 1, 8)] = T.broadcast(T.int32(0), 8)
            for _ in range(STEPS):
                for c in T.unroll(CHAINS):
                    out[t, c, T.ramp(0, 1, 8)] = out[t, c, T.ramp(0, 1, 8)] + T.call_llvm_pure_intrin(
                        "int32x8", PAIR_DOT, T.reinterpret("int16x16", out[t, c, T.ramp(0, 1, 8)]),
                        a[T.ramp(0, 1, 16)])

    @T.prim_func(s_tir=True)
    def quad_dot(a: T.Buffer((64,), "int8"), out: T.Buffer((threads, CHAINS, 16), "int32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(threads):
            for c in T.unroll(CHAINS):
                out[t, c, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
            for _ in range(STEPS):
                for c in T.unroll(CHAINS):     # the accumulator is an operand: nothing to hoist
                    out[t, c, T.ramp(0, 1, 16)] = T.call_llvm_pure_intrin(
                        "int32x16", QUAD_DOT, out[t, c, T.ramp(0, 1, 16)], a[T.ramp(0, 1, 64)], a[T.ramp(0, 1, 64)])

    if kind == "bf16_dot":
        import os
        import tempfile
        target = host_cpu_target()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "peak.ll")
            with open(path, "w") as f:
                f.write(_bf16_dot_peak_ir(str(target.attrs["mtriple"]), str(target.attrs["mcpu"])))
            peak_module = tvm.runtime.load_module(path)

        @T.prim_func(s_tir=True)
        def bf16_dot(out: T.Buffer((threads, CHAINS, 16), "float32")):
            T.func_attr({"tirx.noalias": True})
            for t in T.parallel(threads):
                T.evaluate(T.call_extern("void", "bf16_dot_peak", T.address_of(out[t, 0, 0]), T.int64(STEPS)))
        kernel = _linked(bf16_dot, peak_module, target)
        out = tvm.runtime.tensor(np.zeros((threads, CHAINS, 16), "float32"))
        kernel(out)
        best = min(_timed(lambda: kernel(out)) for _ in range(5))
        return threads * CHAINS * STEPS * 2 * 32 / best / 1e9

    func, dtype, lanes, out_lanes, ops = {"fma": (fma, "float32", 8, 8, 2 * 8),
                                          "pair_dot": (pair_dot, "int16", 16, 8, 2 * 16),
                                          "quad_dot": (quad_dot, "int8", 64, 16, 2 * 64)}[kind]
    kernel = tvm.compile(tvm.IRModule({"main": func}), target=host_cpu_target())
    a = tvm.runtime.tensor(np.ones(lanes, dtype) * (0.5 if kind == "fma" else 1))   # values stay small
    out = tvm.runtime.tensor(np.zeros((threads, CHAINS, out_lanes), "float32" if kind == "fma" else "int32"))
    kernel(a, out)
    best = min(_timed(lambda: kernel(a, out)) for _ in range(5))
    return threads * CHAINS * STEPS * ops / best / 1e9


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _kernels(n_out: int, n_in: int):
    """(name, instruction, weight arrays as stored, x dtype, built kernel) for each kernel measured."""
    import ml_dtypes
    import numpy as np
    import tvm
    from tvm import tirx

    from kiln.codegen.kernels.cpu.bf16_linear import bf16_linear_kernel, micro_kernels
    from kiln.codegen.kernels.cpu.bf16_micro import micro_module
    from kiln.codegen.kernels.cpu.gemm import packed_gemm_kernel, vector_lanes
    from kiln.codegen.kernels.cpu.int8_gemm import int8_gemm_kernel
    from kiln.codegen.kernels.cpu.int8_gemv import int8_gemv_kernel
    from kiln.codegen.kernels.cpu.packed_linear import packed_linear_kernel
    from kiln.codegen.kernels.cpu.vnni_linear import vnni_linear_kernel
    from kiln.host_cpu import has_bf16_dot, has_quad_dot
    from kiln.ir.quant import SCHEMES
    from kiln.selection.formats import WeightFormat
    from kiln.selection.layouts import apply_layout, group_scale_layout
    from kiln.selection.linear import linear_layout
    from kiln.targets.cpu import CPUTarget, host_cpu_target
    target, nb = host_cpu_target(), 64
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n_out, n_in)) * 0.02).astype(np.float32)
    built = lambda f: tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=target)  # noqa: E731
    m = tirx.Var("m", "int64")
    fp32 = [apply_layout(f"packed{nb}", w)]
    yield ("fp32 GEMV", "fma", fp32, "float32",
           built(packed_linear_kernel(m, n_out, n_in, nb, "float32", False, False, WeightFormat(), "float32")))
    yield ("fp32 GEMM", "fma", fp32, "float32", built(packed_gemm_kernel(
        n_out, n_in, nb, "float32", WeightFormat(), "float32", False, False, vector_lanes(target))))
    bf16 = [apply_layout(f"packed{nb}", w.astype(ml_dtypes.bfloat16))]
    yield ("bf16 GEMV", "fma", bf16, "bfloat16",
           built(packed_linear_kernel(m, n_out, n_in, nb, "bfloat16", False, False, WeightFormat(), "bfloat16")))
    yield ("bf16 GEMM", "fma", bf16, "bfloat16", built(packed_gemm_kernel(
        n_out, n_in, nb, "bfloat16", WeightFormat(), "bfloat16", False, False, vector_lanes(target))))
    if has_bf16_dot(target):                # AVX-512 BF16: the CPU target's kernel for every step
        yield ("bf16 dot", "bf16_dot", [apply_layout(f"packed{nb}x2", w.astype(ml_dtypes.bfloat16))], "bfloat16",
               _linked(bf16_linear_kernel(n_out, n_in, nb, False, False), micro_module(micro_kernels(nb), target),
                       target))
    for quant, group in (("q8", 0), ("q4", 32)):
        parts = SCHEMES[quant].quantize(w, group_size=group) if group else SCHEMES[quant].quantize(w)
        stored = [apply_layout(f"packed{nb}", parts["q"]), parts["scale"]]
        wdt = str(parts["q"].dtype)
        yield (f"{quant} GEMV, float x", "fma", stored, "float32", built(packed_linear_kernel(
            m, n_out, n_in, nb, "float32", False, False, WeightFormat(quant, group), wdt)))
        yield (f"{quant} GEMM, float x", "fma", stored, "float32", built(packed_gemm_kernel(
            n_out, n_in, nb, "float32", WeightFormat(quant, group), wdt, False, False, vector_lanes(target))))
        # int8 activations: q8 is stored in input pairs (the CPU target's layout for it)
        paired = [apply_layout(f"packed{nb}x2", parts["q"]), parts["scale"]] if quant == "q8" else stored
        yield (f"{quant} int8 GEMM", "pair_dot", paired, "float32", built(int8_gemm_kernel(
            n_out, n_in, nb, "float32", WeightFormat(quant, group, 32), False, False)))
        yield (f"{quant} int8 GEMV (decode steps)", "pair_dot", paired, "float32", built(int8_gemv_kernel(
            n_out, n_in, nb, "float32", WeightFormat(quant, group, 32), False, False)))
        if has_quad_dot(target):            # AVX-512 VNNI: the CPU target's kernel for every step
            layout = linear_layout(CPUTarget(int8_dot="vnni"), *parts["q"].shape, operands=quant, act_block=32)
            quads = [apply_layout(layout, parts["q"]), apply_layout(group_scale_layout(layout, 32) if quant == "q4"
                                                                    else "nk", parts["scale"])]
            yield (f"{quant} VNNI", "quad_dot", quads, "float32", built(vnni_linear_kernel(
                n_out, n_in, nb, "float32", WeightFormat(quant, group, 32), False, False)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x2048", help="OUTxIN (Llama-3.2-1B's gate/up half: 8192x2048)")
    ap.add_argument("--rows", default="1,8,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--only", default="", help="measure only the kernels whose name starts with this")
    args = ap.parse_args()
    import os
    os.environ["TVM_NUM_THREADS"] = str(args.threads)        # before TVM starts its pool
    import ml_dtypes
    import numpy as np
    import tvm
    n_out, n_in = map(int, args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    kernels = [k for k in _kernels(n_out, n_in) if k[0].startswith(args.only)]
    rng = np.random.default_rng(1)
    print(f"{n_out}x{n_in}, GOP/s (median of {args.repeats}) and % of the measured peak of the kernel's instruction")
    print("| threads | kernel | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for threads in [args.threads]:
        peaks = {kind: _peak(threads, kind) for kind in {k[1] for k in kernels}}
        names = {"fma": "fp32 FMA", "pair_dot": "vpmaddwd", "quad_dot": "vpdpbusd", "bf16_dot": "vdpbf16ps"}
        print(f"| {threads} | peak: " + ", ".join(f"{names[k]} {v:.0f}" for k, v in sorted(peaks.items())) + " |"
              + " |" * len(rows))
        for name, kind, weights, x_dtype, kernel in kernels:
            cells = []
            for r in rows:
                np_dtype = ml_dtypes.bfloat16 if x_dtype == "bfloat16" else np.float32
                args_ = [tvm.runtime.tensor(rng.standard_normal((r, n_in)).astype(np_dtype)),
                         *[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in weights],
                         tvm.runtime.tensor(np.zeros((r, n_out), np_dtype))]
                kernel(*args_)
                seconds = statistics.median(_timed(lambda: kernel(*args_)) for _ in range(args.repeats))
                rate = 2 * r * n_out * n_in / seconds / 1e9
                cells.append(f"{rate:.0f} ({rate / peaks[kind]:.0%})")
            print(f"| {threads} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
