"""kiln's bf16 dot-product micro-kernels, written as LLVM IR and linked into the artifact.

`vdpbf16ps` (AVX-512 BF16) multiplies pairs of bf16 values and adds both products to each float32
lane: 32 multiply-adds per instruction, twice an fp32 FMA's. TVM 0.27 cannot emit it from TIR: its
BF16 legalisation widens every bfloat16 operand to float32, and its LLVM code generator has no
bfloat16 type to skip that with. So kiln writes the innermost loop itself, as LLVM IR text that
TVM's bundled LLVM compiles, and the TIR kernel (codegen/kernels/cpu/bf16_linear.py) calls it once per
micro-tile and K block:

    acc[r, v·16 + i] += Σ_p  x[r, 2p] · w[p, v, 2i] + x[r, 2p + 1] · w[p, v, 2i + 1]

for r < rows, v < vectors (16 columns each), p < pairs. x is bf16 row-major (a pair is one 32-bit
value, broadcast to every lane); w is a panel in layout packedNBx2 (a pair of inputs per column
side by side, selection/layouts.py), so one 64-byte row of it is the operand for 16 columns. The
rows × vectors float32 sums stay in registers for the whole loop. Each product of two bf16 values
is exact in float32, so the result differs from an fp32 FMA loop only in summation order.
"""
from __future__ import annotations

import os
import tempfile

import tvm

DOT = "llvm.x86.avx512bf16.dpbf16ps.512"
LANES = 16                 # float32 lanes of a 512-bit register: 16 output columns
PAIR = 2                   # bf16 inputs per 32-bit lane



def micro_name(rows: int, vectors: int) -> str:
    return f"kiln_bf16_dot_{rows}x{vectors}"


def micro_kernel_ir(rows: int, vectors: int) -> str:
    """The LLVM IR definition of micro_name(rows, vectors):
    void (float* acc, i64 acc_stride, bf16* x, i64 x_stride, bf16* w, i64 w_stride, i64 pairs), strides
    in elements, pairs ≥ 1; acc row r starts at acc + r·acc_stride, x row r at x + r·x_stride, pair p
    of w at w + p·w_stride."""
    tiles = [(r, v) for r in range(rows) for v in range(vectors)]
    vec, bvec = f"<{LANES} x float>", f"<{PAIR * LANES} x bfloat>"
    lines = [f"define void @{micro_name(rows, vectors)}(ptr noalias %acc, i64 %acc_stride, ptr noalias %x, "
             "i64 %x_stride, ptr noalias %w, i64 %w_stride, i64 %pairs) #0 {", "entry:"]
    for r in range(rows):
        lines.append(f"  %acc_row{r} = mul i64 %acc_stride, {r}")
        lines.append(f"  %x_row{r} = mul i64 %x_stride, {r}")
    for r, v in tiles:
        lines += [f"  %acc_at{r}_{v} = add i64 %acc_row{r}, {v * LANES}",
                  f"  %acc_ptr{r}_{v} = getelementptr float, ptr %acc, i64 %acc_at{r}_{v}",
                  f"  %start{r}_{v} = load {vec}, ptr %acc_ptr{r}_{v}, align 4"]
    lines += ["  br label %loop", "loop:", "  %p = phi i64 [ 0, %entry ], [ %p_next, %loop ]"]
    lines += [f"  %sum{r}_{v} = phi {vec} [ %start{r}_{v}, %entry ], [ %next{r}_{v}, %loop ]" for r, v in tiles]
    lines.append("  %w_row = mul i64 %p, %w_stride")
    for v in range(vectors):
        lines += [f"  %w_at{v} = add i64 %w_row, {v * PAIR * LANES}",
                  f"  %w_ptr{v} = getelementptr i16, ptr %w, i64 %w_at{v}",
                  f"  %w{v} = load {bvec}, ptr %w_ptr{v}, align 2"]
    lines.append("  %x_pair = mul i64 %p, 2")
    for r in range(rows):
        lines += [f"  %x_at{r} = add i64 %x_row{r}, %x_pair",
                  f"  %x_ptr{r} = getelementptr i16, ptr %x, i64 %x_at{r}",
                  f"  %x_bits{r} = load i32, ptr %x_ptr{r}, align 2",
                  f"  %x_one{r} = insertelement <{LANES} x i32> poison, i32 %x_bits{r}, i64 0",
                  f"  %x_all{r} = shufflevector <{LANES} x i32> %x_one{r}, <{LANES} x i32> poison, "
                  f"<{LANES} x i32> zeroinitializer",
                  f"  %x{r} = bitcast <{LANES} x i32> %x_all{r} to {bvec}"]
    lines += [f"  %next{r}_{v} = call {vec} @{DOT}({vec} %sum{r}_{v}, {bvec} %x{r}, {bvec} %w{v})"
              for r, v in tiles]
    lines += ["  %p_next = add i64 %p, 1", "  %done = icmp eq i64 %p_next, %pairs",
              "  br i1 %done, label %exit, label %loop", "exit:"]
    lines += [f"  store {vec} %next{r}_{v}, ptr %acc_ptr{r}_{v}, align 4" for r, v in tiles]
    lines += ["  ret void", "}"]
    return "\n".join(lines)


def micro_module_ir(kernels: list[tuple[int, int]], triple: str, cpu: str) -> str:
    """One LLVM IR module with the micro-kernels `kernels` ((rows, vectors) each), for `triple` and `cpu`."""
    vec, bvec = f"<{LANES} x float>", f"<{PAIR * LANES} x bfloat>"
    parts = [f'target triple = "{triple}"',
             f"declare {vec} @{DOT}({vec}, {bvec}, {bvec})"]
    parts += [micro_kernel_ir(rows, vectors) for rows, vectors in sorted(set(kernels))]
    parts.append(f'attributes #0 = {{ nounwind "target-cpu"="{cpu}" }}')
    return "\n\n".join(parts) + "\n"


def micro_module(kernels: list[tuple[int, int]], target):
    """The micro-kernels as a TVM runtime module (LLVM) for the LLVM `target`, for the Relax build
    to link into the library."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bf16_micro.ll")
        with open(path, "w") as f:
            f.write(micro_module_ir(kernels, str(target.attrs["mtriple"]), str(target.attrs["mcpu"])))
        return tvm.runtime.load_module(path)
