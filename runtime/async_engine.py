"""The async API the HTTP server uses: `async for out in engine.generate(...)` streams one
RequestOutput per step that gave the request tokens, the last one with `finished` set.

One background task drives the Engine: it steps while any request is unfinished, running each
step in a worker thread so the event loop stays free, and hands every output to its request's
queue. Closing the stream early (a client that disconnects; use `contextlib.aclosing` around
the `async for`) aborts the request: the abort is queued without awaiting anything (it must
work inside a cancelled task) and applied before the next step, which frees its pages.
"""
from __future__ import annotations

import asyncio

from .engine import Engine
from .request import RequestOutput
from .sampler import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_abort: set[str] = set()
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stepping = False                 # a step is running in the worker thread

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, prompt: str | None = None, priority: int = 0):
        while self._stepping:                  # the engine is not thread-safe: add between steps
            await asyncio.sleep(0.0005)
        req = self.engine.add_request(prompt_ids, params, request_id, prompt, priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = queue
        self._ensure_loop()
        self._wake.set()
        finished = False
        try:
            while not finished:
                out: RequestOutput | BaseException = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request before the next step (safe from any coroutine, cancelled or not)."""
        self._to_abort.add(request_id)
        self._wake.set()

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_aborts(self) -> None:
        while self._to_abort:
            self.engine.abort(self._to_abort.pop())

    async def _run(self) -> None:
        while True:
            self._apply_aborts()
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            self._stepping = True
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as e:           # a failing step fails the requests in it, not the server
                for request_id, queue in list(self._queues.items()):
                    queue.put_nowait(e)
                    self.engine.abort(request_id)
                continue
            finally:
                self._stepping = False
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)           # let consumers run between steps
