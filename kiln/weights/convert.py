"""A checkpoint's weights written as an artifact stores them: read, converted, fused, quantised and laid
out one stored tensor at a time (compile and `kiln attach-weights` both write them here)."""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

PROGRESS_BYTES = 256 << 20     # weights smaller than this are written without a progress line


def write_weights(model, graph, stored, dtype: str, path: Path, progress=None, importance=None) -> str:
    """Stream the artifact's weights to `path`, one stored tensor at a time: read from the checkpoint,
    convert, fuse, quantise (weighing inputs by `importance` where calibrated), lay out, write, drop. A
    param that several stored tensors come from is kept only until its last one is written. Return the
    file's BLAKE3, hashed as it is written."""
    from kiln.artifact import new_hasher
    from kiln.codegen.quantizers import fast_quantizers
    from kiln.ir import plain_reads, weight_loader
    from kiln.safetensors_io import TensorSpec, write_safetensors
    from kiln.selection.layouts import apply_layout

    def declared(name: str) -> str:       # a param may keep another dtype (DeepSeek's float32 router)
        return graph.params[name].type.dtype if name in graph.params else dtype

    load = weight_loader(graph, lambda name: model.weight(name, declared(name)), quantizers=model.quantizers(fast_quantizers()),
                         load_source=lambda name: model.weight_source(name, declared(name)), importance=importance)
    model.checkpoint.read_ahead(plain_reads(graph, [w.param for w in stored]))
    uses_left = Counter(w.param for w in stored)
    held: dict[str, object] = {}
    by_name = {w.name: w for w in stored}
    # safetensors' NumPy side has no float8: it is stored as its bytes, the manifest keeps the dtype.
    specs = [TensorSpec(w.name, tuple(w.shape), "uint8" if w.dtype.startswith("float8") else w.dtype)
             for w in stored]

    def produce(spec):
        w = by_name[spec.name]
        source = held.pop(w.param) if w.param in held else load(w.param)
        uses_left[w.param] -= 1
        if uses_left[w.param]:
            held[w.param] = source
        arr = apply_layout(w.layout, source)
        if tuple(arr.shape) != tuple(w.shape):
            raise KilnError(f"weight {w.param} has shape {arr.shape}, the graph expects {w.shape}")
        return arr.view(np.uint8) if arr.dtype.name.startswith("float8") else arr

    hasher = new_hasher()
    before = [0, *itertools.accumulate(spec.nbytes for spec in specs)]      # bytes written before each
    total = before[-1]

    def step(i, spec):
        if progress and total >= PROGRESS_BYTES:
            progress(f"{i + 1}/{len(specs)} {spec.name} ({before[i] / 2**30:.1f}/{total / 2**30:.1f} GiB)",
                     before[i] / total)
    write_safetensors(path, specs, produce, metadata={"format": "kiln"}, hasher=hasher, progress=step)
    return hasher.hexdigest()
