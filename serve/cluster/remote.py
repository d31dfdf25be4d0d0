"""The ingress's side of the replicas: what the OpenAI routes (kiln.serve.app) call an engine.

`RemoteEngine.add_requests` checks the requests here, as the replicas' engines would (a ParamError,
so a 400, before anything is sent: the replicas' RequestLimits.check_request, runtime/limits.py),
and returns a `RemoteStream` of their outputs from a replica. A replica
that dies under a request is a `ReplicaLost`: a streamed response that has shown tokens ends with
that error; a non-streamed one, or a stream that has shown nothing yet, is sent again, to another
replica, up to `retries` times. With a prefill deployment, a one-sample request is first sent
there, runs to its first token and exports its KV; the decode deployment imports the KV and goes
on (the first token is streamed as soon as the prefill has it).
Output times (TTFT and the rest) are taken here, where the client sees them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from kiln.errors import KilnError, QueueFull
from kiln.runtime.grammar import Grammars
from kiln.runtime.limits import RequestLimits
from kiln.runtime.request import RequestMetrics
from kiln.serve.metrics import EngineGauges

LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


class ReplicaLost(KilnError):
    status = 503


class RemoteLLM:
    """The routes' `llm`: the tokenizer, and the replicas' request limits (runtime/limits.py), with a
    grammar compiler to check structured output as theirs would."""

    def __init__(self, info: dict, tokenizer):
        self.tokenizer = tokenizer
        self.limits: RequestLimits = info["limits"]
        self.grammars = Grammars(tokenizer, self.limits.vocab_size, frozenset(tokenizer.eos_token_ids))


class RemoteEngine:
    def __init__(self, llm: RemoteLLM, engines, board, prefill=None, retries: int = 2):
        """`engines`: the handle of the deployment that generates; `prefill`: the prefill deployment's
        handle (disaggregated), or None; `board`: the replicas' gauges (board.py)."""
        self.llm, self.engines, self.prefill, self.board, self.retries = llm, engines, prefill, board, retries
        self._gauges = EngineGauges()

    def add_requests(self, requests: list[dict], streaming: bool = True) -> "RemoteStream":
        for r in requests:
            self.llm.limits.check_request(r["prompt_ids"], r.get("params"), self.llm.grammars,
                                          r.get("export_kv", False))
        return RemoteStream(self, requests, streaming)

    async def refresh_gauges(self) -> None:
        entries = await self.board.read.remote()
        self._gauges = sum((g for _, g in entries.values()), EngineGauges())

    def gauges(self) -> EngineGauges:
        return self._gauges


class RemoteStream:
    """The outputs of requests admitted together, from a replica (AsyncEngine's RequestStream's shape)."""

    def __init__(self, remote: RemoteEngine, requests: list[dict], streaming: bool):
        self.remote, self.requests, self.streaming = remote, requests, streaming
        self.request_ids = [r["request_id"] for r in requests]
        self._times = {r: RequestMetrics(time.perf_counter()) for r in self.request_ids}
        self._call = None            # the replica call in flight (cancelled by aclose)
        self._outputs = self._run()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._outputs.__anext__()

    async def aclose(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self._outputs.aclose()

    async def _run(self):
        shown = False
        for attempt in range(self.remote.retries + 1):
            try:
                async for out in self._attempt():
                    shown = shown or any(c.new_token_ids for c in out.outputs)
                    yield self._timed(out)
                return
            except LOST as e:
                if (self.streaming and shown) or attempt == self.remote.retries:
                    raise ReplicaLost(f"the replica serving this request stopped ({type(e).__name__}); "
                                      "retry the request") from None
                await asyncio.sleep(0.2 * (attempt + 1))      # the router learns the replica is gone
            except BackPressureError:
                raise QueueFull("too many requests are waiting; retry later") from None

    async def _attempt(self):
        remote, job = self.remote, {"requests": self.requests}
        if remote.prefill is not None and self._splits():
            (first, kv), = await self._track(remote.prefill.prefill.remote(job))
            if kv is None:                          # its first token ended it
                yield first
                return
            first.finished, first.outputs[0].finish_reason = False, None
            yield first
            job = {"requests": [{**self.requests[0], "kv": kv}]}
        if self.streaming:
            self._call = remote.engines.options(stream=True).generate.remote(job)
            async for out in self._call:
                yield out
        else:
            for out in await self._track(remote.engines.complete.remote(job)):
                yield out

    async def _track(self, response):
        self._call = response
        return await response

    def _splits(self) -> bool:
        """Whether the request goes to prefill, then decode: one sample, tokens after the first, no
        prompt logprobs (those need every prompt row on one engine)."""
        if len(self.requests) != 1:
            return False
        p = self.requests[0]["params"]
        return p.n == 1 and p.max_tokens > 1 and p.prompt_logprobs is None

    def _timed(self, out):
        """The output with this process's clock: arrival here, first token when it reached here."""
        times = self._times[out.request_id]
        now = time.perf_counter()
        if any(c.new_token_ids for c in out.outputs) or (out.finished and any(c.token_ids for c in out.outputs)):
            times.first_token_time = times.first_token_time or now
            times.last_token_time = now
        if out.finished:
            times.finish_time = now
        times.num_cached_tokens = out.metrics.num_cached_tokens
        times.num_preemptions = out.metrics.num_preemptions
        out.metrics = dataclasses.replace(times)
        return out
