"""The scheduler: which sequences compute how many tokens in the next step (continuous batching).

Each step spends a token budget (`max_batched_tokens`):
  1. running sequences first, in admission order: a decode takes 1 token, and 1 + k when it
     brings k speculative guesses (`Sequence.draft`, runtime/speculative.py: cut short, or
     dropped, where the budget or the free pages do not cover them), an unfinished prefill its
     next chunk (as much of the rest as the budget allows), so long prompts share steps with
     decodes;
  2. then waiting sequences, by (priority, arrival), up to `max_num_seqs` running: each first
     takes the cached pages of its prompt's longest cached prefix (those tokens are skipped),
     then is admitted as soon as the pages for its first chunk are free.
When a running sequence needs pages and none are left, the latest-admitted running sequence is
preempted: its pages are released (the full ones stay in the prefix cache) and it goes back to
the waiting queue with its generated tokens, to be recomputed later. Nothing new is admitted in a
step that preempted. `abort` frees a sequence's pages at once.
A sequence on a LoRA adapter runs holding a slot of the model's (runtime/lora_slots.py): one that
cannot get one (every slot in use by other adapters' running sequences) waits, and those behind it
in the queue may go first; finishing or being preempted lets the slot go.
Pure Python over a PagePool: tested with a fake model runner.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .kv_pool import PagePool
from .request import Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int                          # tokens of the sequence already in the cache
    num_tokens: int                     # tokens computed in this step
    slots: list[int]
    copies: list[tuple[int, int]]       # page copies (copy-on-write) to make before the step
    draft: list[int] = field(default_factory=list)   # speculative guesses after the sequence's tokens


@dataclass
class Schedule:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int = 64, max_batched_tokens: int = 2048, lora_slots=None):
        if max_num_seqs < 1 or max_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_batched_tokens must be >= 1")
        self.pool, self.max_num_seqs, self.max_batched_tokens = pool, max_num_seqs, max_batched_tokens
        self.lora_slots = lora_slots            # runtime/lora_slots.py LoRASlots, for requests with adapters
        self.waiting: list[Sequence] = []       # sorted by sort_key
        self.running: list[Sequence] = []       # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked sample starts running right after the sequence it was forked from (on its slot)."""
        if seq.request.lora is not None:
            seq.lora_slot = self.lora_slots.share(after.lora_slot)
        self.running.insert(self.running.index(after) + 1, seq)

    def _take_slot(self, seq: Sequence) -> bool:
        """Whether `seq` holds its adapter's slot (or needs none), taking one if it can."""
        if seq.request.lora is None or seq.lora_slot >= 0:
            return True
        slot = self.lora_slots.acquire(seq.request.lora)
        seq.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _let_go(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.table)
        self._let_go(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.table)
        self._let_go(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _grow(self, seq: Sequence, n: int, draft: list[int] = ()) -> ScheduledChunk:
        start = seq.num_computed
        slots, copies = self.pool.grow(seq.table, n)
        return ScheduledChunk(seq, start, n, slots, copies, list(draft))

    def _affordable_draft(self, seq: Sequence, budget: int) -> list[int]:
        """The guesses of a decoding sequence that the step's budget and the free pages cover."""
        draft = seq.draft[:max(0, budget - 1)] if seq.pending == 1 else []
        while draft and self.pool.pages_needed(seq.table, 1 + len(draft)) > self.pool.num_free:
            draft = draft[:-1]
        return draft

    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.max_batched_tokens
        for seq in list(self.running):
            if seq not in self.running:          # preempted for an earlier sequence in this loop
                continue
            n = min(seq.pending, budget)
            if n == 0:
                continue
            while self.pool.pages_needed(seq.table, n) > self.pool.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq in self.running:
                draft = self._affordable_draft(seq, budget) if seq.draft else []
                out.chunks.append(self._grow(seq, n + len(draft), draft))
                budget -= n + len(draft)
        if out.preempted:
            return out
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[i]
            if not self._take_slot(seq):         # its adapter waits for a slot; those behind it may go
                i += 1
                continue
            # a request that wants its prompt's logprobs computes every prompt row: no cache lookup
            if seq.num_computed == 0 and not seq.table.pages and not seq.request.needs_prompt_logprobs:
                seq.num_computed = cached = self.pool.match_prefix(seq.table, seq.all_ids)
            else:
                cached = None
            n = min(seq.pending, budget)
            if self.pool.pages_needed(seq.table, n) > self.pool.num_free:
                if cached is not None:           # not admitted: give the cached pages back for now
                    self.pool.stats.hit_tokens -= cached
                    self.pool.stats.queried_tokens -= seq.num_tokens
                    self.pool.release(seq.table)
                    seq.num_computed = 0
                self._let_go(seq)
                break
            self.waiting.pop(i)
            self.running.append(seq)
            if cached is not None and seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.num_cached_tokens = cached
            out.chunks.append(self._grow(seq, n))
            budget -= n
        return out
