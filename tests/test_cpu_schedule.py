"""codegen/kernels/cpu/schedule.py: the kernels TVM legalises for the CPU get a parallel, vectorised
schedule after fusion, compute what they computed before (against NumPy), and kiln's own
scheduled kernels are left as they are."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")


def _swiglu_module(tokens: int, width: int):
    from tvm import relax
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((tokens, 2 * width), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            halves = bb.emit(relax.op.split(x, 2, axis=1))
            act = bb.emit(relax.op.nn.silu(bb.emit(relax.TupleGetItem(halves, 0))))
            out = bb.emit_output(relax.op.multiply(act, bb.emit(relax.TupleGetItem(halves, 1))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.build
def test_a_fused_elementwise_kernel_runs_parallel_and_vectorised_and_equals_numpy():
    from tvm import relax
    from kiln.codegen.kernels.cpu.schedule import schedule_cpu_kernels
    from kiln.codegen.pipelines import relax_pipeline
    from kiln.targets.cpu import CPUTarget
    target = CPUTarget()
    mod = _swiglu_module(5, 256)
    with target.tvm_target():
        lowered = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                            relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
        scheduled = schedule_cpu_kernels()(lowered)
    kernels = [f for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels and all(f.attrs["tirx.is_scheduled"] for f in kernels)
    text = "".join(f.script() for f in kernels)
    assert "T.parallel(" in text and "T.vectorized(" in text, text

    built = tvm.compile(mod, target=target.tvm_target(), relax_pipeline=relax_pipeline(target))
    vm = relax.VirtualMachine(built, tvm.cpu())
    x = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32)
    gate, up = x[:, :256], x[:, 256:]
    want = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want, rtol=1e-5, atol=1e-6)


def test_kilns_own_scheduled_kernels_are_left_alone():
    from tvm.script import tirx as T
    from kiln.codegen.kernels.cpu.schedule import schedule_cpu_kernels
    from kiln.targets.cpu import CPUTarget

    @T.prim_func(private=True, s_tir=True)
    def double(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for i in range(64):
            with T.sblock("double"):
                v = T.axis.spatial(64, i)
                b[v] = a[v] * T.float32(2)
    mod = tvm.IRModule({"double": double})
    with CPUTarget().tvm_target():
        after = schedule_cpu_kernels()(mod)
    tvm.ir.assert_structural_equal(after["double"], mod["double"])
