"""What the engine tracks per request and what it hands back.

A `Request` is one prompt with its SamplingParams; it holds n `Sequence`s (one per sample), each
with its own block table, sampler state, output tokens, text and stop state. The scheduler
works on sequences. `RequestOutput` (with one `CompletionOutput` per sample) is what callers
see after every step that produced tokens for the request, in vLLM's shape.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from .kv_pool import BlockTable
from .kv_transfer import KVSnapshot
from .sampler import SamplerState, SamplingParams

_arrivals = itertools.count()


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0           # prompt tokens found in the prefix cache (not computed)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds since arrival)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_output: int) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or num_output < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None            # None while running; "stop", "length" or "abort"
    stop_reason: int | str | None = None   # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None
    new_text: str = ""                   # what this step added (streaming)
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, then {id: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # with Engine.add_request(export_kv=True): the finished sequence's KV pages (runtime/kv_transfer.py)
    kv: KVSnapshot | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


class Sequence:
    """One sample of a request: the tokens so far, where their K/V live, and its stop state."""

    def __init__(self, request: "Request", index: int, state: SamplerState, detokenizer=None):
        self.request, self.index, self.state = request, index, state
        self.output_ids: list[int] = []
        # an adapter's sequences share cached pages with that adapter's alone
        self.table = BlockTable(salt=None if request.lora is None else
                                f"lora:{request.lora.lora_int_id}:{request.lora.lora_name}".encode())
        self.lora_slot = -1                      # its adapter's slot while it runs (runtime/lora_slots.py)
        self.num_computed = 0                    # tokens whose K/V are in the cache
        self.preemptions = 0                     # times its pages were taken back (runtime/scheduler.py)
        self.text = ""
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.new_text, self.new_token_ids = "", []
        self.draft: list[int] = []               # speculative guesses for the next step (runtime/speculative.py)
        self.draft_probs = None                  # the distributions they were drawn from, or None
        self.sort_key = (request.priority, request.arrival_no, index)

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (the per-step path reads only the new tokens)."""
        prompt = self.request.prompt_ids
        n = len(prompt)
        if start >= n:
            return self.output_ids[start - n:end - n]
        return prompt[start:end] + self.output_ids[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens to compute before this sequence can sample (its prompt, or after a preemption
        its prompt and outputs; 1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.output_ids), self.finish_reason, self.stop_reason,
                                None if self.logprobs is None else list(self.logprobs), self.new_text,
                                list(self.new_token_ids))


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 priority: int = 0, export_kv: bool = False, lora=None):
        self.request_id, self.prompt_ids, self.params, self.prompt = request_id, prompt_ids, params, prompt
        self.lora = lora                        # its LoRA adapter (runtime/lora.py LoRARequest), None: the base model
        self.export_kv = export_kv              # hand out the KV pages when it finishes (`kv`)
        self.kv: KVSnapshot | None = None
        self.priority = priority                # lower runs first; ties in arrival order
        self.arrival_no = next(_arrivals)
        self.metrics = RequestMetrics(time.perf_counter())
        self.sequences: list[Sequence] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = \
            [None] if params.prompt_logprobs is not None else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt tokens' logprobs are still to be computed (their rows' logits wanted)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.finished for s in self.sequences)

    def output(self) -> RequestOutput:
        completions = [s.completion() for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), completions, self.finished,
                             self.metrics, None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                             self.kv)
