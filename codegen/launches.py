"""Count the kernel launches one call of a compiled Relax function makes (after the Relax pipeline)."""
from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax

RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"


def is_kernel(func) -> bool:
    """A compiled kernel, not one of the host-side shape functions TVM's VMShapeLower writes (their
    number varies between compiles of one model: TVM merges them only when their statements happen to
    come out in the same order)."""
    return isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_host_func"))


def kernel_names(mod: tvm.IRModule) -> list[str]:
    """The names of the module's kernels, sorted."""
    return sorted(gv.name_hint for gv, func in mod.functions.items() if is_kernel(func))


def _calls(mod: tvm.IRModule, func_name: str):
    for block in mod[func_name].body.blocks:
        for binding in block.bindings:
            if isinstance(binding.value, relax.Call):
                yield binding.value


def kernel_launches(mod: tvm.IRModule, func_name: str = "forward") -> Counter:
    """kernel name -> launches per call of `func_name`, over its straight-line body, kernels replayed
    inside its CUDA graphs included.

    Host-side shape functions are not kernels and are not counted."""
    counts: Counter = Counter()
    for call in _calls(mod, func_name):
        if isinstance(call.op, tvm.ir.GlobalVar) and is_kernel(mod[call.op]):
            counts[call.op.name_hint] += 1
    for captured in graph_captures(mod, func_name):
        counts.update(kernel_launches(mod, captured))
    return counts


def graph_captures(mod: tvm.IRModule, func_name: str) -> list[str]:
    """The functions `func_name` replays as CUDA graphs (TVM's RewriteCUDAGraph), one per graph launch."""
    names = []
    for call in _calls(mod, func_name):
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_builtin_with_ctx" \
                and isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == RUN_OR_CAPTURE:
            names.append(call.args[1].fields[0].name_hint)
    return names


def host_launches(mod: tvm.IRModule, func_name: str) -> int:
    """Launches the host issues per call: kernels outside CUDA graphs, plus one per graph."""
    captured = sum(sum(kernel_launches(mod, name).values()) for name in graph_captures(mod, func_name))
    return sum(kernel_launches(mod, func_name).values()) - captured + len(graph_captures(mod, func_name))
