"""Count the kernel launches one call of a compiled Relax function makes (after the Relax pipeline)."""
from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax


def kernel_launches(mod: tvm.IRModule, func_name: str = "forward") -> Counter:
    """kernel name -> launches per call of `func_name`, over its straight-line body.

    Host-side shape functions are not kernels and are not counted."""
    counts: Counter = Counter()
    for block in mod[func_name].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar) \
                    and isinstance(mod[call.op], tvm.tirx.PrimFunc) and not call.op.name_hint.startswith("shape_func"):
                counts[call.op.name_hint] += 1
    return counts
