"""kiln's register-blocked CPU GEMM (codegen/gemm.py) against the reference interpreter's linear ops,
on the same (quantised) weights: float32, bfloat16, q8, q4 and fp8 weights, with bias and residual,
at row counts that leave partial micro-tiles and row tiles (1, 5, 13, 50, 97)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

N_OUT, N_IN, NB = 128, 256, 64
ROW_COUNTS = (1, 5, 13, 50, 97)
CASES = [  # (op, dtype, bias, residual)
    ("linear", "float32", False, False), ("linear", "float32", True, False), ("linear", "float32", False, True),
    ("linear", "float32", True, True), ("linear", "bfloat16", False, True), ("linear_q8", "float32", True, False),
    ("linear_q4", "float32", False, True), ("linear_q4", "bfloat16", True, False), ("linear_fp8", "float32", False, False),
]


def _weights(op, rng) -> list[np.ndarray]:
    """The op's weight inputs as the interpreter takes them ([out, in] and scales)."""
    if op == "linear":
        return [(rng.standard_normal((N_OUT, N_IN)) * 0.1).astype(np.float32)]
    if op == "linear_q8":
        return [rng.integers(-127, 128, (N_OUT, N_IN)).astype(np.int8), (rng.random(N_OUT) * 0.01).astype(np.float32)]
    if op == "linear_fp8":
        return [(rng.standard_normal((N_OUT, N_IN)) * 8).astype(ml_dtypes.float8_e4m3fn),
                (rng.random(N_OUT) * 0.01).astype(np.float32)]
    return [rng.integers(0, 256, (N_OUT, N_IN // 2)).astype(np.uint8),
            (rng.random((N_IN // 32, N_OUT)) * 0.01).astype(np.float16)]


@pytest.mark.parametrize("op,dtype,bias,residual", CASES)
def test_gemm_equals_the_interpreter(op, dtype, bias, residual):
    import tvm
    from kiln.codegen.gemm import packed_gemm_kernel, vector_lanes
    from kiln.codegen.layouts import apply_layout
    from kiln.codegen.linear import WeightFormat
    from kiln.ir import GraphBuilder, interpret
    from kiln.ir.types import numpy_dtype
    from kiln.targets.cpu import host_cpu_target
    rng = np.random.default_rng(0)
    weights = _weights(op, rng)
    if op == "linear":
        weights = [weights[0].astype(numpy_dtype(dtype))]
    fmt = WeightFormat.of(type("N", (), {"op": op, "attrs": {"group_size": 32} if op == "linear_q4" else {}}), "linear")
    target = host_cpu_target()
    kernel = packed_gemm_kernel(N_OUT, N_IN, NB, dtype, fmt, str(weights[0].dtype) if op != "linear" else dtype,
                                bias, residual, vector_lanes(target))
    built = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=target)

    np_dtype = numpy_dtype(dtype)
    b = GraphBuilder(op)
    x = b.input("x", ("tokens", N_IN), dtype)
    params = [b.param(f"w{i}", w.shape, str(w.dtype) if op != "linear" else dtype) for i, w in enumerate(weights)]
    extra = [b.param("bias", (N_OUT,), dtype)] if bias else [None]
    extra += [b.input("residual", ("tokens", N_OUT), dtype)] if residual else []
    while extra and extra[-1] is None:
        extra.pop()
    attrs = {"group_size": 32} if op == "linear_q4" else {}
    graph = b.output(b.op(op, x, *params, *extra, name="y", **attrs))
    bias_value = rng.standard_normal(N_OUT).astype(np_dtype)
    values = {f"w{i}": w for i, w in enumerate(weights)} | {"bias": bias_value}
    for rows in ROW_COUNTS:
        inputs = {"x": rng.standard_normal((rows, N_IN)).astype(np_dtype),
                  "residual": rng.standard_normal((rows, N_OUT)).astype(np_dtype)}
        want = interpret(graph, {k: v for k, v in inputs.items() if k in graph.inputs}, values.__getitem__)["y"]
        args = [inputs["x"], apply_layout(f"packed{NB}", weights[0]), *weights[1:]]
        args += [bias_value] if bias else []
        args += [inputs["residual"]] if residual else []
        y = tvm.runtime.tensor(np.zeros((rows, N_OUT), np_dtype))
        built(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], y)
        got, want = y.numpy().astype(np.float32), want.astype(np.float32)
        # float32: sums in another order, a q8/fp8 scale applied after the sum rather than to each
        # weight; bfloat16: outputs may round one step apart
        bound = 1e-4 if dtype == "float32" else 2 ** -7
        assert np.abs(got - want).max() / np.abs(want).max() < bound, rows
