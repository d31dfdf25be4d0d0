"""The NumPy reference interpreter: runs any graph with the op table's reference semantics.

It is the oracle for passes and codegen. Inputs that an op mutates (the KV
pages) are updated in place in the arrays the caller passed. A param is read
when a node first needs it, and each value and param is let go after its last
reader: a run holds the live values, not the whole graph's.
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


def interpret(graph: Graph, inputs: Mapping[str, np.ndarray], weights: Callable[[str], np.ndarray],
              observe: Callable | None = None) -> dict[str, np.ndarray]:
    """Run `graph`; `weights(name)` supplies each param's array. Returns the outputs by name.
    `observe(node, args)` sees each node's arguments before it runs (calibration measures inputs)."""
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
    last_read = {name: i for i, node in enumerate(graph.nodes) for name in node.inputs if name is not None}
    kept = set(graph.inputs) | set(graph.outputs)
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            if name is not None and name not in env and name in graph.params:
                env[name] = weights(name)
        args = [None if name is None else env[name] for name in node.inputs]
        if observe is not None:
            observe(node, args)
        env[node.output] = OPS[node.op].reference(args, node.attrs, node.type, dims)
        for name in node.inputs:
            if name is not None and last_read[name] == i and name not in kept:
                env.pop(name, None)
    return {o: env[o] if o in env else weights(o) for o in graph.outputs}
