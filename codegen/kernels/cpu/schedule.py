"""Schedules for the CPU kernels TVM legalises from Relax ops (fused elementwise chains, norms).

TVM's CPU pipeline leaves them as it legalised them: one thread, scalar loops. In a 128-token
prefill of a 1B model that was ~10% of the step (the SwiGLU product alone 70 ms of 800). After
FuseTIR, for every function kiln did not schedule itself:
  - injective functions (every block spatial: casts, SwiGLU's split + silu + multiply, rope):
    producers inlined, the leading loops fused and run in parallel, the innermost loop vectorised
    where the vector width divides it;
  - norms and softmaxes: dlight's CPU reduction rule (rows in parallel, the elementwise parts
    vectorised).
Schedules reorder no arithmetic: outputs are the same bits.
"""
from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target.codegen import llvm_get_vector_width


class ParallelInjective(CPUScheduleRule):
    """Injective functions: parallel over the leading loops, vectorised along the last."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(info.is_injective() for info in infos):
            return None
        try:
            kept = []
            for info in infos[:-1]:
                try:
                    sch.compute_inline(info.block_rv)
                except s_tir.ScheduleError:          # e.g. a block writing one of the outputs
                    kept.append(info.block_rv)
            for block in kept + [infos[-1].block_rv]:
                self._parallel_vectorised(sch, block, target)
        except s_tir.ScheduleError:
            return None
        return sch

    @staticmethod
    def _parallel_vectorised(sch, block, target):
        loops = sch.get_loops(block)
        if not loops:
            return
        bits = max(sch.get(block).writes[0].source.dtype.bits, 8) if sch.get(block).writes else 32
        lanes = max((llvm_get_vector_width(target) or 128) // bits, 1)
        extent = get_extent(sch, loops[-1])
        inner = None
        if isinstance(extent, int) and extent % lanes == 0 and extent > lanes:
            outer, inner = sch.split(loops[-1], [None, lanes])
            loops = [*loops[:-1], outer]
        sch.parallel(sch.fuse(*loops) if len(loops) > 1 else loops[0])
        if inner is not None:
            sch.vectorize(inner)


class _Guarded(CPUScheduleRule):
    """A rule whose failure to schedule a function leaves that function as it was."""

    def __init__(self, rule):
        self.rule = rule

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except (s_tir.ScheduleError, ValueError, AssertionError):
            return None


def schedule_cpu_kernels():
    """The module pass that schedules every PrimFunc not yet marked scheduled."""
    return dlight.ApplyDefaultSchedule(ParallelInjective(), _Guarded(dlight.cpu.Reduction()))
