"""What the GPU tests compare a float32 CUDA artifact with: the interpreter on the graph it was built from."""
from __future__ import annotations

from pathlib import Path


def float32_artifact_and_reference(folder: Path, kv_pages: int):
    """(model, graph, weights, kv) for folder's cuda-float32 artifact: the model with its KV cache,
    and what the interpreter needs to run the graph that artifact was compiled from."""
    from kiln.frontend import load_hf_model
    from kiln.ir import weight_loader
    from kiln.passes import run_pipeline
    from kiln.runtime.model import CompiledModel
    from paging import kv_pages_for
    model = CompiledModel(folder / "cuda-float32")
    model.allocate_kv(kv_pages * model.bytes_per_page)
    hf_model = load_hf_model(folder / "model")
    graph, _ = run_pipeline(hf_model.build_graph("float32", model.page_size), "cuda")
    weights = weight_loader(graph, lambda name: hf_model.weight(name, "float32"))
    return model, graph, weights, kv_pages_for(graph.kv_specs, kv_pages + 1)     # MLA's latent rows too
