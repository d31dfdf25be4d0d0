"""Token sampling: penalties, logit bias, greedy, temperature, top-k, top-p, min-p, a per-request
seed, and logprobs.

One row of logits per running sequence. Each sequence owns a `SamplerState`
holding its params, the token counts penalties need, and its own
`numpy.random.Generator`, so the tokens a seed gives do not depend on which
other requests share the batch: a sampled row draws exactly one uniform number
from its own generator, a greedy row none. Sample i > 0 of a request with n > 1
seeds its generator with (seed, i).

Order of the transforms (as in vLLM): logit bias; min_tokens masks the stop
tokens; repetition penalty (over prompt and output), frequency and presence
penalties (over the output); then greedy argmax, or temperature, top-k, top-p
over what top-k kept, min-p, and one draw by inverse CDF.
Logprobs are those of the model's own distribution (the raw logits), as vLLM
reports by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kiln.errors import ParamError


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops; validated on construction."""

    temperature: float = 1.0  # 0 means greedy (argmax, ties -> lowest id)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]; 1 means off
    top_k: int = 0  # number of top tokens kept; 0 or -1 means off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 means off
    seed: int | None = None  # None: fresh OS entropy; any int (folded into [0, 2**64))
    max_tokens: int = 16  # 0: compute the prompt only (its logprobs), generate nothing
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) are masked until this many are generated
    n: int = 1  # samples of the same prompt, sharing its KV pages
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (as transformers)
    presence_penalty: float = 0.0  # subtracted once from every token already generated (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output (OpenAI)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k
    prompt_logprobs: int | None = None  # as logprobs, for every prompt token after the first
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "an int >= 1, or 0 / -1 for off")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "an int or None")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", self.max_tokens,
               "an int >= 0")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "a bool")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, "an int in [0, max_tokens]")
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) and x for x in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
               "repetition_penalty", self.repetition_penalty, "in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(isinstance(self.logit_bias, dict)
               and all(_is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100
                       for k, v in self.logit_bias.items()),
               "logit_bias", self.logit_bias, "a dict of token id -> bias in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20), name, value, "None or an int in [0, 20]")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", self.skip_special_tokens, "a bool")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = list(self.stop)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ParamError(name, f"SamplingParams.{name} must be {expected}, got {_short(value)}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _seed_words(seed: int) -> int:
    """Any int as a seed numpy accepts: folded into [0, 2**64) (negative and huge seeds included)."""
    return int(seed) % (1 << 64)


@dataclass
class SamplerState:
    """Per-sequence sampling state: the params, the token counts the penalties read, the stop
    ids min_tokens masks, and the sequence's own random generator."""

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    stop_ids: frozenset[int] = frozenset()       # EOS ids (unless ignore_eos) and stop_token_ids
    index: int = 0                               # which of the request's n samples
    rng: np.random.Generator = field(init=False, repr=False)
    output_counts: dict[int, int] = field(init=False, repr=False)
    num_output: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        seed = None if self.params.seed is None else _seed_words(self.params.seed)
        self.rng = np.random.default_rng(seed if self.index == 0 or seed is None else [seed, self.index])
        self.output_counts = {}
        self.seen = np.unique(np.asarray(self.prompt_ids, np.int64))   # for the repetition penalty

    def append(self, token: int) -> None:
        """Record a generated token (penalties and min_tokens read the counts)."""
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        self.num_output += 1

    def fork(self, index: int) -> "SamplerState":
        """The state of sample `index` of the same request, before any output."""
        return SamplerState(self.params, self.prompt_ids, self.stop_ids, index)


def process_logits(logits: np.ndarray, state: SamplerState) -> np.ndarray:
    """The row the draw sees (float64): bias, min_tokens mask, repetition/presence/frequency penalties."""
    p = state.params
    x = logits.astype(np.float64)
    for tok, bias in p.logit_bias.items():
        if tok < x.shape[0]:
            x[tok] += bias
    if state.num_output < p.min_tokens and state.stop_ids:
        x[[t for t in state.stop_ids if t < x.shape[0]]] = -np.inf
    if p.repetition_penalty != 1.0:
        seen = np.union1d(state.seen, np.fromiter(state.output_counts, np.int64)) if state.output_counts \
            else state.seen
        seen = seen[seen < x.shape[0]]
        x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_counts:
        ids = np.fromiter(state.output_counts, np.int64)
        counts = np.fromiter(state.output_counts.values(), np.float64)
        keep = ids < x.shape[0]
        x[ids[keep]] -= p.frequency_penalty * counts[keep] + p.presence_penalty
    return x


def top_logprobs(logits: np.ndarray, token: int, k: int) -> dict[int, float]:
    """log-softmax of the raw logits: the sampled token's logprob and the top k alternatives'."""
    x = logits.astype(np.float64)
    logz = x.max() + np.log(np.exp(x - x.max()).sum())
    best = []
    if k:
        # every id tied with the k-th best, then a stable sort: ties go to the lowest ids
        k = min(k, x.shape[0])
        kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
        ids = np.flatnonzero(x >= kth)
        best = ids[np.argsort(-x[ids], kind="stable")][:k].tolist()
    return {int(t): float(x[t] - logz) for t in [token, *best]}


def sample(logits: np.ndarray, states: Sequence[SamplerState]) -> np.ndarray:
    """Pick one token per row. logits: [S, V] float; states: S entries. Returns int64 [S]."""
    if logits.ndim != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits shape {logits.shape} does not match {len(states)} sampler states")
    return np.array([sample_row(row, st) for row, st in zip(logits, states)], dtype=np.int64)


def sample_row(logits: np.ndarray, state: SamplerState) -> int:
    """Pick one token from one row of logits [V], advancing the state's generator if not greedy."""
    p = state.params
    x = process_logits(logits, state)
    if p.greedy:
        return int(np.argmax(x))
    x = x / p.temperature  # [V]
    ids = _candidates(x, p.top_k, p.top_p < 1.0)  # token ids, best first when filtered
    xs = x[ids]
    probs = np.exp(xs - xs.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        # Keep the shortest best-first prefix whose mass reaches top_p (always >= 1 token).
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
        ids, probs = ids[:keep], probs[:keep]
    if p.min_p > 0:
        keep = probs >= p.min_p * probs.max()
        ids, probs = ids[keep], probs[keep]
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
