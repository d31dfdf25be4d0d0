"""Build every tensor-core tile of selection/tiles.py for one arch in a fresh process (TVM must
see a CUDA loader before it is imported) and write the CUDA source TVM generated.

    python tests/build_mma.py ARCH OUT      prints the kernels' names; writes OUT/kernels.cu
"""
from __future__ import annotations

import sys
from pathlib import Path


def main(arch: str, out: Path) -> None:
    from kiln.targets.cuda import make_target
    target = make_target(arch)
    import tvm

    from kiln.codegen.kernels.gpu.mma_gemm import mma_linear_kernel
    from kiln.selection.tiles import CANDIDATES
    from kiln.targets.cuda import FP8_ARCHS
    formats = (("q8", 0), ("q4", 32), ("q4", 128)) + ((("fp8", 0),) if arch in FP8_ARCHS else ())
    # each tile in bf16; fp16, the bias + residual epilogue and a gated MLP's activations on the
    # first; each quantised weight format in both dtypes on the first tile and on the first with
    # 32-input tiles
    narrow = next(t for t in CANDIDATES if t.bk == 32)
    cases = [("bfloat16", tile, False, "float", 0) for tile in CANDIDATES]
    cases += [("float16", CANDIDATES[0], False, "float", 0), ("bfloat16", CANDIDATES[0], True, "float", 0)]
    cases += [(dtype, tile, True, weight, group) for dtype in ("bfloat16", "float16")
              for weight, group in formats for tile in (CANDIDATES[0], narrow)]
    funcs = {}
    for dtype, activation in (("bfloat16", "silu"), ("float16", "gelu_tanh")):
        name = f"t_{dtype}_float_{CANDIDATES[0].name}_{activation}"
        func, _ = mma_linear_kernel(512, 512, dtype, False, False, [(0, CANDIDATES[0])], activation=activation)
        funcs[name] = func.with_attr("global_symbol", name)
    for dtype, tile, epilogue, weight, group in cases:
        name = f"t_{dtype}_{weight}{group or ''}_{tile.name}" + ("_epilogue" if epilogue else "")
        func, _ = mma_linear_kernel(512, 512, dtype, epilogue, epilogue, [(0, tile)], weight, group)
        funcs[name] = func.with_attr("global_symbol", name)
    # a mixture of experts' grouped GEMMs: gathered rows, weighted rows, each weight format
    from kiln.codegen.kernels.gpu.mma_gemm import mma_experts_kernel
    experts = [("bfloat16", "float", 0, True), ("float16", "float", 0, False), ("float16", "q8", 0, True),
               ("float16", "q4", 32, True), ("bfloat16", "q4", 128, False)]
    for dtype, weight, group, gather in experts + ([("bfloat16", "fp8", 0, False)] if arch in FP8_ARCHS else []):
        name = f"t_{dtype}_{weight}{group or ''}_experts" + ("_gather" if gather else "_weighted")
        func = mma_experts_kernel(8, 512, 512, dtype, [(0, CANDIDATES[0])], weight, group, gather, not gather)
        funcs[name] = func.with_attr("global_symbol", name)
    with target.tvm_target():
        library = tvm.tirx.build(tvm.IRModule(funcs), target=target.tvm_target())
    (out / "kernels.cu").write_text(library.imports[0].inspect_source())
    print(" ".join(f"{name}_kernel" for name in funcs))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
