"""The state of translating one ONNX graph (frontend/onnx_graph.py): what each ONNX value has become, the kiln
graph being built, and how each param will be read."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kiln.errors import KilnError
from kiln.ir import Graph, GraphBuilder, IRError

from .onnx_file import ONNXFile

LOGITS = "logits"


class Mask:
    """A value computed from the attention mask (sequence lengths): the engine's step inputs hold it."""


@dataclass(frozen=True)
class Init:
    name: str


@dataclass(frozen=True)
class Reshaped:
    """An initializer viewed in another shape (read when a weight needs it)."""
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Transposed:
    """A 2-D initializer read transposed (a tied table: the LM head's [hidden, vocab] MatMul weight)."""
    name: str


@dataclass(frozen=True)
class SymVec:
    """A shape or part of one, as shape arithmetic computes it: ints and symbolic dims ("b", "s", "t", ...)."""
    dims: tuple


@dataclass(frozen=True)
class Layout:
    """How a kiln value holds an ONNX activation: rows ([b, s, F] as kiln's [tokens, F]; a 1-D kiln value is
    [b, s]) or heads ([b, s, h, d], or [b, h, s, d] when transposed, as kiln's [tokens, h, d])."""
    heads: int = 0
    transposed: bool = False


@dataclass(frozen=True)
class KVFull:
    """A layer's keys or values, past and new (Concat(past, new) and the views attention takes of it): the new
    rows are kiln value `new` [tokens, kv_heads, head_dim]; `factor` a scale multiplied in."""
    layer: int
    which: str
    new: str
    factor: float = 1.0


@dataclass(frozen=True)
class Scaled:
    """An attention query times a scalar (the decomposed SDPA splits its scale between q and k)."""
    value: str
    factor: float


@dataclass(frozen=True)
class Scores:
    """Attention scores of query `q` over layer `layer`'s keys (softmax taken: `probs`), scaled by `scale`."""
    q: str
    keys: str               # the layer's new keys (kiln value [tokens, kv_heads, head_dim])
    layer: int
    scale: float
    probs: bool = False


@dataclass(frozen=True, eq=False)
class Const:
    value: np.ndarray


@dataclass(frozen=True)
class KV:
    layer: int
    which: str              # "key" or "value"
    present: bool = False


@dataclass
class Layer:
    """What attention layer `index` was found to be (frontend/onnx_attention.py fills it)."""
    index: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0
    rope: str | None = None          # the inverse-frequency param it turns q and k with


class NBitsNode(NamedTuple):
    """A MatMulNBits weight as the compile's defaults see it."""
    param: str
    scheme: str                     # the kiln format that holds its blocks exactly (q4, q4a)
    block: int
    accuracy_level: int             # 4: its activations rounded to int8 in blocks (ONNX Runtime's CPU kernel)
    scale_type: str                 # the file's scales' element type, as ONNX names it (float, float16)


@dataclass
class Translation:
    file: ONNXFile
    dtype: str
    page_size: int
    b: GraphBuilder = None
    env: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)       # kiln param -> thunk giving its array (or NBitsMatrix)
    record: dict = field(default_factory=dict)        # (tensor, what became of it) -> True
    layers: dict[int, Layer] = field(default_factory=dict)
    rope: dict = field(default_factory=dict)          # (cos, sin) initializers -> (param, inv_freq, mscale)
    eps: list = field(default_factory=list)
    nbits: list[NBitsNode] = field(default_factory=list)
    scale_dtype: str = "float16"    # what kiln stores the blocks' scales in (ONNXModel.default_options chooses)
    readers: Counter = field(default_factory=Counter)
    head_output: str = LOGITS                          # the value the logits output casts (or is)
    tensor_types: Counter = field(default_factory=Counter)   # the file's matrices, by how it stores them
    step: dict = field(default_factory=dict)
    kv_pages: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)         # kiln value -> Layout (absent: rows)
    graph: Graph | None = None                        # the result, verified

    # ------------------------------------------------------------------ values
    def fail(self, node, why: str) -> KilnError:
        return KilnError(f"{self.file.path}: node {node.name or '(unnamed)'!r} ({node.op_type}) {why}")

    def value(self, name: str, node):
        if name not in self.env:
            raise self.fail(node, f"reads {name!r}, which nothing defines")
        return self.env[name]

    def tensor(self, name: str, node) -> str:
        v = self.value(name, node)
        if not isinstance(v, str):
            raise self.fail(node, f"reads {name!r} as an activation, but it is {_kind(v)}")
        return v

    def constant(self, name: str, node) -> np.ndarray | None:
        v = self.value(name, node)
        if isinstance(v, Const):
            return v.value
        if isinstance(v, Init) and int(np.prod(self.file.shape(v.name))) <= 1 << 16:
            return self.file.array(v.name)
        return None

    def matrix(self, name: str, stored: str | None = None) -> None:
        """Count a matrix the graph multiplies by, as the file stores it (the source record's tensor types)."""
        self.tensor_types[stored or self.file.stored_type(name)] += 1

    def param(self, name: str, shape, thunk, dtype: str | None = None) -> str:
        kiln_name = re.sub(r"[^A-Za-z0-9_.]", "_", name)
        self.weights.setdefault(kiln_name, thunk)
        return self.b.param(kiln_name, shape, dtype or self.dtype)

    def op(self, op: str, *inputs, node=None, **attrs) -> str:
        try:
            return self.b.op(op, *inputs, **attrs)
        except IRError as e:
            raise self.fail(node, f"does not fit kiln's {op}: {e}") from None


def _kind(v) -> str:
    return {Mask: "the attention mask's bookkeeping", Init: f"initializer {getattr(v, 'name', '')!r}",
            Const: "a constant", KV: "a layer's keys or values", Reshaped: "a reshaped initializer",
            Transposed: "a transposed initializer", SymVec: "shape arithmetic", KVFull: "a layer's keys or values",
            Scaled: "a scaled attention query", Scores: "attention scores"}.get(type(v), "an activation")
