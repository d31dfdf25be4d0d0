"""quantize_kv: the KV cache stores int8 (or float8 e4m3) rows with a float32 scale per row.

Rewrite (mode int8; fp8 is the same with f8e4m3 pages; every KV op of the layer gets the scales,
latent layers' too: one scale per latent row):
    %kv_pages3: f16[pages, 2, H, S, D]                               (a graph input)
    %o = paged_attention(%q, %k, %v, %kv_pages3, …) {layer=3}
  ->
    %kv_pages3: i8[pages, 2, H, S, D]    %kv_scales3: f32[pages, 2, H, S]   (new graph input)
    %o = paged_attention(%q, %k, %v, %kv_pages3, …, %kv_scales3) {layer=3}
The attention op quantises each new row (one token, one KV head, k or v) as it writes it and
dequantises rows as it reads them (ir/ops.py paged_attention): the pages take 1 byte per value
plus 4 bytes per row instead of 2 or 4 bytes per value.
The layer's KVSpec records the change (storage dtype, row scales); its inputs are retyped from it.
Requires: the layer's pages are read by its KV ops alone (kv_append, paged_attend or a fused form).
Leaves: q, k, v and the attention output keep their types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.interface import pages_name, scales_name
from kiln.ir import Graph
from kiln.ir.kv_spec import input_types
from kiln.ir.ops import APPEND_OPS, KV_OPS
from kiln.ir.quant import KV_SCHEMES

from .graph_pass import GraphPass
from .rewrite import users


@dataclass(frozen=True)
class QuantizeKV(GraphPass):
    name: ClassVar[str] = "quantize_kv"
    mode: str = "int8"

    def __post_init__(self):
        if self.mode not in KV_SCHEMES:
            raise ValueError(f"unknown KV cache dtype {self.mode!r} (known: {', '.join(KV_SCHEMES)})")

    def rewrite(self, graph: Graph) -> Graph:
        storage = KV_SCHEMES[self.mode].storage_dtype
        readers = users(graph)
        for layer, spec in list(graph.kv_specs.items()):
            pages = pages_name(layer)
            if spec.scales == "row" or any(n.op not in KV_OPS for n in readers[pages]):
                continue                          # already quantised, or the rows are read elsewhere too
            graph.kv_specs[layer] = spec = spec.quantized(storage)
            graph.inputs.update(input_types(spec, layer))
            for node in graph.nodes:
                if node.op in KV_OPS and node.attrs["layer"] == layer:
                    node.inputs = node.inputs + [scales_name(layer)]
                    if node.op in APPEND_OPS:     # its result is the (now quantised) pages
                        node.type = graph.inputs[pages]
        return graph
