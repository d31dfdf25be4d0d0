"""The op table's core: `OpDef`, the registry `OPS` and the `op` decorator that fills it, and the
helpers every op family's type rules and NumPy references share (ir/ops.py and the families it
imports: kv_ops, mla_ops, moe_ops, step_forms)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .quant import kv_scheme_for
from .types import FLOAT_DTYPES, IRError, TensorType, numpy_dtype

REQUIRED = object()


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[str, ...]                 # input names; a trailing "?" marks an optional input
    attrs: dict                             # attribute name -> default (REQUIRED if none)
    type_rule: Callable                     # (types, attrs, fail) -> TensorType
    reference: Callable                     # (arrays, attrs, out_type, dims) -> np.ndarray
    mutates: tuple[int, ...] = ()           # inputs written in place (the KV pages)
    doc: str = ""

    def input_of(self, node, name: str) -> str | None:
        """The value `node` passes as its input `name` (None for an optional one left out)."""
        index = [n.rstrip("?") for n in self.inputs].index(name)
        return node.inputs[index] if index < len(node.inputs) else None

    def complete_attrs(self, attrs: dict, where: str) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise IRError(f"{where}: op {self.name} has no attribute(s) {sorted(unknown)}")
        out = {}
        for k, default in self.attrs.items():
            if k in attrs:
                out[k] = attrs[k]
            elif default is REQUIRED:
                raise IRError(f"{where}: op {self.name} needs attribute {k!r}")
            else:
                out[k] = default
        return out

    def infer(self, types: list, attrs: dict, where: str) -> TensorType:
        required = [n for n in self.inputs if not n.endswith("?")]
        if not len(required) <= len(types) <= len(self.inputs):
            raise IRError(f"{where}: {self.name} takes inputs ({', '.join(self.inputs)}), got {len(types)}")
        for i, t in enumerate(types):
            if t is None and not self.inputs[i].endswith("?"):
                raise IRError(f"{where}: input {self.inputs[i]!r} of {self.name} is missing")

        def fail(rule: str):
            raise IRError(f"{where}: {rule}")
        return self.type_rule(types + [None] * (len(self.inputs) - len(types)), attrs, fail)


OPS: dict[str, OpDef] = {}


def input_of(node, name: str) -> str | None:
    """The value `node` passes as its input `name` (None for an optional one left out)."""
    return OPS[node.op].input_of(node, name)


def attrs_for(op_name: str, **attrs) -> dict:
    """`attrs` with `op_name`'s defaults for the rest: what a pass gives a node it makes or rewrites."""
    return OPS[op_name].complete_attrs(attrs, f"a new {op_name} node")


def named_inputs(op_name: str, **values) -> list:
    """`op_name`'s inputs in its order, from their names; absent ones are None, trailing ones left off."""
    names = [n.rstrip("?") for n in OPS[op_name].inputs]
    unknown = set(values) - set(names)
    if unknown:
        raise IRError(f"op {op_name} has no input(s) {sorted(unknown)}")
    inputs = [values.get(n) for n in names]
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs


def op(name, inputs, attrs=None, mutates=()):
    def register(fns):
        type_rule, reference = fns()
        OPS[name] = OpDef(name, tuple(inputs), dict(attrs or {}), type_rule, reference, tuple(mutates),
                          (fns.__doc__ or "").strip())
        return fns
    return register


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def as_type(a: np.ndarray, ty: TensorType) -> np.ndarray:
    return np.asarray(a).astype(numpy_dtype(ty.dtype))


def need_float(t: TensorType, what: str, fail):
    if t.dtype not in FLOAT_DTYPES:
        fail(f"{what} must be a float tensor, got {t}")


def gelu_tanh_f32(v: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation, in float32: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * v * (np.float32(1) + np.tanh(c * (v + np.float32(0.044715) * v * v * v)))


ACTIVATIONS = {"silu": lambda v: v / (1.0 + np.exp(-v)), "gelu_tanh": gelu_tanh_f32}


def check_kv_pages(pages: TensorType, scales, kv_heads, head_dim, dtype: str, fail) -> None:
    """The type rule of a layer's KV pages (and their row scales when quantised)."""
    if pages.rank != 5 or pages.shape[1] != 2 or pages.shape[2] != kv_heads or pages.shape[4] != head_dim:
        fail(f"kv_pages must be [pages, 2, {kv_heads}, page_size, {head_dim}], got {pages}")
    check_kv_storage(pages, scales, dtype, fail)


def check_kv_storage(pages: TensorType, scales, dtype: str, fail) -> None:
    """Pages in the activations' dtype, or a KV quantisation's with float32 scales per row."""
    if kv_scheme_for(pages.dtype) is not None:
        want = TensorType(pages.shape[:4], "float32")
        if scales != want:
            fail(f"quantised {pages.dtype} kv_pages need kv_scales {want}, got {scales}")
    elif pages.dtype != dtype:
        fail(f"kv_pages dtype {pages.dtype} differs from the activations' {dtype} and is no KV quantisation")
    elif scales is not None:
        fail(f"kv_scales given for unquantised {pages.dtype} kv_pages")


def check_indices(tensors: dict, fail) -> None:
    for name, t in tensors.items():
        if t.dtype != "int32" or t.rank != 1:
            fail(f"{name} must be a 1-D i32 tensor, got {t}")
