"""Prompt lookup (n-gram) proposals: a sequence's next tokens guessed from its own past.

The last n tokens of the sequence (n from `ngram_max` down to `ngram_min`) are looked up among its
earlier tokens, prompt and output; at the most recent earlier occurrence of the longest suffix
found, the tokens that followed it are the guesses. Text that copies from its input (summaries,
edits, code that repeats names) is guessed well, at no model cost. Each sequence keeps an index
from every n-gram to where its latest occurrence ends, extended by the tokens each step adds.
"""
from __future__ import annotations

from .speculative import Proposal


class NgramIndex:
    """Where each n-gram of one sequence last occurred with a known next token."""

    def __init__(self, smallest: int, largest: int):
        self.sizes = range(largest, smallest - 1, -1)       # longest first
        self.ends: dict[tuple[int, ...], int] = {}           # n-gram -> the end of its latest occurrence
        self.indexed = 0                                     # tokens whose n-grams ending before them are in

    def extend(self, ids: list[int]) -> None:
        """Index the n-grams ending at every position that now has a next token."""
        for end in range(max(self.indexed, 1), len(ids)):
            for n in self.sizes:
                if end >= n:
                    self.ends[tuple(ids[end - n:end])] = end
        self.indexed = len(ids)

    def lookup(self, ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        for n in self.sizes:
            if len(ids) > n:
                end = self.ends.get(tuple(ids[-n:]))
                if end is not None:
                    return ids[end:end + k]
        return []


class NgramProposer:
    cost = 0.0                       # a dictionary lookup beside a model step

    def __init__(self, smallest: int = 1, largest: int = 4):
        self.smallest, self.largest = smallest, largest
        self.indexes: dict = {}

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]:
        proposals = []
        for seq, k in zip(seqs, ks):
            index = self.indexes.get(seq)
            if index is None:
                index = self.indexes[seq] = NgramIndex(self.smallest, self.largest)
            ids = seq.all_ids
            index.extend(ids)
            proposals.append(Proposal(index.lookup(ids, k)))
        return proposals

    def retain(self, live: set) -> None:
        for seq in [s for s in self.indexes if s not in live]:
            del self.indexes[seq]
