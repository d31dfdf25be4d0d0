"""The engine loop: admit requests, build a ragged step, run the compiled forward, sample, repeat.

First cut of continuous batching: every step mixes the decode tokens of
running requests with prefill chunks of new ones, within a token budget.
A request is admitted only when the pool can hold its whole prompt plus its
max_tokens, so it never runs out of pages mid-generation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


from kiln.errors import KilnError

from .kv_pool import BlockTable, PagePool
from .sampler import SamplerState, SamplingParams, sample
from .step import SeqChunk, step_inputs


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    state: SamplerState
    eos_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0                  # tokens whose K/V are in the cache
    finish_reason: str | None = None       # "stop" or "length"
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass
class EngineStats:
    """Running totals over the engine's life (bounded: no per-step history is kept)."""
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0


class Engine:
    """Runs many requests together on one compiled model."""

    def __init__(self, model, num_pages: int, eos_ids=(), max_num_seqs: int = 64, max_batched_tokens: int = 2048):
        self.model = model
        self.pool = PagePool(num_pages, model.page_size)
        self.eos_ids = frozenset(eos_ids)
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._reserved = 0                    # pages promised to running requests but not yet taken
        self._next_id = 0
        self.stats = EngineStats()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not prompt_ids:
            raise KilnError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise KilnError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.model.vocab_size})")
        room = self.model.max_context - len(prompt_ids)
        if room < 1:
            raise KilnError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.model.max_context}")
        if params.max_tokens > room:
            params = SamplingParams(**{**params.__dict__, "max_tokens": room})
        req = Request(self._next_id, list(prompt_ids), params, SamplerState(params), self.eos_ids)
        if self.pool.pages_for(req.max_total_tokens) > self.pool.num_pages:
            raise KilnError(f"request needs {self.pool.pages_for(req.max_total_tokens)} KV pages; "
                            f"the pool has {self.pool.num_pages} (give more KV memory)")
        self._next_id += 1
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            need = self.pool.pages_for(self.waiting[0].max_total_tokens)
            if need > self.pool.num_free - self._reserved:
                break
            self._reserved += need
            self.running.append(self.waiting.pop(0))

    # -- one step ----------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, number of new tokens) for this step: decodes first, then prefill chunks."""
        budget = self.max_batched_tokens
        plan = []
        for req in sorted(self.running, key=lambda r: len(r.all_ids) - r.num_computed):
            pending = len(req.all_ids) - req.num_computed
            n = min(pending, budget)
            if n > 0:
                plan.append((req, n))
                budget -= n
        return plan

    def step(self) -> list[tuple[Request, int]]:
        """Run one step; return (request, token) for every token sampled in it."""
        self._admit()
        plan = self._schedule()
        if not plan:
            return []
        t0 = time.perf_counter()
        chunks, stats = [], self.stats
        for req, n in plan:
            before = len(req.table.pages)
            slots = self.pool.grow(req.table, n)
            self._reserved -= len(req.table.pages) - before
            is_prefill = req.num_computed < len(req.prompt_ids)
            stats.prefill_tokens += n if is_prefill else 0
            stats.decode_tokens += 0 if is_prefill else n
            chunks.append(SeqChunk(req.all_ids[req.num_computed:req.num_computed + n], req.num_computed,
                                   list(req.table.pages), slots))
        logits = self.model.forward(step_inputs(chunks, self.model.page_size))
        ready = []
        for row, (req, n) in enumerate(plan):
            req.num_computed += n
            if req.num_computed == len(req.all_ids):     # caught up: this row's logits pick the next token
                ready.append((row, req))
        tokens = sample(logits[[r for r, _ in ready]], [req.state for _, req in ready]) if ready else []
        now = time.perf_counter()
        out = []
        for (_, req), tok in zip(ready, tokens):
            tok = int(tok)
            req.output_ids.append(tok)
            req.first_token_time = req.first_token_time or now
            out.append((req, tok))
            self._check_finished(req, tok, now)
        stats.steps += 1
        stats.seconds += time.perf_counter() - t0
        return out

    def _check_finished(self, req: Request, tok: int, now: float) -> None:
        p = req.params
        if (not p.ignore_eos and tok in req.eos_ids) or tok in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason:
            req.finish_time = now
            self.running.remove(req)
            # pages it reserved but never took go back to the pool's budget
            self._reserved -= self.pool.pages_for(req.max_total_tokens) - len(req.table.pages)
            self.pool.release(req.table)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Run prompts to completion together; return their requests in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_unfinished():
            for req, tok in self.step():
                if on_token:
                    on_token(req, tok)
        return reqs


