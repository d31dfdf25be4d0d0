"""Speculative decoding: what to speculate with, how far each sequence looks ahead, and the
acceptance rule that keeps the output the target model's own.

A proposer (runtime/ngram.py, runtime/draft_proposer.py) guesses up to k next tokens of a decoding
sequence. The engine runs the sequence's last token and its k guesses as one chunk, which returns
k + 1 rows of logits: row j is the target's distribution after guess j - 1. `verify_row` walks the
rows in order, with the sequence's sampler state advanced by each token taken:
  * greedy: the guess is taken when it is the target's argmax; otherwise the argmax is, and the
    walk stops;
  * sampling (Leviathan et al. 2023; Chen et al. 2023): a guess x drawn from the proposer's q is
    taken with probability min(1, p(x) / q(x)), p being the target's distribution as
    runtime/sampler.py defines it (penalties, grammar and filters included); otherwise a token is
    drawn from max(0, p - q), renormalised, and the walk stops. A deterministic guess (n-gram, a
    greedy draft) has q(x) = 1. Each token is then distributed exactly as p;
  * after k taken guesses, the last row gives one more token, drawn as without speculation.
So a step gives 1 to k + 1 tokens. The rows after the first rejection are discarded, and their
KV rows with them (the engine truncates the sequence's pages; runtime/kv_pool.py).

How many tokens to propose (`Lookahead`): each sequence keeps a decaying count of guesses tried
and taken, a taken guess being a Bernoulli trial of rate a. With k guesses a step gives
(1 - a^(k+1)) / (1 - a) tokens on average and costs 1 + c k target steps, c being the verify
cost and the proposer's cost per token relative to a one-token step (the proposer's measured
against the engine's steps as they run); k is the best ratio. Where
no k beats a plain step (k = 0), the sequence still guesses once every 16 steps, so that the
estimate keeps learning. The verify cost is the device's (VERIFY_COST, from bench/speculative.py
verify-cost): a CPU's few cores have little compute to spare beyond a one-token step, a GPU's much. Speculation is off in steps where more than
`max_batch` sequences run: there the step is compute-bound and a guess costs about what it saves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kiln.errors import KilnError

from .sampler import SamplerState, draw, pick, probabilities, process_logits

METHODS = ("ngram", "draft")
# a guess's share of a one-token step in a verify step, by device: the CPU's measured on 2 cores
# (docs/BENCHMARKS.md); the GPU's an estimate until the serve kit's speculative stage measures it
VERIFY_COST = {"cpu": 0.15, "cuda": 0.03}


@dataclass
class SpeculativeConfig:
    method: str                       # "ngram" (prompt lookup) or "draft" (a draft model)
    num_tokens: int = 4               # the most tokens proposed per step (k)
    draft: str | None = None          # the draft model's artifact (method "draft")
    ngram_min: int = 1                # the shortest suffix an n-gram lookup matches ...
    ngram_max: int = 4                # ... and the longest, tried first
    max_batch: int = 16               # no speculation in steps where more sequences run
    verify_cost: float | None = None  # a guess's cost in the verify step, / a one-token step (None: the device's)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KilnError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "draft" and not self.draft:
            raise KilnError("speculative decoding with a draft model needs its artifact: draft:ARTIFACT")
        if not 1 <= self.num_tokens <= 16:
            raise KilnError(f"--num-speculative-tokens must be in 1..16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise KilnError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")

    @classmethod
    def parse(cls, spec: str, num_tokens: int = 4) -> "SpeculativeConfig":
        """`ngram` or `draft:ARTIFACT`, as `--speculative` takes it."""
        method, _, draft = spec.partition(":")
        return cls(method, num_tokens, draft or None)


@dataclass
class Proposal:
    tokens: list[int]                  # the guesses, at most the k asked for
    probs: np.ndarray | None = None    # float64 [len(tokens), vocab]: the q each was drawn from; None: deterministic


class Proposer(Protocol):
    """Guesses the next tokens of decoding sequences. `cost` is one guess's cost relative to a
    one-token target step. A proposer that reads the target's hidden states (EAGLE heads,
    DeepSeek's MTP layers) would take them from the engine beside the sequences."""
    cost: float

    def propose(self, seqs: list, ks: list[int]) -> list[Proposal]: ...

    def retain(self, live: set) -> None:
        """Forget every sequence not in `live` (finished, aborted)."""


@dataclass
class SpeculativeStats:
    """Running totals, read by /metrics (vLLM's spec_decode counters) and `kiln run --json`."""
    drafts: int = 0                    # verify chunks with at least one guess
    draft_tokens: int = 0              # guesses verified
    accepted_tokens: int = 0           # guesses taken
    accepted_per_position: list[int] = field(default_factory=list)
    proposer_seconds: float = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
                "mean_accepted_length": round(1 + self.accepted_tokens / self.drafts, 3) if self.drafts else None,
                "accepted_per_position": list(self.accepted_per_position)}


