"""Draft-model proposals: a smaller model with the same tokenizer guesses the next k tokens.

The draft runs on its own KV pages (its own PagePool, with a prefix cache of its own) through the
same ragged steps as the target (runtime/step.py). Each speculating step:
  1. catch up: every sequence's tokens the draft has not computed (at least the token the target
     gave last) run as one chunk each, all sequences in one step; its last row gives guess 1;
  2. then k - 1 one-token steps, each feeding the guess before: guesses 2..k.
A guess is the draft's argmax for a greedy request; otherwise it is drawn with the request's
temperature and filters from the draft's distribution q, which verification needs (no penalties
or grammar: any q keeps the output exact, a closer one is taken more often).
Which draft rows stay valid is found by comparing the tokens the draft computed with the
sequence's tokens at the next step: the rows after the first difference (rejected guesses) are
truncated, so nothing has to be told what the target accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_pool import BlockTable, OutOfPages, PagePool
from .sampler import SamplingParams, draw, probabilities, seed_words
from .speculative import Proposal
from .step import SeqChunk, step_inputs


@dataclass
class DraftSequence:
    table: BlockTable = field(default_factory=BlockTable)
    computed: list[int] = field(default_factory=list)     # the tokens whose KV rows the draft holds
    rng: np.random.Generator | None = None


class DraftProposer:
    def __init__(self, model, num_pages: int, vocab_size: int, cost: float):
        """`model`: a runner (runtime/model.py CompiledModel, or a test's fake) with its KV allocated
        for `num_pages` pages; `vocab_size`: the target's (the draft's logits are cut or padded to it);
        `cost`: one draft step relative to one target step (e.g. the ratio of their weight bytes)."""
        self.model, self.vocab_size, self.cost = model, vocab_size, cost
        self.pool = PagePool(num_pages, model.page_size, prefix_caching=True, window=model.kv_window)
        self.seqs: dict = {}

    def retain(self, live: set) -> None:
        for seq in [s for s in self.seqs if s not in live]:
            self.pool.release(self.seqs.pop(seq).table)

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        proposals = {seq: Proposal([], None) for seq in seqs}
        # 1. catch up, one chunk per sequence; a sequence the draft cannot hold proposes nothing
        chunks, active = [], []
        for seq, k in zip(seqs, ks):
            ids = seq.all_ids
            if len(ids) + k > self.model.max_context:
                continue
            state = self._synced(seq, ids)
            feed = ids[len(state.computed):]
            chunk = self._grow(state, feed)
            if chunk is not None:
                chunks.append(chunk)
                active.append((seq, k, state))
        guesses: dict = {seq: [] for seq, _, _ in active}
        probs: dict = {seq: [] for seq, _, _ in active}
        # 2. one token a step after that, for the sequences that want more
        while chunks:
            logits = self.model.forward(step_inputs(chunks, self.model.page_size))
            chunks, still = [], []
            for row, (seq, k, state) in zip(logits, active):
                token, q = self._guess(row, seq, state)
                guesses[seq].append(token)
                probs[seq].append(q)
                if len(guesses[seq]) < k:
                    chunk = self._grow(state, [token])
                    if chunk is not None:
                        chunks.append(chunk)
                        still.append((seq, k, state))
            active = still
        for seq, tokens in guesses.items():
            sampled = [q for q in probs[seq] if q is not None]
            proposals[seq] = Proposal(tokens, np.stack(sampled) if len(sampled) == len(tokens) else None)
        return [proposals[seq] for seq in seqs]

    def _synced(self, seq, ids: list[int]) -> DraftSequence:
        """The draft's state of `seq`, cut back to the rows whose tokens are still the sequence's."""
        state = self.seqs.get(seq)
        if state is None:
            state = self.seqs[seq] = DraftSequence(rng=_generator(seq))
            state.computed = ids[:self.pool.match_prefix(state.table, ids)]
            return state
        # only guesses can differ, and they come after every row this sequence has registered
        limit = min(len(state.computed), len(ids))
        start = len(state.table.hashes) * self.pool.page_size
        same = next((i for i in range(start, limit) if state.computed[i] != ids[i]), limit)
        if same < len(state.computed):
            self.pool.truncate(state.table, same)
            del state.computed[same:]
        # rows computed and confirmed: their full pages join the draft's prefix cache, and pages
        # outside its window go (both only now, after the steps that wrote and read them)
        self.pool.register_full_pages(state.table, state.computed, same)
        self.pool.drop_dead_pages(state.table, same)
        return state

    def _grow(self, state: DraftSequence, feed: list[int]) -> SeqChunk | None:
        """The chunk that computes `feed` after the state's rows, or None where the pool is full."""
        try:
            slots, copies = self.pool.grow(state.table, len(feed))
        except OutOfPages:
            return None
        if copies:
            self.model.copy_pages(copies)
        start = len(state.computed)
        state.computed += feed
        return SeqChunk(list(feed), start, list(state.table.pages), slots)

    def _guess(self, row: np.ndarray, seq, state: DraftSequence) -> tuple[int, np.ndarray | None]:
        """The draft's next token, and the q it was drawn from (None: its argmax, a greedy request's)."""
        x = np.full(self.vocab_size, -np.inf, np.float32)
        width = min(self.vocab_size, row.shape[0])
        x[:width] = row[:width]
        params: SamplingParams = seq.request.params
        if params.greedy:
            return int(np.argmax(x)), None
        return draw(x, params, state.rng.random()), probabilities(x, params)


def _generator(seq) -> np.random.Generator:
    """The draft's own generator for a sequence: seeded from the request's seed where it has one."""
    seed = seq.request.params.seed
    return np.random.default_rng(None if seed is None else [seed_words(seed), seq.index, 1])
