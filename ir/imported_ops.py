"""Ops an imported graph spells kiln's ops with, before passes/raise_patterns.py raises them (ONNX's
Sigmoid, Pow/ReduceMean/Sqrt/Reciprocal of an RMSNorm, Cos/Sin/Concat of a rotary embedding, broadcasting
Mul and Add). No target lowers them: the pass refuses a graph that still holds one, naming it.

`bcast_mul` and `bcast_add` broadcast as NumPy does (dims right-aligned, each pair equal or one of them 1); the
rest are elementwise or over the last axis. All compute in float32 and
round to the node's dtype."""
from __future__ import annotations

import numpy as np

from .opdef import REQUIRED, as_type, f32, need_float, op
from .types import TensorType

IMPORTED_OPS = ("sigmoid", "bcast_mul", "bcast_add", "add_scalar", "mean_last", "sqrt", "reciprocal", "cos", "sin",
                "concat")


def _unary(name: str, fn, doc: str):
    def fns():
        def rule(types, attrs, fail):
            need_float(types[0], "x", fail)
            return types[0]
        return rule, lambda x, at, ty, dims: as_type(fn(f32(x[0])), ty)
    fns.__doc__ = doc
    op(name, ["x"])(fns)


_unary("sigmoid", lambda v: 1.0 / (1.0 + np.exp(-v)), "1 / (1 + exp(-x)) (ONNX Sigmoid).")
_unary("sqrt", np.sqrt, "sqrt(x).")
_unary("reciprocal", lambda v: np.float32(1) / v, "1 / x.")
_unary("cos", np.cos, "cos(x).")
_unary("sin", np.sin, "sin(x).")


def _broadcast(types, attrs, fail):
    a, b = types
    need_float(a, "a", fail)
    if a.dtype != b.dtype:
        fail(f"operands of two dtypes, {a} and {b}")
    longer, shorter = (a.shape, b.shape) if a.rank >= b.rank else (b.shape, a.shape)
    shape = list(longer)
    for i, (x, y) in enumerate(zip(longer[::-1], shorter[::-1])):
        if x != y and 1 not in (x, y):
            fail(f"{a} and {b} do not broadcast")
        shape[len(shape) - 1 - i] = y if x == 1 else x
    return TensorType(tuple(shape), a.dtype)


def _binary(name: str, fn, doc: str):
    def fns():
        return _broadcast, lambda x, at, ty, dims: as_type(fn(f32(x[0]), f32(x[1])), ty)
    fns.__doc__ = doc
    op(name, ["a", "b"])(fns)


_binary("bcast_mul", np.multiply, "a * b, b broadcast onto a's shape.")
_binary("bcast_add", np.add, "a + b, b broadcast onto a's shape.")


@op("add_scalar", ["x"], {"value": REQUIRED})
def _add_scalar():
    """x + value (an RMSNorm's epsilon)."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        return types[0]
    return rule, lambda x, at, ty, dims: as_type(f32(x[0]) + np.float32(at["value"]), ty)


@op("mean_last", ["x"])
def _mean_last():
    """The mean over the last axis, kept as an axis of 1 ([..., n] -> [..., 1])."""
    def rule(types, attrs, fail):
        need_float(types[0], "x", fail)
        return TensorType(types[0].shape[:-1] + (1,), types[0].dtype)
    return rule, lambda x, at, ty, dims: as_type(f32(x[0]).mean(axis=-1, keepdims=True), ty)


@op("concat", ["a", "b"])
def _concat():
    """a and b joined along the last axis (their other dims equal)."""
    def rule(types, attrs, fail):
        a, b = types
        if a.dtype != b.dtype or a.shape[:-1] != b.shape[:-1] or not all(
                isinstance(t.shape[-1], int) for t in (a, b)):
            fail(f"concat needs equal leading dims and dtypes, got {a} and {b}")
        return TensorType(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.dtype)
    return rule, lambda x, at, ty, dims: np.concatenate([np.asarray(x[0]), np.asarray(x[1])], axis=-1)
