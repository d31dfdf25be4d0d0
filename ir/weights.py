"""Loading a graph's weights: base weights from a loader, derived ones by recipe:
    {"concat": [names], "axis": a}        fused projections: the parts joined along axis a
    {"stack": [[names], ...]}             3-D experts [E, out, in]: expert e is its names joined
                                          along axis 0 (gate then up), the experts stacked
    {"quantize": scheme, "of": name, "part": "q" | "scale"[, "group_size": g]}
                                          a quantised weight's part; a 3-D one expert by expert
    {"deinterleave": [[start, width], ...], "of": name}
                                          rows (axis 0) of each span reordered evens then odds:
                                          DeepSeek's interleaved rope pairs made rotate-half pairs
    {"absorb": "k" | "v", "of": kv_b, "heads": H, "nope": N}
                                          MLA's kv_b_proj [H (N + V), R] split per head: "k" gives
                                          W_UK [H, N, R] (head h's N rows), "v" W_UV [H, R, V]
                                          (its V rows, transposed)"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .graph import Graph
from .quant import SCHEMES
from .types import IRError, numpy_dtype

RECIPES = ("concat", "stack", "quantize", "deinterleave", "absorb")


def recipe_sources(recipe: dict) -> list[str]:
    """The params a recipe reads, in order."""
    stacked = [part for parts in recipe.get("stack", ()) for part in parts]
    return list(recipe.get("concat", ())) + stacked + ([recipe["of"]] if "of" in recipe else [])


def plain_reads(graph: Graph, names: list[str]) -> list[str]:
    """The plain params a weight loader reads to make `names` in turn, in the order it reads them,
    each once (a loader keeps what it has just read or quantised)."""
    order: dict[str, None] = {}

    def walk(name: str) -> None:
        param = graph.params.get(name)
        recipe = param.recipe if param is not None else None
        if recipe is None:
            order.setdefault(name)
        for part in recipe_sources(recipe or {}):
            walk(part)
    for name in names:
        walk(name)
    return list(order)


def weight_loader(graph: Graph, load: Callable[[str], np.ndarray], quantizers: dict[str, Callable] | None = None,
                  load_source: Callable[[str], np.ndarray] | None = None,
                  importance: Mapping[str, np.ndarray] | None = None) -> Callable[[str], np.ndarray]:
    """A loader for every param of `graph`: `load(name)` for plain weights, recipes applied for derived ones.

    `quantizers` replaces a scheme's reference quantiser by a faster one that gives the same bytes.
    `load_source(name)` reads a plain weight that only a quantiser will see: it may return it in a
    narrower float dtype whose widening to the graph's is exact (bfloat16 for float32), as every
    quantiser reads its input as float32 anyway. A fused projection (rows concatenated) is quantised
    part by part and the parts joined: every scheme quantises each output row on its own, so the
    bytes are those of quantising the concatenation, without making it. `importance` (plain weight ->
    one float32 per input, from calibration) is given to the schemes that weigh their errors by it.
    (Experts are quantised without: their inputs are the tokens routed to each, not measured.)"""
    quantizers = quantizers or {}
    importance = importance or {}
    load_source = load_source or load
    quantized: dict[tuple[str, str], dict] = {}      # (scheme, source) -> parts: quantise each weight once

    def source(name: str) -> np.ndarray:
        param = graph.params.get(name)
        return load_source(name) if param is None or param.recipe is None else get(name)

    def quantize(recipe: dict) -> dict[str, np.ndarray]:
        scheme = SCHEMES[recipe["quantize"]]
        quantizer = quantizers.get(scheme.name, scheme.quantize)
        options = {"group_size": recipe["group_size"]} if "group_size" in recipe else {}

        def run(w: np.ndarray, name: str | None = None, **options) -> dict[str, np.ndarray]:
            if scheme.weighted and name in importance:
                options["importance"] = importance[name]
            return quantizer(w, **options)

        def stacked(experts: list[dict]) -> dict[str, np.ndarray]:
            return {part: np.stack([e[part] for e in experts]) for part in experts[0]}

        def joined(parts: list[str]) -> dict[str, np.ndarray]:
            pieces = [run(source(part), part, **options) for part in parts]
            return {part: np.concatenate([p[part] for p in pieces], axis=scheme.output_axis(part))
                    for part in pieces[0]}
        fused = graph.params.get(recipe["of"])
        fused_recipe = fused.recipe if fused is not None and fused.recipe else {}
        if "stack" in fused_recipe:              # experts, each quantised on its own
            return stacked([joined(parts) for parts in fused_recipe["stack"]])
        if "concat" in fused_recipe and fused_recipe["axis"] == 0:
            return joined(fused_recipe["concat"])
        w = source(recipe["of"])
        if w.ndim == 3:
            return stacked([run(expert, **options) for expert in w])
        return run(w, recipe["of"], **options)

    def get(name: str) -> np.ndarray:
        param = graph.params.get(name)
        if param is None or param.recipe is None:
            return load(name)
        recipe = param.recipe
        if "concat" in recipe:
            out = np.concatenate([get(part) for part in recipe["concat"]], axis=recipe["axis"])
        elif "stack" in recipe:
            out = np.stack([np.concatenate([get(part) for part in parts], axis=0) for parts in recipe["stack"]])
        elif "quantize" in recipe:
            key = (recipe["quantize"], recipe["of"])
            if key not in quantized:
                quantized.clear()                    # parts of one weight are asked for together
                quantized[key] = quantize(recipe)
            out = quantized[key][recipe["part"]]
            if recipe["part"] == "scale" and out.dtype != numpy_dtype(param.type.dtype):
                # a quantiser's float16 scales in a float32 table (--group-scales float32): widened exactly
                out = out.astype(numpy_dtype(param.type.dtype))
        elif "deinterleave" in recipe:
            out = get(recipe["of"]).copy()
            for start, width in recipe["deinterleave"]:
                span = out[start:start + width].copy()
                out[start:start + width] = np.concatenate([span[0::2], span[1::2]])
        elif "absorb" in recipe:
            kv_b = get(recipe["of"])
            per_head = kv_b.reshape(recipe["heads"], -1, kv_b.shape[1])        # [H, N + V, R]
            nope = recipe["nope"]
            out = np.ascontiguousarray(per_head[:, :nope] if recipe["absorb"] == "k"
                                       else per_head[:, nope:].transpose(0, 2, 1))
        else:
            raise IRError(f"param @{name}: unknown recipe {recipe} (known: {', '.join(RECIPES)})")
        if out.shape != param.type.shape:
            raise IRError(f"param @{name}: recipe gives shape {out.shape}, declared {param.type}")
        return out
    return get
