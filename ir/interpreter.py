"""The NumPy reference interpreter: runs any graph with the op table's reference semantics.

It is the oracle for passes and codegen. Inputs that an op mutates (the KV
pages) are updated in place in the arrays the caller passed.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .graph import Graph
from .ops import OPS
from .types import IRError, numpy_dtype


def _bind_dims(graph: Graph, values: Mapping[str, np.ndarray]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for name, ty in graph.inputs.items():
        arr = values[name]
        if arr.ndim != ty.rank:
            raise IRError(f"input %{name}: expected rank {ty.rank} ({ty}), got shape {arr.shape}")
        for d, n in zip(ty.shape, arr.shape):
            if isinstance(d, str):
                if dims.setdefault(d, n) != n:
                    raise IRError(f"input %{name}: dim {d} is {n} here but {dims[d]} elsewhere")
            elif d != n:
                raise IRError(f"input %{name}: expected {ty}, got shape {arr.shape}")
    return dims


def interpret(graph: Graph, inputs: Mapping[str, np.ndarray],
              weights: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Run `graph`; `weights(name)` supplies each param's array. Returns the outputs by name."""
    missing = [k for k in graph.inputs if k not in inputs]
    if missing:
        raise IRError(f"missing graph inputs: {missing}")
    env: dict[str, np.ndarray] = {}
    for k, ty in graph.inputs.items():
        arr = inputs[k]
        if arr.dtype != numpy_dtype(ty.dtype):
            raise IRError(f"input %{k}: expected dtype {ty.dtype}, got {arr.dtype}")
        env[k] = arr
    dims = _bind_dims(graph, env)
    for p in graph.params.values():
        env[p.name] = weights(p.name)
    for node in graph.nodes:
        args = [None if i is None else env[i] for i in node.inputs]
        env[node.output] = OPS[node.op].reference(args, node.attrs, node.type, dims)
    return {o: env[o] for o in graph.outputs}
