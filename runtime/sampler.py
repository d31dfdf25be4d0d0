"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

One row of logits per running request. Each request owns a `SamplerState`
holding its params and its own `numpy.random.Generator`, so the tokens a seed
gives do not depend on which other requests share the batch: a sampled row
draws exactly one uniform number from its own generator, a greedy row none.

Order of the transforms (as in transformers and vLLM): temperature, then
top-k, then top-p over what top-k kept, then one draw by inverse CDF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops; validated on construction."""

    temperature: float = 1.0  # 0 means greedy (argmax, ties -> lowest id)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 means off
    top_k: int = 0  # number of top tokens kept; 0 or -1 means off
    seed: int | None = None  # None: fresh OS entropy
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "an int >= 1, or 0 / -1 for off")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int or None")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "an int >= 1")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")


@dataclass
class SamplerState:
    """Per-request sampling state: the params and the request's own random generator."""

    params: SamplingParams
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)


def sample(logits: np.ndarray, states: Sequence[SamplerState]) -> np.ndarray:
    """Pick one token per row. logits: [S, V] float; states: S entries. Returns int64 [S]."""
    if logits.ndim != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits shape {logits.shape} does not match {len(states)} sampler states")
    return np.array([sample_row(row, st) for row, st in zip(logits, states)], dtype=np.int64)


def sample_row(logits: np.ndarray, state: SamplerState) -> int:
    """Pick one token from one row of logits [V], advancing the state's generator if not greedy."""
    p = state.params
    if p.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / p.temperature  # [V]
    ids = _candidates(x, p.top_k, p.top_p < 1.0)  # token ids, best first when filtered
    xs = x[ids]
    probs = np.exp(xs - xs.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        # Keep the shortest best-first prefix whose mass reaches top_p (always >= 1 token).
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
        ids, probs = ids[:keep], probs[:keep]
    cdf = np.cumsum(probs)
    u = state.rng.random() * cdf[-1]
    # side="right": zero-probability entries (masked -inf logits) are never picked.
    pick = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)
    return int(ids[pick])


def _candidates(x: np.ndarray, top_k: int, need_sorted: bool) -> np.ndarray:
    """Token ids that survive top-k, sorted best first (ties -> lowest id) when a filter is on."""
    vocab = x.shape[0]
    if top_k <= 0 or top_k >= vocab:
        if not need_sorted:
            return np.arange(vocab)
        return np.argsort(-x, kind="stable")
    # Every id tied with the k-th best survives the threshold; the stable sort then keeps
    # the lowest ids among ties, so top_k=1 agrees with np.argmax.
    kth = np.partition(x, vocab - top_k)[vocab - top_k]
    ids = np.flatnonzero(x >= kth)
    return ids[np.argsort(-x[ids], kind="stable")][:top_k]
