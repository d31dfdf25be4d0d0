"""A layer's KV cache as graph inputs: the typed inputs that hold the pages (and row scales) a
KVSpec (kiln/interface.py, the contract compile and the runtime share) declares."""
from __future__ import annotations

from kiln.interface import KVSpec

from .types import TensorType


def input_types(spec: KVSpec, layer: int) -> dict[str, TensorType]:
    """The graph inputs holding layer `layer`'s cache, with a symbolic page count."""
    return {name: TensorType(shape, dtype) for name, (shape, dtype) in spec.tensors(layer, "pages").items()}
