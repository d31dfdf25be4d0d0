"""kiln's register-blocked CPU GEMMs against the reference interpreter's linear ops, on the same
(quantised) weights, at row counts that leave partial micro-tiles and row tiles (1, 5, 13, 50, 97):
codegen/kernels/cpu/gemm.py on float32, bfloat16, q8, q4, q8g, q4a, q4k and fp8 weights, and
codegen/kernels/cpu/int8_gemm.py, int8_gemv.py, vnni_linear.py (and the TE form codegen/kernels/te_linear.py
gives unpacked weights) on q8, q4, q8g, q4a and q4k weights with int8 activations, codegen/kernels/cpu/bf16_linear.py
on bfloat16; with bias and residual."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

N_OUT, N_IN, NB = 128, 256, 64
ROW_COUNTS = (1, 5, 13, 50, 97)
CASES = [  # (op, dtype, bias, residual)
    ("linear", "float32", False, False), ("linear", "float32", True, False), ("linear", "float32", False, True),
    ("linear", "float32", True, True), ("linear", "bfloat16", False, True), ("linear_q8", "float32", True, False),
    ("linear_q4", "float32", False, True), ("linear_q4", "bfloat16", True, False), ("linear_fp8", "float32", False, False),
    ("linear_q8g", "float32", True, True), ("linear_q4a", "float32", False, True),
    ("linear_q4k", "float32", True, False),
]
GROUPED = ("linear_q4", "linear_q8g", "linear_q4a", "linear_q4k")      # scales per group of 32 inputs
NIBBLES = ("linear_q4", "linear_q4a", "linear_q4k")


def _weights(op, rng, scales=np.float16) -> list[np.ndarray]:
    """The op's weight inputs as the interpreter takes them ([out, in] and scales; q4's, q8g's and q4a's group
    scales in `scales`: float16 as kiln quantises, or float32 as an ONNX file's MatMulNBits keep them)."""
    if op == "linear":
        return [(rng.standard_normal((N_OUT, N_IN)) * 0.1).astype(np.float32)]
    if op == "linear_q8":
        return [rng.integers(-127, 128, (N_OUT, N_IN)).astype(np.int8), (rng.random(N_OUT) * 0.01).astype(np.float32)]
    if op == "linear_fp8":
        return [(rng.standard_normal((N_OUT, N_IN)) * 8).astype(ml_dtypes.float8_e4m3fn),
                (rng.random(N_OUT) * 0.01).astype(np.float32)]
    if op == "linear_q8g":
        return [rng.integers(-127, 128, (N_OUT, N_IN)).astype(np.int8),
                (rng.random((N_IN // 32, N_OUT)) * 0.01).astype(scales)]
    if op == "linear_q4a":          # scale rows, then minimum rows (about -7.5 scales: a centred group)
        from kiln.ir.quant import q4a_scale_table
        scale = rng.random((N_OUT, N_IN // 32)).astype(np.float32) * 0.01
        return [rng.integers(0, 256, (N_OUT, N_IN // 2)).astype(np.uint8),
                q4a_scale_table(scale, -scale * rng.uniform(6, 9, scale.shape).astype(np.float32), scales)]
    if op == "linear_q4k":          # every 6-bit sub-scale and depth, float16 factors as a centred group's
        from kiln.ir.quant import q4k_scale_table
        supers = (N_OUT, N_IN // 256)
        d = (rng.random(supers) * 5e-4).astype(np.float16)
        return [rng.integers(0, 256, (N_OUT, N_IN // 2)).astype(np.uint8),
                q4k_scale_table(d, -d * rng.uniform(6, 9, supers).astype(np.float16), rng.integers(0, 64, (*supers, 8)),
                                rng.integers(0, 64, (*supers, 8)))]
    return [rng.integers(0, 256, (N_OUT, N_IN // 2)).astype(np.uint8),
            (rng.random((N_IN // 32, N_OUT)) * 0.01).astype(scales)]


INT8_CASES = [  # (op, dtype, bias, residual)
    ("linear_q8", "float32", False, False), ("linear_q8", "float32", True, True),
    ("linear_q8", "bfloat16", False, True), ("linear_q4", "float32", False, False),
    ("linear_q4", "float32", True, False), ("linear_q4", "bfloat16", True, True),
    ("linear_q8g", "bfloat16", True, True), ("linear_q4a", "float32", True, True),
    ("linear_q4k", "float32", True, True), ("linear_q4k", "bfloat16", False, False),
]


@pytest.mark.parametrize("op,dtype,bias,residual", CASES)
def test_gemm_equals_the_interpreter(op, dtype, bias, residual):
    from kiln.codegen.kernels.cpu.gemm import packed_gemm_kernel, vector_lanes
    from kiln.targets.cpu import host_cpu_target
    check_against_interpreter(op, dtype, bias, residual, {}, lambda fmt, weight_dtype: packed_gemm_kernel(
        N_OUT, N_IN, NB, dtype, fmt, weight_dtype, bias, residual, vector_lanes(host_cpu_target())))


def int8_layout(op: str) -> str:
    """How the CPU target stores the weight of a linear with int8 activations (q8: in input pairs)."""
    return f"packed{NB}x2" if op in ("linear_q8", "linear_q8g") else f"packed{NB}"


def pair_dot_or_skip():
    from kiln.host_cpu import has_pair_dot
    from kiln.targets.cpu import host_cpu_target
    if not has_pair_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX2 (the int8 GEMM's vpmaddwd)")


@pytest.mark.parametrize("op,dtype,bias,residual", INT8_CASES)
def test_int8_gemm_equals_the_interpreter(op, dtype, bias, residual):
    from kiln.codegen.kernels.cpu.int8_gemm import int8_gemm_kernel
    pair_dot_or_skip()
    check_against_interpreter(op, dtype, bias, residual, {"act_block": 32}, lambda fmt, weight_dtype: int8_gemm_kernel(
        N_OUT, N_IN, NB, dtype, fmt, bias, residual), layout=int8_layout(op))


@pytest.mark.parametrize("op,dtype,bias,residual", INT8_CASES)
def test_int8_gemv_equals_the_interpreter(op, dtype, bias, residual):
    from kiln.codegen.kernels.cpu.int8_gemv import int8_gemv_kernel
    pair_dot_or_skip()
    check_against_interpreter(op, dtype, bias, residual, {"act_block": 32}, lambda fmt, weight_dtype: int8_gemv_kernel(
        N_OUT, N_IN, NB, dtype, fmt, bias, residual), layout=int8_layout(op))


@pytest.mark.parametrize("op,dtype,bias,residual", INT8_CASES)
def test_vnni_kernel_equals_the_interpreter(op, dtype, bias, residual):
    """codegen/kernels/cpu/vnni_linear.py (every step on AVX-512 VNNI CPUs), weights in byte quads."""
    from kiln.codegen.kernels.cpu.vnni_linear import vnni_linear_kernel
    from kiln.host_cpu import has_quad_dot
    from kiln.targets.cpu import host_cpu_target
    if not has_quad_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX-512 VNNI (vpdpbusd)")
    check_against_interpreter(op, dtype, bias, residual, {"act_block": 32}, lambda fmt, weight_dtype: vnni_linear_kernel(
        N_OUT, N_IN, NB, dtype, fmt, bias, residual),
        layout=f"packed{NB}x4" + ("n32" if op in NIBBLES else ""),
        scale_layout=f"panels{NB}" if op in GROUPED else "nk")


@pytest.mark.parametrize("op,dtype,bias,residual", INT8_CASES[1::2] + INT8_CASES[6:9:2])
def test_int8_activation_te_form_equals_the_interpreter(op, dtype, bias, residual):
    """The TE stages for unpacked weights (nk layout): same scheme, generic loops."""
    from tvm import te, tirx

    from kiln.codegen.kernels.te_linear import nt_matmul

    def kernel(fmt, weight_dtype):
        m = tirx.Var("m", "int64")
        w_shape = (N_OUT, N_IN // 2) if fmt.nibbles else (N_OUT, N_IN)
        scale_shape = (fmt.table_rows(N_IN), N_OUT) if fmt.grouped else (N_OUT,)
        scale_dtype = fmt.table_dtype
        x, w = te.placeholder((m, N_IN), dtype), te.placeholder(w_shape, weight_dtype)
        scale = te.placeholder(scale_shape, scale_dtype)
        b = te.placeholder((N_OUT,), dtype) if bias else None
        r = te.placeholder((m, N_OUT), dtype) if residual else None
        y = nt_matmul(x, w, scale, b, r, dtype, fmt)
        return te.create_prim_func([t for t in (x, w, scale, b, r, y) if t is not None])
    check_against_interpreter(op, dtype, bias, residual, {"act_block": 32}, kernel, layout="nk")


BF16_CASES = [(False, False), (True, False), (False, True), (True, True)]   # (bias, residual)


@pytest.mark.parametrize("bias,residual", BF16_CASES)
def test_bf16_dot_kernel_equals_the_interpreter(bias, residual, tmp_path):
    """codegen/kernels/cpu/bf16_linear.py (every step on AVX-512 BF16 CPUs), weights in input pairs, its
    micro-kernels (codegen/kernels/cpu/bf16_micro.py) linked in as the artifact links them."""
    from kiln.codegen.kernels.cpu.bf16_linear import bf16_linear_kernel, micro_kernels
    from kiln.codegen.kernels.cpu.bf16_micro import micro_module
    from kiln.host_cpu import has_bf16_dot
    from kiln.targets.cpu import host_cpu_target
    if not has_bf16_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX-512 BF16 (vdpbf16ps)")
    check_against_interpreter("linear", "bfloat16", bias, residual, {}, lambda fmt, weight_dtype: bf16_linear_kernel(
        N_OUT, N_IN, NB, bias, residual), layout=f"packed{NB}x2",
        link=([micro_module(micro_kernels(NB), host_cpu_target())], tmp_path))


def test_bf16_micro_kernels_select_vdpbf16ps_for_a_bf16_cpu():
    """The LLVM IR kiln writes for the bf16 micro-kernels parses, and LLVM selects vdpbf16ps for it
    on a CPU with AVX-512 BF16 (Zen 4), whichever x86 CPU runs the test: rows × vectors dots per pair."""
    import platform

    import tvm

    from kiln.codegen.kernels.cpu.bf16_micro import micro_module, micro_name
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 only: the micro-kernels are AVX-512 BF16 code")
    target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "znver4"})
    shapes = [(6, 4), (1, 4), (3, 1)]
    asm = micro_module(shapes, target).inspect_source("asm")
    for rows, vectors in shapes:
        body = asm[asm.index(f"{micro_name(rows, vectors)}:"):]
        body = body[:body.index(".Lfunc_end")]
        assert body.count("vdpbf16ps") == rows * vectors, (rows, vectors)


@pytest.mark.parametrize("op", ["linear_q4", "linear_q4a", "linear_q8g"])
@pytest.mark.parametrize("kernel", ["gemm", "packed_linear", "int8_gemm", "int8_gemv", "vnni"])
def test_float32_group_scales_are_read_as_stored(kernel, op):
    """A file's float32 group scales (ONNX MatMulNBits'), of values float16 cannot hold, as every CPU kernel
    reading grouped weights takes them (scale_dtype float32): the interpreter's output on them, not on their
    float16 roundings."""
    from tvm import tirx

    from kiln.codegen.kernels.cpu.gemm import packed_gemm_kernel, vector_lanes
    from kiln.codegen.kernels.cpu.int8_gemm import int8_gemm_kernel
    from kiln.codegen.kernels.cpu.int8_gemv import int8_gemv_kernel
    from kiln.codegen.kernels.cpu.packed_linear import packed_linear_kernel
    from kiln.codegen.kernels.cpu.vnni_linear import vnni_linear_kernel
    from kiln.host_cpu import has_quad_dot
    from kiln.targets.cpu import host_cpu_target
    if kernel in ("int8_gemm", "int8_gemv"):
        pair_dot_or_skip()
    if kernel == "vnni" and not has_quad_dot(host_cpu_target()):
        pytest.skip("this CPU has no AVX-512 VNNI (vpdpbusd)")
    makers = {
        "gemm": lambda fmt, wd: packed_gemm_kernel(N_OUT, N_IN, NB, "float32", fmt, wd, False, True,
                                                   vector_lanes(host_cpu_target())),
        "packed_linear": lambda fmt, wd: packed_linear_kernel(tirx.Var("m", "int64"), N_OUT, N_IN, NB, "float32",
                                                              False, True, fmt, wd),
        "int8_gemm": lambda fmt, wd: int8_gemm_kernel(N_OUT, N_IN, NB, "float32", fmt, False, True),
        "int8_gemv": lambda fmt, wd: int8_gemv_kernel(N_OUT, N_IN, NB, "float32", fmt, False, True),
        "vnni": lambda fmt, wd: vnni_linear_kernel(N_OUT, N_IN, NB, "float32", fmt, False, True)}
    int8 = kernel in ("int8_gemm", "int8_gemv", "vnni")
    layout = (f"packed{NB}x4" + ("n32" if op in NIBBLES else "") if kernel == "vnni"
              else int8_layout(op) if int8 else f"packed{NB}")
    check_against_interpreter(op, "float32", False, True, {"act_block": 32} if int8 else {}, makers[kernel],
                              layout=layout, scale_layout=f"panels{NB}" if kernel == "vnni" else "nk",
                              scales=np.float32)


def check_against_interpreter(op, dtype, bias, residual, attrs, make_kernel, layout=f"packed{NB}", link=None,
                              scale_layout="nk", scales=np.float16, row_counts=ROW_COUNTS):
    """make_kernel(fmt, weight_dtype) on the op's weights stored in `layout` (its scales in
    `scale_layout`, group scales in `scales`), against interpret().
    link: (modules the kernel calls into, a directory): the kernel is exported with them and loaded."""
    import tvm

    from kiln.ir import GraphBuilder, interpret
    from kiln.ir.types import numpy_dtype
    from kiln.selection.formats import WeightFormat
    from kiln.selection.layouts import apply_layout
    from kiln.targets.cpu import host_cpu_target
    rng = np.random.default_rng(0)
    weights = _weights(op, rng, scales)
    if op == "linear":
        weights = [weights[0].astype(numpy_dtype(dtype))]
    attrs = {**attrs, "format": op.partition("_")[2] or "none", **({"group_size": 32} if op in GROUPED else {})}
    if scales == np.float32:
        attrs["scale_dtype"] = "float32"
    fmt = WeightFormat.of(type("N", (), {"op": "linear", "attrs": attrs}))
    kernel = make_kernel(fmt, str(weights[0].dtype) if op != "linear" else dtype)
    target = host_cpu_target()
    module = tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})
    if link is None:
        built = tvm.compile(module, target=target)
    else:
        library, directory = tvm.tirx.build(module, target=target), link[1]
        for linked in link[0]:
            library.import_module(linked)
        library.export_library(str(directory / "kernel.so"))
        built = tvm.runtime.load_module(str(directory / "kernel.so"))["main"]

    np_dtype = numpy_dtype(dtype)
    b = GraphBuilder(op)
    x = b.input("x", ("tokens", N_IN), dtype)
    params = [b.param(f"w{i}", w.shape, str(w.dtype) if op != "linear" else dtype) for i, w in enumerate(weights)]
    extra = [b.param("bias", (N_OUT,), dtype)] if bias else [None]
    extra += [b.input("residual", ("tokens", N_OUT), dtype)] if residual else []
    while extra and extra[-1] is None:
        extra.pop()
    no_scale = [None] if op == "linear" else []          # a float weight has no scale input
    graph = b.output(b.op("linear", x, *params, *no_scale, *extra, name="y", **attrs))
    bias_value = rng.standard_normal(N_OUT).astype(np_dtype)
    values = {f"w{i}": w for i, w in enumerate(weights)} | {"bias": bias_value}
    for rows in row_counts:
        inputs = {"x": rng.standard_normal((rows, N_IN)).astype(np_dtype),
                  "residual": rng.standard_normal((rows, N_OUT)).astype(np_dtype)}
        want = interpret(graph, {k: v for k, v in inputs.items() if k in graph.inputs}, values.__getitem__)["y"]
        args = [inputs["x"], apply_layout(layout, weights[0]), *[apply_layout(scale_layout, s) for s in weights[1:]]]
        args += [bias_value] if bias else []
        args += [inputs["residual"]] if residual else []
        y = tvm.runtime.tensor(np.zeros((rows, N_OUT), np_dtype))
        built(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], y)
        got, want = y.numpy().astype(np.float32), want.astype(np.float32)
        # float32: sums in another order, a q8/fp8 scale applied after the sum rather than to each
        # weight (int8 activations: the same levels, block sums in order); bfloat16: outputs may
        # round one step apart
        bound = 1e-4 if dtype == "float32" else 2 ** -7
        assert np.abs(got - want).max() / np.abs(want).max() < bound / (10 if scales == np.float32 else 1), rows
        if scales == np.float32:           # the bound tells the scales from their float16 roundings
            rounded = {**values, "w1": weights[1].astype(np.float16).astype(np.float32)}
            near = interpret(graph, {k: v for k, v in inputs.items() if k in graph.inputs}, rounded.__getitem__)["y"]
            assert np.abs(near - want).max() / np.abs(want).max() > bound / 10, rows
