"""Token sampling: penalties, logit bias, greedy, temperature, top-k, top-p, min-p, a per-request
seed, and logprobs.

One row of logits per running sequence. Each sequence owns a `SamplerState`
holding its params, the token counts penalties need, and its own
`numpy.random.Generator`, so the tokens a seed gives do not depend on which
other requests share the batch: a sampled row draws exactly one uniform number
u in [0, 1) from its own generator, a greedy row none. Sample i > 0 of a
request with n > 1 seeds its generator with (seed, i).

The definition (runtime/device_sampler.py computes the same on the device from
the same u, with the kernels of codegen/lowering/sampling.py):

1. Processed logits x (float32): each token of the row that a penalty or bias
   touches (`penalty_entries`) becomes, computed in float64 and rounded to
   float32, y = x + bias, then y / rep if y > 0 else y * rep, then y - sub,
   where bias comes from logit_bias, or is -inf for a stop id while fewer than
   min_tokens are generated; rep = repetition_penalty for tokens of the prompt
   or output, else 1; sub = frequency_penalty * count + presence_penalty for
   tokens of the output, else 0 (vLLM's order: bias, min_tokens, repetition,
   frequency/presence). Then, for a structured output, every token its grammar
   does not allow next becomes -inf (runtime/grammar.py).
2. Greedy (temperature 0): argmax of x, ties -> lowest id.
3. Otherwise, in float64: z = x / temperature, zmax = max z, and each token's
   weight e = exp(z - zmax), exactly 1 where z == zmax (+inf included; 0 if
   every x is -inf). A token is kept when all of these hold:
   * top-k (1 <= top_k < vocab): x >= the top_k-th largest x, so every tie
     with that value is kept;
   * top-p (top_p < 1): x >= the nucleus threshold. Sort the values top-k
     keeps best first; c_j is the sum of their weights up to position j; the
     threshold is the value at the first j with c_j >= top_p * c_last. This is
     the largest t such that the tokens with x >= t hold top_p of the mass;
     ties with it are kept;
   * min-p: e >= min_p, i.e. a probability >= min_p x the top token's.
   The top token is always kept.
4. The draw is the inverse CDF in token-id order: w = e on kept tokens and 0
   elsewhere; cdf = cumulative sum of w over ids 0..V-1; the pick is the first
   token with w > 0 and cdf > u * cdf[V-1]. If rounding leaves none, the pick
   is the last token with w > 0; if no token has weight (every x is -inf), it
   is token 0. Each kept token is drawn with probability w / sum(w); the
   id order only decides which u maps to which token.

Logprobs are those of the model's own distribution (the raw logits), as vLLM
reports by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kiln.errors import ParamError

from .grammar import GrammarSpec, TokenMatcher


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
    structured: GrammarSpec | None = None  # what the output must match (runtime/grammar.py)
    speculative: bool = True  # False: this request never speculates (where the engine does)

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
        _check(isinstance(self.speculative, bool), "speculative", self.speculative, "a bool")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", self.skip_special_tokens, "a bool")
        _check(self.structured is None or isinstance(self.structured, GrammarSpec), "structured", self.structured,
               "a GrammarSpec or None")
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


def seed_words(seed: int) -> int:
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
    grammar: TokenMatcher | None = None          # where a structured output stands in its grammar
    rng: np.random.Generator = field(init=False, repr=False)
    output_counts: dict[int, int] = field(init=False, repr=False)
    num_output: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        seed = None if self.params.seed is None else seed_words(self.params.seed)
        self.rng = np.random.default_rng(seed if self.index == 0 or seed is None else [seed, self.index])
        self.output_counts = {}
        self.seen = np.unique(np.asarray(self.prompt_ids, np.int64))   # for the repetition penalty
        self._allowed, self._prepared = None, False

    def append(self, token: int) -> None:
        """Record a generated token (penalties and min_tokens read the counts)."""
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        self.num_output += 1
        if self.grammar is not None:
            self.grammar.accept(token)
            self._allowed, self._prepared = None, False

    def prepare(self) -> None:
        """Compute the grammar's mask for the next draw now (the engine does while the forward runs)."""
        if self.grammar is not None and not self._prepared:
            self._allowed, self._prepared = self.grammar.allowed(), True

    def allowed(self) -> np.ndarray | None:
        """bool [vocab] of the tokens the grammar lets come next; None when every token may."""
        self.prepare()
        return self._allowed

    def grammar_ended(self) -> bool:
        """The structured output is whole and nothing but a stop token may follow it. (The mask is
        read only once the grammar is complete: before that it is computed beside the forward.)"""
        return self.grammar is not None and self.grammar.completed and self.grammar.only_stops(self.allowed())

    def fork(self, index: int) -> "SamplerState":
        """The state of sample `index` of the same request, before any output."""
        return SamplerState(self.params, self.prompt_ids, self.stop_ids, index,
                            self.grammar.fresh() if self.grammar is not None else None)


