"""Loading a graph's weights: base weights from a loader, derived ones (fused projections) by recipe."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .graph import Graph
from .quant import SCHEMES
from .types import IRError

RECIPES = ("concat", "quantize")


def weight_loader(graph: Graph, load: Callable[[str], np.ndarray],
                  quantizers: dict[str, Callable] | None = None) -> Callable[[str], np.ndarray]:
    """A loader for every param of `graph`: `load(name)` for plain weights, recipes applied for derived ones.
    `quantizers` replaces a scheme's reference quantiser by a faster one that gives the same bytes."""
    quantizers = quantizers or {}
    quantized: dict[tuple[str, str], dict] = {}      # (scheme, source) -> parts: quantise each weight once

    def get(name: str) -> np.ndarray:
        param = graph.params.get(name)
        if param is None or param.recipe is None:
            return load(name)
        recipe = param.recipe
        if "concat" in recipe:
            out = np.concatenate([get(part) for part in recipe["concat"]], axis=recipe["axis"])
        elif "quantize" in recipe:
            key = (recipe["quantize"], recipe["of"])
            if key not in quantized:
                quantized.clear()                    # parts of one weight are asked for together
                options = {"group_size": recipe["group_size"]} if "group_size" in recipe else {}
                quantize = quantizers.get(recipe["quantize"], SCHEMES[recipe["quantize"]].quantize)
                quantized[key] = quantize(get(recipe["of"]), **options)
            out = quantized[key][recipe["part"]]
        else:
            raise IRError(f"param @{name}: unknown recipe {recipe} (known: {', '.join(RECIPES)})")
        if out.shape != param.type.shape:
            raise IRError(f"param @{name}: recipe gives shape {out.shape}, declared {param.type}")
        return out
    return get
