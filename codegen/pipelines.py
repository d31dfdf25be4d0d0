"""The Relax pipeline a lowered module runs before it is built, by target: on CPUs TVM's CPU pipeline
(legalise, fuse elementwise chains, lower to the VM) with the kernels it legalised scheduled after
fusion (codegen/kernels/cpu/schedule.py); kiln's own kernels are opaque (op_pattern 8) and keep their
schedules. GPU targets keep theirs (dlight's rules, TVM's CUDA graph rewrite: targets/base.py)."""
from __future__ import annotations

import tvm
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from .kernels.cpu.schedule import schedule_cpu_kernels


def relax_pipeline(target):
    """A module pass: the pipeline `target` builds a lowered module with."""
    if target.device != "cpu":
        return target.relax_pipeline()
    llvm = target.tvm_target()

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod, _ctx):
        with llvm:
            return tvm.transform.Sequential(
                cpu_generic.library_dispatch_passes(llvm) + cpu_generic.legalize_passes(llvm)
                + [schedule_cpu_kernels()] + cpu_generic.dataflow_lower_passes(llvm)
                + cpu_generic.finalize_passes(llvm))(mod)
    return pipeline
