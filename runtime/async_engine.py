"""The async API the HTTP server uses: `add_requests` admits requests in one synchronous step
(validated, or a ParamError raised before anything is sent), and the stream it returns yields
one RequestOutput per step that gave one of them tokens, the last of each with `finished` set.

One background task drives the Engine: it steps while any request is unfinished, running each
step in a worker thread so the event loop stays free, and hands every output to its stream's
queue. The engine is not thread-safe, so admitted requests and aborts are queued and applied
by that task between steps. Closing a stream early (a client that disconnects; use
`contextlib.aclosing` around the `async for`) aborts its unfinished requests: the abort is
queued without awaiting anything (it must work inside a cancelled task) and applied before the
next step, which frees their pages.
"""
from __future__ import annotations

import asyncio

from kiln.errors import QueueFull

from .engine import Engine
from .kv_transfer import KVSnapshot
from .request import Request, RequestOutput
from .sampler import SamplingParams


class RequestStream:
    """The outputs of a group of requests admitted together, in the order the engine makes them."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str], queue: asyncio.Queue):
        self._engine, self.request_ids, self._queue = engine, request_ids, queue
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        out: RequestOutput | BaseException = await self._queue.get()
        if isinstance(out, BaseException):
            self._unfinished.clear()
            raise out
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    async def aclose(self) -> None:
        """Abort whatever has not finished (idempotent; never awaits)."""
        for request_id in self.request_ids:
            self._engine._queues.pop(request_id, None)
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._unfinished.clear()


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int | None = None):
        """`max_waiting`: the most requests that may wait to start (None: no limit); beyond it
        `add_requests` raises QueueFull."""
        self.engine, self.max_waiting = engine, max_waiting
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_add: list[tuple[Request, KVSnapshot | None]] = []
        self._to_abort: set[str] = set()
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def add_requests(self, requests: list[dict], streaming: bool = True) -> RequestStream:
        """Admit requests (each the keyword arguments of `Engine.check_request`, or with `kv`, a
        KVSnapshot, those of `Engine.check_import`) together: all are validated first, so a
        ParamError admits none. Returns their stream. (`streaming`, whether the caller shows each
        output as it comes, matters only to engines that can lose a request and retry it:
        kiln.serve.cluster's.)"""
        waiting = len(self.engine.scheduler.waiting) + self.num_pending + len(requests)
        if self.max_waiting is not None and waiting > self.max_waiting:
            raise QueueFull("too many requests are waiting; retry later")
        made = []
        for r in requests:
            r = dict(r)
            kv = r.pop("kv", None)
            made.append((self.engine.check_request(**r) if kv is None else self.engine.check_import(kv, **r), kv))
        queue: asyncio.Queue = asyncio.Queue()
        for req, _ in made:
            self._queues[req.request_id] = queue
        self._to_add.extend(made)
        self._ensure_loop()
        self._wake.set()
        return RequestStream(self, [r.request_id for r, _ in made], queue)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    prompt: str | None = None, priority: int = 0) -> RequestStream:
        return self.add_requests([dict(prompt_ids=prompt_ids, params=params, request_id=request_id, prompt=prompt,
                                       priority=priority)])

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, prompt: str | None = None, priority: int = 0):
        """`async for out in engine.generate(...)`: one request's outputs (admitted on first iteration)."""
        stream = self.add_request(prompt_ids, params, request_id, prompt, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Stop a request before the next step (safe from any coroutine, cancelled or not)."""
        self._to_abort.add(request_id)
        self._wake.set()

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def num_pending(self) -> int:
        """Requests admitted but not yet handed to the engine."""
        return len(self._to_add)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_queued(self) -> None:
        """Between steps: hand admitted requests to the engine, then apply aborts (an abort of a
        request admitted in the same breath must find it enqueued)."""
        while self._to_add:
            req, kv = self._to_add.pop(0)
            try:
                if kv is None:
                    self.engine.enqueue(req)
                else:
                    self.engine.enqueue_imported(req, kv)
            except Exception as e:          # (a duplicate id raced in, no pages for an import): fail it alone
                queue = self._queues.pop(req.request_id, None)
                if queue is not None:
                    queue.put_nowait(e)
        while self._to_abort:
            self.engine.abort(self._to_abort.pop())

    async def _run(self) -> None:
        while True:
            self._apply_queued()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as e:           # a failing step fails the requests in it, not the server
                for request_id, queue in list(self._queues.items()):
                    queue.put_nowait(e)
                    self.engine.abort(request_id)
                self._queues.clear()
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
            await asyncio.sleep(0)           # let consumers run between steps
