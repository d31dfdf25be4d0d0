"""RequestLimits: what a request must fit on one engine (the model's vocabulary and context, the KV
page pool, what the engine can do), and the one check of a request against them. Pure: the engine
calls it as it admits a request, and the Ray ingress (serve/cluster/remote.py) with the limits a
replica reported, so a request the replicas would refuse is a 400 there, before any is sent."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.errors import ContextLengthError, ParamError

from .kv_pool import live_pages
from .sampler import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_context: int
    page_size: int
    num_pages: int                     # the KV pool's
    max_batched_tokens: int            # a step's new tokens: how much of a prompt one step computes
    kv_window: int | None = None       # pages wholly outside it are dropped (None: every page is kept)
    exports_kv: bool = True            # the runner reads its pages out (KV export)
    structured_output: bool = True     # False: the engine runs a step ahead, so no grammar can mask it

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def live_pages_for(self, tokens: int) -> int:
        """The most pages a sequence of `tokens` holds at once (with a window, only those in it)."""
        return live_pages(tokens, self.max_batched_tokens, self.page_size, self.kv_window)

    def room(self, prompt_tokens: int) -> int:
        """How many tokens a prompt of `prompt_tokens` leaves: what the model's context and the KV
        cache allow beyond it, by the pages a sequence holds at once (with sliding windows, only
        those in the window)."""
        if self.live_pages_for(self.max_context) <= self.num_pages:
            return self.max_context - prompt_tokens        # a sequence of any length fits (its window does)
        return min(self.max_context, self.num_pages * self.page_size) - prompt_tokens

    def max_tokens_for(self, prompt_tokens: int, asked: int | None, default: int | None = None,
                       prompt_param: str = "prompt") -> int:
        """The tokens a request may generate: `asked`, or where it asks none, all the room left (at most
        `default`). Raises ContextLengthError where the prompt or `asked` does not fit (a server's
        admission: unlike `check_request`, nothing is cut short)."""
        if prompt_tokens >= self.max_context:
            raise ContextLengthError(prompt_param, f"the prompt has {prompt_tokens} tokens; this model's context "
                                                   f"is {self.max_context}")
        room = self.room(prompt_tokens)
        if asked is None:
            if room < 1:
                raise ContextLengthError(prompt_param, f"the prompt ({prompt_tokens} tokens) leaves no room in "
                                                       "the KV cache")
            return min(room, default or room)
        if asked > room:
            raise ContextLengthError("max_tokens", f"the prompt has {prompt_tokens} tokens and max_tokens asks "
                                                   f"{asked} more; at most {max(room, 0)} fit (context "
                                                   f"{self.max_context} tokens, KV cache "
                                                   f"{self.num_pages * self.page_size})")
        return asked

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None, grammars=None,
                      export_kv: bool = False) -> SamplingParams:
        """The request's sampling parameters, max_tokens cut to what the context leaves; ParamError
        where it cannot run. `grammars`: the engine's grammar compiler (runtime/grammar.py Grammars),
        None where it has no tokenizer (then no stop strings and no structured output)."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ParamError("prompt", "the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ParamError("prompt", f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise ParamError("prompt", f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                                       f"{self.max_context}")
        if params.max_tokens > room:
            params = replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        need = self.live_pages_for(len(prompt_ids) + params.max_tokens)
        if need > self.num_pages:
            too_long = self.pages_for(len(prompt_ids) + 1) > self.num_pages
            raise ParamError("prompt" if too_long else "max_tokens",
                             f"request needs {need} KV pages; the pool has {self.num_pages} (give more KV memory)")
        if params.stop and grammars is None:
            raise ParamError("stop", "stop strings need a tokenizer")
        if params.structured is not None:
            if not self.structured_output:
                # the next step's mask needs the token the step in flight is still drawing
                raise ParamError(params.structured.param, "structured output does not run one step ahead: "
                                                          "serve it with an engine that does not overlap steps "
                                                          "(kiln.LLM(..., overlap=False))")
            if grammars is None:
                raise ParamError(params.structured.param, "structured output needs the model's tokenizer")
            grammars.compile(params.structured)          # a 400 now, not an error mid-generation
        if export_kv and (params.n != 1 or not self.exports_kv):
            raise ParamError("n", "only a one-sample request on a runner that reads its pages can export its KV")
        return params
