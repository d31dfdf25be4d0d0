"""Loading a graph's weights: base weights from a loader, derived ones (fused projections) by recipe."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .graph import Graph
from .types import IRError

RECIPES = ("concat",)


def weight_loader(graph: Graph, load: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """A loader for every param of `graph`: `load(name)` for plain weights, recipes applied for derived ones."""
    def get(name: str) -> np.ndarray:
        param = graph.params.get(name)
        if param is None or param.recipe is None:
            return load(name)
        recipe = param.recipe
        if "concat" not in recipe:
            raise IRError(f"param @{name}: unknown recipe {recipe} (known: {', '.join(RECIPES)})")
        out = np.concatenate([get(part) for part in recipe["concat"]], axis=recipe["axis"])
        if out.shape != param.type.shape:
            raise IRError(f"param @{name}: recipe gives shape {out.shape}, declared {param.type}")
        return out
    return get
