"""kiln's float32 exp lowering on the CPU (targets/exp_lowering.py): inline arithmetic, not libm calls.

- Over the whole range where exp is a normal float32, a vectorised loop's results are within 1 ulp
  of exp in float64 (numpy's own float32 exp is within 2.5 ulp of it here).
- Below the range it gives about the smallest normal float32 (never 0, NaN or a negative); above,
  a finite value; exp(0) is exactly 1.
- The compiled loop calls no `expf`.
- float64 exp keeps TVM's lowering (libm's double exp, within 1e-15 of numpy's).
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)


def build_exp(n: int, dtype: str):
    import tvm
    from tvm.script import tirx as T
    from kiln.targets.cpu import host_cpu_target

    @T.prim_func
    def exp(a: T.Buffer((n,), dtype), b: T.Buffer((n,), dtype)):
        for i in T.parallel(n // 16):
            for j in T.vectorized(16):
                b[i * 16 + j] = T.exp(a[i * 16 + j])
    return tvm.tirx.build(exp, target=host_cpu_target())


def run(module, a: np.ndarray) -> np.ndarray:
    import tvm
    out = tvm.runtime.tensor(np.zeros_like(a))
    module["exp"](tvm.runtime.tensor(a), out)
    return out.numpy()


def test_float32_exp_is_within_an_ulp_over_the_normal_range():
    a = np.concatenate([np.linspace(-87.3, 88.0, 1 << 16), np.linspace(-1, 1, 1 << 12), [0.0] * 16])
    a = a[: len(a) // 16 * 16].astype(np.float32)
    got = run(build_exp(len(a), "float32"), a)
    exact = np.exp(a.astype(np.float64))
    ulps = np.abs(got - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0, float(ulps.max())
    assert got[a == 0].tolist() == [1.0] * int((a == 0).sum())


def test_float32_exp_outside_the_range_stays_finite_and_non_negative():
    a = np.array([-3.0e38, -1e4, -100, -87.5] * 4 + [89.0, 100.0, 1e4, 3.0e38] * 4, np.float32)
    got = run(build_exp(len(a), "float32"), a)
    low, high = got[:16], got[16:]
    assert np.all((low > 0) & (low < 2e-38)), low
    assert np.all(np.isfinite(high)) and np.all(high >= np.float32(np.exp(np.float32(88.0))) * (1 - 1e-6))


def test_the_compiled_loop_calls_no_libm_exp():
    import platform
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("asm of an LLVM CPU target only")
    assert "expf" not in build_exp(64, "float32").inspect_source("asm")


def test_float64_exp_keeps_tvms_lowering():
    a = np.linspace(-700, 700, 1 << 10)
    np.testing.assert_allclose(run(build_exp(len(a), "float64"), a), np.exp(a), rtol=1e-15)
