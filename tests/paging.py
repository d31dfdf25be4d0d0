"""Builds the page-table inputs of one engine step, for tests of the interpreter and of compiled models.

A step is a ragged batch: for each sequence, its new tokens, how many of its
tokens are already in the KV cache, and the pages it owns (in order). The
arrays follow the graph interface of frontend/decoder.py build_graph and the
`paged_attention` op (ir/ops.py).
"""
from __future__ import annotations

import numpy as np

Seq = tuple[list[int], int, list[int]]   # (new token ids, tokens already cached, pages in order)


def make_step_inputs(seqs: list[Seq], page_size: int) -> dict[str, np.ndarray]:
    """tokens, positions, q_indptr, page_indptr, page_values, last_page_len, slot_mapping, logit_rows;
    and kv_slots, kv_indptr (every context row's slot, ir/step_forms.py)."""
    tokens, positions, slots, page_values, kv_slots = [], [], [], [], []
    q_indptr, page_indptr, last_page_len, logit_rows, kv_indptr = [0], [0], [], [], [0]
    for new, start, pages in seqs:
        if not new:
            raise ValueError("every sequence in a step needs at least one new token")
        kv_len = start + len(new)
        n_pages = -(-kv_len // page_size)
        if len(pages) < n_pages:
            raise ValueError(f"{kv_len} tokens need {n_pages} pages of {page_size}, got {len(pages)}")
        pos = range(start, kv_len)
        tokens += new
        positions += pos
        slots += [pages[p // page_size] * page_size + p % page_size for p in pos]
        page_values += pages[:n_pages]
        q_indptr.append(len(tokens))
        page_indptr.append(len(page_values))
        last_page_len.append(kv_len - (n_pages - 1) * page_size)
        logit_rows.append(len(tokens) - 1)
        kv_slots += [pages[p // page_size] * page_size + p % page_size for p in range(kv_len)]
        kv_indptr.append(len(kv_slots))
    arrays = dict(tokens=tokens, positions=positions, q_indptr=q_indptr, page_indptr=page_indptr,
                  page_values=page_values, last_page_len=last_page_len, slot_mapping=slots,
                  logit_rows=logit_rows, kv_slots=kv_slots, kv_indptr=kv_indptr)
    return {k: np.asarray(v, dtype=np.int32) for k, v in arrays.items()}


def kv_pages_for(specs: dict, num_pages: int, fill: float = 0.0) -> dict[str, np.ndarray]:
    """The cache tensors a graph's KV specs (layer -> KVSpec) declare, with `num_pages` pages: pages
    of the spec's dtype filled with `fill` (zeros for quantised rows, whose scales get `fill`)."""
    from kiln.interface import pages_name, scales_name
    from kiln.ir.types import numpy_dtype
    out = {}
    for layer, spec in specs.items():
        shape = spec.page_shape(num_pages)
        quantized = spec.scales == "row"
        out[pages_name(layer)] = np.full(shape, 0 if quantized else fill, numpy_dtype(spec.dtype))
        if quantized:
            out[scales_name(layer)] = np.full(shape[:4], fill, np.float32)
    return out


def make_kv_pages(num_layers: int, num_pages: int, kv_heads: int, page_size: int, head_dim: int,
                  dtype=np.float32, fill: float = 0.0, kv_dtype: str | None = None) -> dict[str, np.ndarray]:
    """KV page tensors kv_pages{i}: [num_pages, 2 (k, v), kv_heads, page_size, head_dim], and for a
    quantised cache (kv_dtype int8 or fp8) their row scales kv_scales{i}: [num_pages, 2, kv_heads, page_size].

    fill=nan makes any read of a slot no step has written show up in the logits.
    """
    shape = (num_pages, 2, kv_heads, page_size, head_dim)
    if kv_dtype is None:
        return {f"kv_pages{i}": np.full(shape, fill, dtype) for i in range(num_layers)}
    from kiln.ir.quant import KV_SCHEMES
    from kiln.ir.types import numpy_dtype
    storage = numpy_dtype(KV_SCHEMES[kv_dtype].storage_dtype)
    out = {}
    for i in range(num_layers):
        out[f"kv_pages{i}"] = np.zeros(shape, storage)
        out[f"kv_scales{i}"] = np.full(shape[:4], fill, np.float32)
    return out


def interpreted_steps(path, ids: list[int], split: int, page_size: int = 16) -> list[np.ndarray]:
    """The model at `path` (any importer's), interpreted: a prefill of ids[:split], then one decode step per
    remaining token over the same three pages (out of order, the rest NaN); the logits of each step's last token."""
    from kiln.frontend import load_model
    from kiln.ir import interpret, verify, weight_loader
    model = load_model(path)
    graph = verify(model.build_graph("float32", page_size))
    weights = weight_loader(graph, lambda name: model.weight(name, "float32"))
    kv = kv_pages_for(graph.kv_specs, 6, fill=np.nan)
    pages = [3, 0, 5]
    steps = [make_step_inputs([(ids[:split], 0, pages)], page_size)]
    steps += [make_step_inputs([([ids[t]], t, pages)], page_size) for t in range(split, len(ids))]
    return [interpret(graph, {**step, **kv}, weights)["logits"][0] for step in steps]
