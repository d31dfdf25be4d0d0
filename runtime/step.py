"""Build the compiled forward's inputs for one ragged step (interface version 1).

One step: the new tokens of several sequences flattened in order. For each
sequence: its queries' offsets (q_indptr), its page list in CSR form
(page_indptr, page_values), the rows used in its last page, and the rows whose
logits come back (logit_rows): its last new token's, or every new token's when
the sequence asked for them (prompt logprobs). For each token: position and KV slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SeqChunk:
    tokens: list[int]       # new tokens of this sequence in this step
    start_pos: int          # tokens of this sequence already in the KV cache
    pages: list[int]        # the sequence's pages, covering start_pos + len(tokens) rows
    slots: list[int]        # the KV slot of each new token
    all_rows: bool = False  # return the logits of every new token, not only the last


def output_offsets(chunks: list[SeqChunk]) -> list[int]:
    """Where each chunk's first returned logits row lands in forward's output (and, last, the row count)."""
    offsets = [0]
    for c in chunks:
        offsets.append(offsets[-1] + (len(c.tokens) if c.all_rows else 1))
    return offsets


def step_inputs(chunks: list[SeqChunk], page_size: int) -> dict[str, np.ndarray]:
    lens = [len(c.tokens) for c in chunks]
    q_indptr = np.zeros(len(chunks) + 1, np.int32)
    q_indptr[1:] = np.cumsum(lens)
    page_indptr = np.zeros(len(chunks) + 1, np.int32)
    page_indptr[1:] = np.cumsum([len(c.pages) for c in chunks])
    kv_lens = [c.start_pos + n for c, n in zip(chunks, lens)]
    rows = [np.arange(q_indptr[i], q_indptr[i + 1]) if c.all_rows else [q_indptr[i + 1] - 1]
            for i, c in enumerate(chunks)]
    return {
        "tokens": np.array([t for c in chunks for t in c.tokens], np.int32),
        "positions": np.concatenate([np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
                                     for c, n in zip(chunks, lens)]),
        "q_indptr": q_indptr,
        "page_indptr": page_indptr,
        "page_values": np.array([p for c in chunks for p in c.pages], np.int32),
        "last_page_len": np.array([n - (len(c.pages) - 1) * page_size for c, n in zip(chunks, kv_lens)], np.int32),
        "slot_mapping": np.array([s for c in chunks for s in c.slots], np.int32),
        "logit_rows": np.concatenate(rows).astype(np.int32),
    }
