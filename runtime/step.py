"""Build the compiled forward's inputs for one ragged step (interface version 2).

One step: the new tokens of several sequences flattened in order. For each
sequence: its queries' offsets (q_indptr), its page list in CSR form
(page_indptr, page_values), the rows used in its last page, and the rows whose
logits come back (logit_rows): its last new token's, or every new token's when
the sequence asked for them (prompt logprobs). For each token: position, KV slot and LoRA adapter
slot (lora_slots, read by artifacts with adapter slots only).
A page the pool dropped as outside every layer's sliding window is -1 in page_values: the
attention kernels never read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.interface import LORA_SLOTS


@dataclass
class SeqChunk:
    tokens: list[int]       # new tokens of this sequence in this step
    start_pos: int          # tokens of this sequence already in the KV cache
    pages: list[int]        # the sequence's pages, covering start_pos + len(tokens) rows
    slots: list[int]        # the KV slot of each new token
    all_rows: bool = False  # return the logits of every new token, not only the last
    lora_slot: int = -1     # the adapter slot its rows use (-1: the base model)


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
        LORA_SLOTS: np.repeat(np.array([c.lora_slot for c in chunks], np.int32), lens),
    }


def context_rows(inputs: dict[str, np.ndarray], page_size: int) -> dict[str, np.ndarray]:
    """kv_slots and kv_indptr (ir/step_forms.py): the KV slot of every context row of every sequence,
    sequence after sequence, for the steps whose forms read whole contexts."""
    page_indptr, pages = inputs["page_indptr"], inputs["page_values"].astype(np.int64)
    n_pages = np.diff(page_indptr)
    kv_lens = np.where(n_pages > 0, (n_pages - 1) * page_size + inputs["last_page_len"], 0)
    kv_indptr = np.zeros(len(kv_lens) + 1, np.int32)
    kv_indptr[1:] = np.cumsum(kv_lens)
    rows = np.arange(page_size)
    slots = [((pages[page_indptr[s]:page_indptr[s + 1], None] * page_size + rows).reshape(-1)[:kv_lens[s]])
             for s in range(len(kv_lens))]
    return {"kv_slots": np.concatenate(slots or [np.zeros(0)]).astype(np.int32), "kv_indptr": kv_indptr}


def no_context_rows(seqs: int) -> dict[str, np.ndarray]:
    """kv_slots and kv_indptr for a step whose forms do not read them."""
    return {"kv_slots": np.zeros(0, np.int32), "kv_indptr": np.zeros(seqs + 1, np.int32)}


def graph_step_capacities(max_batch: int, pages_per_seq: int) -> dict[str, int]:
    """Buffer lengths a padded decode step of up to `max_batch` sequences can need."""
    return {"tokens": max_batch, "positions": max_batch, "q_indptr": max_batch + 1, "page_indptr": max_batch + 1,
            "page_values": max_batch * pages_per_seq, "last_page_len": max_batch, "slot_mapping": max_batch,
            "logit_rows": max_batch, LORA_SLOTS: max_batch}


def pad_decode_step(inputs: dict[str, np.ndarray], batch: int, scratch_page: int,
                    page_size: int) -> dict[str, np.ndarray]:
    """A decode step of s <= batch sequences, padded to `batch` with sequences of one token at
    position 0 whose KV is row 0 of `scratch_page` (a page no sequence owns): their rows of the
    output are to be dropped (on no adapter). Real rows keep their order, so output row i is still
    sequence i's."""
    seqs = len(inputs["tokens"])
    pad = batch - seqs
    if pad < 0 or len(inputs["logit_rows"]) != seqs:
        raise ValueError(f"a decode step of {seqs} sequences cannot be padded to {batch}")
    zeros, ones = np.zeros(pad, np.int32), np.ones(pad, np.int32)
    last = int(inputs["page_indptr"][-1])
    return {
        "tokens": np.concatenate([inputs["tokens"], zeros]),
        "positions": np.concatenate([inputs["positions"], zeros]),
        "q_indptr": np.arange(batch + 1, dtype=np.int32),
        "page_indptr": np.concatenate([inputs["page_indptr"], last + np.arange(1, pad + 1, dtype=np.int32)]),
        "page_values": np.concatenate([inputs["page_values"], np.full(pad, scratch_page, np.int32)]),
        "last_page_len": np.concatenate([inputs["last_page_len"], ones]),
        "slot_mapping": np.concatenate([inputs["slot_mapping"], np.full(pad, scratch_page * page_size, np.int32)]),
        "logit_rows": np.arange(batch, dtype=np.int32),
        LORA_SLOTS: np.concatenate([inputs.get(LORA_SLOTS, np.full(seqs, -1, np.int32)), np.full(pad, -1, np.int32)]),
    }
