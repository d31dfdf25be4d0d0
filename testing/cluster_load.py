"""Loads for a kiln cluster, each request's outcome counted (the tests and bench/cluster.py use them).

`mixed_load`: clients that, until a deadline, send streamed requests (some of which the client drops
after a few chunks, as a user who closes the tab) and non-streamed ones; every request ends as one
Outcome kind, so a request that is lost (no answer within `timeout`) or a 5xx shows. `prefix_load`:
prompts that share one of a few long system prompts, each a question after it, streamed one at a
time per client; it returns each request's time to first chunk.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from kiln.serve.bench import WORDS


@dataclass
class Outcomes:
    kinds: Counter = field(default_factory=Counter)   # kind -> requests
    ttfts: list[float] = field(default_factory=list)  # seconds, of streamed requests
    errors: list[str] = field(default_factory=list)   # what each request that did not complete said

    KINDS = ("completed", "disconnected", "stream_error", "http_4xx", "http_5xx", "lost")

    def add(self, kind: str, error: str = "") -> None:
        self.kinds[kind] += 1
        if error:
            self.errors.append(f"{kind}: {error}"[:300])

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _streamed(http, body, outcomes: Outcomes, drop_after: int | None, timeout: float) -> None:
    start, chunks = time.perf_counter(), 0
    try:
        async with asyncio.timeout(timeout):
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    kind = "http_5xx" if r.status_code >= 500 else "http_4xx"
                    return outcomes.add(kind, f"{r.status_code} {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return outcomes.add("completed")
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return outcomes.add("stream_error", chunk["error"]["message"])
                    chunks += 1
                    if chunks == 1:
                        outcomes.ttfts.append(time.perf_counter() - start)
                    if drop_after is not None and chunks >= drop_after:
                        return outcomes.add("disconnected")      # leaving the block closes the connection
                outcomes.add("lost", "the stream ended without [DONE]")
    except TimeoutError:
        outcomes.add("lost", f"no end within {timeout} s")
    except httpx.HTTPError as e:
        outcomes.add("lost", f"{type(e).__name__}: {e}")


async def _whole(http, body, outcomes: Outcomes, timeout: float) -> None:
    try:
        r = await http.post("/v1/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return outcomes.add("lost", f"no answer within {timeout} s")
    except httpx.HTTPError as e:
        return outcomes.add("lost", f"{type(e).__name__}: {e}")
    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"):
        return outcomes.add("completed")
    outcomes.add("http_5xx" if r.status_code >= 500 else "http_4xx", f"{r.status_code} {r.text[:200]}")


async def mixed_load(url: str, seconds: float, clients: int = 8, max_tokens: int = 24, stream_share: float = 0.75,
                     drop_share: float = 0.3, prompt_words: tuple[int, int] = (8, 60), seed: int = 0,
                     timeout: float = 60.0, streamed: Outcomes | None = None, whole: Outcomes | None = None
                     ) -> tuple[Outcomes, Outcomes]:
    """Outcomes of (the streamed requests, the non-streamed ones) of `clients` clients for `seconds`."""
    streamed, whole = streamed or Outcomes(), whole or Outcomes()
    deadline = time.monotonic() + seconds

    async def client(k: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            body = {"prompt": words(rng, rng.randint(*prompt_words)), "max_tokens": rng.randint(2, max_tokens),
                    "temperature": 0.0, "ignore_eos": True}
            if rng.random() < stream_share:
                drop = rng.randint(1, 4) if rng.random() < drop_share else None
                await _streamed(http, body, streamed, drop, timeout)
            else:
                await _whole(http, body, whole, timeout)
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=clients + 2)) as http:
        await asyncio.gather(*(client(k, http) for k in range(clients)))
    return streamed, whole


def shared_prefix_prompts(systems: int = 8, questions: int = 12, system_words: int = 120, question_words: int = 12,
                          seed: int = 0) -> list[str]:
    """systems × questions prompts, each a system prompt then a question, in a shuffled order."""
    rng = random.Random(seed)
    heads = [f"System {i}: " + words(rng, system_words) for i in range(systems)]
    prompts = [f"{head}\nQuestion: {words(rng, question_words)}?" for head in heads for _ in range(questions)]
    rng.shuffle(prompts)
    return prompts


async def prefix_load(url: str, prompts: list[str], clients: int = 4, max_tokens: int = 4,
                      timeout: float = 120.0) -> Outcomes:
    outcomes, queue = Outcomes(), list(reversed(prompts))

    async def client(http):
        while queue:
            body = {"prompt": queue.pop(), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            await _streamed(http, body, outcomes, None, timeout)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return outcomes


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in /metrics text."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