class Lookahead:
    """One sequence's recent acceptance, and the number of guesses it makes the most of."""
    DECAY = 0.8                        # the weight of the steps before the last
    PROBE_EVERY = 16                   # while guessing does not pay, one guess every this many steps

    def __init__(self) -> None:
        self.taken, self.tried = 3.0, 4.0          # a prior of 0.75: start by looking far
        self.idle = 0                              # steps since the last guess

    def record(self, proposed: int, accepted: int) -> None:
        tried = accepted + (accepted < proposed)    # guesses after the first miss were never tried
        self.taken = self.DECAY * self.taken + accepted
        self.tried = self.DECAY * self.tried + tried

    def choose(self, most: int, cost: float) -> int:
        """The k in 0..most with the most tokens per unit of step cost; 0 (no guess) where no k
        beats a plain step, but a single guess every PROBE_EVERY steps keeps the estimate current."""
        a = min(self.taken / self.tried, 0.999)
        gain = [(1 - a ** (k + 1)) / (1 - a) / (1 + cost * k) for k in range(most + 1)]
        best = int(np.argmax(gain))
        if best == 0:
            self.idle += 1
            if self.idle < self.PROBE_EVERY:
                return 0
            best = 1
        self.idle = 0
        return best


def verify_row(logits: np.ndarray, state: SamplerState, proposed: int | None,
               q: np.ndarray | None = None) -> tuple[int, bool]:
    """The token row `logits` [V] gives, and whether it is the proposed guess (None: the row after
    the last guess). `q` [V]: the distribution the guess was drawn from; None for a deterministic guess."""
    params = state.params
    x = process_logits(logits, state)
    if params.greedy:
        token = int(np.argmax(x))
        return token, token == proposed
    if proposed is None:
        return draw(x, params, state.rng.random()), False
    p = probabilities(x, params)
    q_x = 1.0 if q is None else q[proposed]
    if state.rng.random() * q_x < p[proposed]:         # taken with probability min(1, p/q)
        return proposed, True
    residual = p.copy()
    if q is None:
        residual[proposed] = 0.0
    else:
        residual = np.maximum(residual - q[:len(p)], 0.0)
    if not residual.any():                             # p == q: a rejection had probability 0
        residual = p
    return pick(np.arange(len(p)), residual, state.rng.random()), False


class Speculator:
    """Runs a proposer for the engine: which sequences guess how far, and what came of it."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_context: int, device: str = "cpu"):
        self.config, self.proposer, self.max_context = config, proposer, max_context
        self.verify_cost = config.verify_cost if config.verify_cost is not None else VERIFY_COST.get(
            device, VERIFY_COST["cuda"])
        self.propose_cost = proposer.cost          # a guess's proposing, / a step: measured as steps run
        self._proposed = (0.0, 0)                  # the last proposing's (seconds, guesses)
        self.lookahead: dict = {}
        self.stats = SpeculativeStats()

    def propose(self, running: list, live: set) -> None:
        """Set `draft` (and `draft_probs`) on the running sequences that speculate this step."""
        for seq in running:
            seq.draft, seq.draft_probs = [], None
        self.proposer.retain(live)
        for seq in [s for s in self.lookahead if s not in live]:
            del self.lookahead[seq]
        if len(running) > self.config.max_batch:
            return
        seqs, ks = [], []
        for seq in running:
            p = seq.request.params
            if seq.pending != 1 or not seq.output_ids or seq.finished or not p.speculative:
                continue
            # every guess and the token after them fit the request's max_tokens and the context
            room = min(p.max_tokens - len(seq.output_ids) - 1, self.max_context - seq.num_tokens)
            k = min(self.lookahead.setdefault(seq, Lookahead()).choose(self.config.num_tokens, self.cost), room)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        t0 = time.perf_counter()
        guesses = 0
        for seq, k, proposal in zip(seqs, ks, self.proposer.propose(seqs, ks)):
            seq.draft = proposal.tokens[:k]
            seq.draft_probs = proposal.probs
            guesses += len(seq.draft)
        seconds = time.perf_counter() - t0
        self.stats.proposer_seconds += seconds
        self._proposed = (seconds, guesses)

    @property
    def cost(self) -> float:
        """A guess's cost, verifying and proposing it, relative to a step without guesses."""
        return self.verify_cost + self.propose_cost

    def timed(self, forward_seconds: float, guesses: int) -> None:
        """The engine's forward time of a step that verified `guesses`: against it, what proposing
        them cost (a draft model's steps and the host's work around them, which its weight bytes
        alone underestimate)."""
        seconds, proposed = self._proposed
        self._proposed = (0.0, 0)
        if guesses and proposed:
            plain_step = forward_seconds / (1 + self.verify_cost * guesses)
            self.propose_cost = 0.8 * self.propose_cost + 0.2 * seconds / proposed / plain_step

    def record(self, seq, proposed: int, accepted: int) -> None:
        self.stats.record(proposed, accepted)
        if seq in self.lookahead:
            self.lookahead[seq].record(proposed, accepted)
