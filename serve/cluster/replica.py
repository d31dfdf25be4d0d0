"""One kiln engine on the artifact, as a Ray Serve replica (the deployment class `KilnReplica`).

A replica is the engine `kiln serve` runs in one process: kiln.LLM and its AsyncEngine, on the CPU's
threads or on one GPU (the deployment's ray_actor_options say which). Its methods take a job, a
dict whose `requests` are the keyword arguments of AsyncEngine.add_requests:
  generate   streams each step's RequestOutputs (a caller that goes away aborts the requests);
  complete   returns the final outputs (a non-streamed response, which the ingress may retry);
  prefill    runs each prompt to its first token and exports its KV pages through the transport;
             a request with `kv` (a transport handle) in `generate` or `complete` imports them.
Every PERIOD seconds, for as long as it runs, it writes its engine's gauges to the application's
board (board.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from ray import serve

from kiln.serve.app import ServerConfig, open_engine
from kiln.serve.metrics import EngineGauges

from .board import PERIOD, board
from .transport import TRANSPORTS


class KilnReplica:
    async def __init__(self, config: ServerConfig, role: str = "engine", transport: str = "ray-object-store"):
        self.llm, self.engine, self.description = open_engine(config)
        self.role, self.transport = role, TRANSPORTS[transport]()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.board = board(context.app_name)
        self._publisher = asyncio.get_running_loop().create_task(self._publish())

    # -- the engine --------------------------------------------------------------------------------
    async def _admit(self, job: dict):
        """The job's requests admitted to the engine (their KV imported first where they bring it)."""
        requests = []
        for r in job["requests"]:
            r = dict(r)
            if r.get("kv") is not None:
                r["kv"] = await self.transport.receive(r["kv"])
            requests.append(r)
        return self.engine.add_requests(requests)

    async def generate(self, job: dict):
        stream = await self._admit(job)
        try:
            async for out in stream:
                yield out
        finally:                                  # the caller went away (or the stream ended): abort the rest
            await stream.aclose()

    async def complete(self, job: dict) -> list:
        finals = {}
        async for out in self.generate(job):
            if out.finished:
                finals[out.request_id] = out
        return [finals[r["request_id"]] for r in job["requests"]]

    async def prefill(self, job: dict) -> list:
        """Each request run to its first token: [(its output, a transport handle of its KV pages, or
        None where the first token ended it)]."""
        firsts = [dataclasses.replace(r["params"], max_tokens=1) for r in job["requests"]]
        job = {"requests": [{**r, "params": p, "export_kv": True} for r, p in zip(job["requests"], firsts)]}
        outs = []
        for out in await self.complete(job):
            kv, out.kv = out.kv, None
            going_on = out.outputs[0].finish_reason == "length" and kv is not None
            outs.append((out, self.transport.send(kv) if going_on else None))
        return outs

    # -- what the ingress and Ray Serve ask ------------------------------------------------------------
    async def describe(self) -> dict:
        """What the ingress needs to check requests as this engine would (remote.py): its limits."""
        return {"limits": self.llm.limits, "description": self.description}

    def gauges(self) -> EngineGauges:
        return EngineGauges.of(self.llm.engine)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine loop has died."""
        task = self.engine._loop_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError(f"the engine loop stopped: {task.exception()!r}")

    async def _publish(self) -> None:
        """Write the gauges to the board every PERIOD seconds while the replica runs."""
        while True:
            with contextlib.suppress(Exception):        # a board that restarts misses a beat, no more
                await self.board.put.remote(self.replica_id, self.role, self.gauges())
            await asyncio.sleep(PERIOD)

    async def __del__(self):
        with contextlib.suppress(Exception):
            await self.board.remove.remote(self.replica_id)