def penalty_entries(state: SamplerState, vocab: int) -> tuple[np.ndarray, ...]:
    """The tokens of one row that penalties or bias change, and how: (tokens int64 [m], sorted and
    unique, all < vocab; bias f64 [m]; repetition f64 [m]; subtract f64 [m]), as step 1 of the
    module docstring applies them. Empty when the row uses none."""
    p = state.params
    none = np.zeros(0, np.int64)
    masking = state.num_output < p.min_tokens and bool(state.stop_ids)
    subtracting = bool(p.presence_penalty or p.frequency_penalty) and bool(state.output_counts)
    if not (p.logit_bias or masking or subtracting or p.repetition_penalty != 1.0):
        return none, np.zeros(0), np.zeros(0), np.zeros(0)       # the common case, kept cheap
    bias_ids = np.fromiter(p.logit_bias, np.int64, len(p.logit_bias))
    bias_values = np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias))
    masked = np.fromiter(state.stop_ids, np.int64) if masking else none
    out_ids = np.fromiter(state.output_counts, np.int64, len(state.output_counts))
    counts = np.fromiter(state.output_counts.values(), np.float64, len(out_ids))
    seen = np.union1d(state.seen, out_ids) if p.repetition_penalty != 1.0 else none
    if not subtracting:
        out_ids, counts = none, counts[:0]
    tokens = np.unique(np.concatenate([bias_ids, masked, seen, out_ids]))
    tokens = tokens[tokens < vocab]
    bias, rep, sub = np.zeros(len(tokens)), np.ones(len(tokens)), np.zeros(len(tokens))

    def put(column: np.ndarray, ids: np.ndarray, values) -> None:
        inside = ids < vocab
        column[np.searchsorted(tokens, ids[inside])] = values[inside] if np.ndim(values) else values
    put(bias, bias_ids, bias_values)
    put(bias, masked, -np.inf)                       # after the bias: a masked stop id stays -inf
    put(rep, seen, p.repetition_penalty)
    put(sub, out_ids, p.frequency_penalty * counts + p.presence_penalty)
    return tokens, bias, rep, sub


def process_logits(logits: np.ndarray, state: SamplerState) -> np.ndarray:
    """The row the draw sees (float32): bias, min_tokens mask, repetition/presence/frequency penalties,
    computed in float64 on the touched tokens (step 1 of the module docstring)."""
    x = np.array(logits, dtype=np.float32)              # a copy, in the device's dtype
    tokens, bias, rep, sub = penalty_entries(state, x.shape[0])
    if len(tokens):
        y = x[tokens].astype(np.float64) + bias
        with np.errstate(over="ignore"):        # beyond float32's range a value becomes ±inf, as on the device
            x[tokens] = np.where(y > 0, y / rep, y * rep) - sub
    allowed = state.allowed()
    if allowed is not None:
        x[~allowed] = -np.inf                           # what the grammar does not allow cannot be drawn
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
    return draw(x, p, state.rng.random())


def draw(x: np.ndarray, p: SamplingParams, u: float) -> int:
    """Steps 3 and 4 of the module docstring: the token that uniform u picks from processed logits x [V]."""
    return pick(*kept_weights(x, p), u)


def pick(ids: np.ndarray, w: np.ndarray, u: float) -> int:
    """Step 4 of the module docstring: the first of `ids` (ascending) whose cumulative weight w
    exceeds u x the total; token 0 where no weight is left."""
    if not w.any():
        return 0                                         # a row of -inf: every token is masked
    cdf = np.cumsum(w)
    at = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    # side="right" skips zero-weight tokens; past the end (rounding) the last kept token is the pick.
    return int(ids[at] if at < len(ids) else ids[np.flatnonzero(w)[-1]])


def kept_weights(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Step 3 of the module docstring: (ids in ascending order, their weights w, 0 where a filter
    drops them). Every token outside `ids` has weight 0."""
    vocab = x.shape[0]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):    # tiny temperatures, -inf rows
        zmax = np.float64(x.max()) / p.temperature
        threshold = np.float32(-np.inf)
        if 0 < p.top_k < vocab:
            threshold = np.partition(x, vocab - p.top_k)[vocab - p.top_k]
        if p.top_p < 1.0:
            sx = np.sort(x[x >= threshold])[::-1]           # what top-k keeps, best first
            cum = np.cumsum(_weights(sx, p.temperature, zmax))
            first = int(np.searchsorted(cum, p.top_p * cum[-1], side="left"))   # first cum >= the bound
            threshold = max(threshold, sx[min(first, len(sx) - 1)])
        # Only tokens at or above the threshold can have weight; the others add exact zeros to the CDF.
        ids = np.flatnonzero(x >= threshold) if threshold > -np.inf else np.arange(vocab)
        weight = _weights(x[ids], p.temperature, zmax)
        return ids, np.where(weight >= p.min_p, weight, 0.0)


def probabilities(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution `draw` samples from processed logits x [V] (float64 [V]): w / sum(w), or
    all on token 0 for a row with no weight. Greedy params: all on the argmax."""
    out = np.zeros(x.shape[0])
    if p.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
    ids, w = kept_weights(x, p)
    total = w.sum()
    if total > 0:
        out[ids] = w / total
    else:
        out[0] = 1.0
    return out


def _weights(x: np.ndarray, temperature: float, zmax: np.float64) -> np.ndarray:
    """exp(z - zmax) for z = x / temperature in float64: exactly 1 where z == zmax, 0 in a row of -inf."""
    z = x.astype(np.float64) / temperature
    return np.where(z == zmax, float(zmax > -np.inf), np.exp(z - zmax))
