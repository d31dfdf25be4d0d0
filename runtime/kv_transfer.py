"""A sequence's KV pages as a value that can leave one engine and enter another.

`KVSnapshot` holds what a second engine needs to go on with a sequence where the first one left
it: the token ids (prompt and the tokens generated so far), how many of them have K/V rows in the
pages, the pages themselves, tensor by tensor as the runner lays them out (every layer's K and V,
or its latent rows, and an int8 cache's row scales: each KV input the manifest's KV specs name),
and the sampler's place (its generator's state, the logprobs of the tokens already drawn). Pages
that a sliding window had already dropped are not carried: `first_page` says where the carried
ones start. `layout` names the runner's page format; an engine refuses a snapshot of another.

This is the seam prefill/decode disaggregation and KV connectors use: the prefill engine exports
(`Engine.add_request(..., export_kv=True)` puts the snapshot on the request's last output), a
transport moves it (kiln.serve.cluster.transport), the decode engine imports
(`Engine.import_kv`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import KilnError


@dataclass
class KVSnapshot:
    layout: str                           # the runner's kv_layout (page size, tensor names, shapes, dtypes)
    token_ids: list[int]                  # prompt, then the tokens generated so far
    prompt_len: int
    num_computed: int                     # leading tokens whose K/V rows the pages hold
    first_page: int                       # the sequence's page index of pages[...][0]
    pages: dict[str, np.ndarray]          # KV tensor name -> [carried pages, ...page shape]
    logprobs: list | None = None          # of the generated tokens, where the request asked for them
    rng_state: dict | None = None         # the sampler's generator, after the draws made so far
    timings: dict[str, float] = field(default_factory=dict)   # seconds: what exporting took, for reports

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.pages.values())

    @property
    def num_pages(self) -> int:
        return len(next(iter(self.pages.values()))) if self.pages else 0


def layout_of(page_size: int, tensors: dict[str, tuple[tuple[int, ...], str]]) -> str:
    """A runner's page format: its page size and each KV tensor's name, page shape and dtype. Two
    runners with the same layout read each other's pages the same way."""
    text = ";".join(f"{name}:{'x'.join(map(str, shape))}:{dtype}" for name, (shape, dtype) in sorted(tensors.items()))
    return f"page{page_size}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def check_layout(snapshot: KVSnapshot, layout: str) -> None:
    if snapshot.layout != layout:
        raise KilnError(f"the KV snapshot's page layout {snapshot.layout} is not this model's ({layout}): "
                        "prefill and decode must run the same artifact's KV format")


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(position in `pages`, first page id, count) of each run of consecutive page ids: one copy each."""
    runs: list[tuple[int, int, int]] = []
    for i, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            at, first, count = runs[-1]
            runs[-1] = (at, first, count + 1)
        else:
            runs.append((i, page, 1))
    return runs
