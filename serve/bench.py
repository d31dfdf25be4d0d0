"""`kiln bench serve`: a load generator for any OpenAI-compatible server, reporting what
`vllm bench serve` reports.

Requests go to /v1/completions, streaming, with Poisson arrivals at --request-rate (inf: all
at once) and at most --max-concurrency in flight. Prompts are random words (so any server's
tokenizer can read them); the server's `usage` gives the true token counts. Every request asks
for its output length with `ignore_eos` (servers that do not know it stop at their EOS; the
report counts what came back). TTFT is the time to the first chunk, ITL the gaps between
chunks, TPOT (E2EL - TTFT) / (output tokens - 1).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact water room money story lot study book word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "team minute idea kid body information back parent face others level office door health art war history "
         "party result change morning reason research girl guy moment air teacher force education").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(n: int, input_len: int, output_len: int, dataset: str, seed: int,
                  prefix_len: int = 0) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) pairs. 'random': about input_len words each (about one token per word
    and space), output_len tokens; 'sharegpt-like': lengths drawn from long-tailed (lognormal)
    distributions with those means, as chat logs have, capped at 4x. With prefix_len, every prompt
    starts with the same prefix_len words (a shared system prompt: what prefix caching serves)."""
    rng = random.Random(seed)
    prefix = "".join(rng.choice(WORDS) + " " for _ in range(prefix_len))
    out = []
    for _ in range(n):
        if dataset == "sharegpt-like":
            n_in = min(4 * input_len, max(4, int(rng.lognormvariate(0, 0.8) * input_len / 1.38)))
            n_out = min(4 * output_len, max(4, int(rng.lognormvariate(0, 0.8) * output_len / 1.38)))
        else:
            n_in, n_out = input_len, output_len
        out.append((prefix + " ".join(rng.choice(WORDS) for _ in range(max(1, n_in - 1))), n_out))
    return out


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # every chunk with a choice carries a token, even when its text is still empty
                # (a character split across tokens, or a random-weight model's unprintable ids)
                if chunk.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
        res.e2el = time.perf_counter() - start
        res.ok = last is not None
        if not res.output_tokens:                       # a server without usage in streams: count chunks
            res.output_tokens = len(res.itls) + 1 if res.ok else 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.mean(values) * scale, "median": statistics.median(values) * scale,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * scale}


async def run_benchmark(url: str, model: str | None, requests: list[tuple[str, int]], request_rate: float,
                        max_concurrency: int | None, api_key: str | None = None, seed: int = 0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(3600), limits=limits) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(max_concurrency or len(requests))
        rng = random.Random(seed)

        async def limited(prompt, max_tokens):
            async with gate:
                return await one_request(http, model, prompt, max_tokens)
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    return {
        "model": model, "num_prompts": len(requests), "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "request_rate": request_rate, "max_concurrency": max_concurrency, "duration_s": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itls]), "e2el_ms": _stats([r.e2el for r in ok]),
    }


def format_report(r: dict) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{r['successful_requests']:<10}",
        f"{'Failed requests:':<40}{r['failed_requests']:<10}",
        f"{'Maximum request concurrency:':<40}{r['max_concurrency']}",
        f"{'Request rate (req/s):':<40}{r['request_rate']}",
        f"{'Benchmark duration (s):':<40}{r['duration_s']:<10.2f}",
        f"{'Total input tokens:':<40}{r['total_input_tokens']:<10}",
        f"{'Total generated tokens:':<40}{r['total_output_tokens']:<10}",
        f"{'Request throughput (req/s):':<40}{r['request_throughput']:<10.2f}",
        f"{'Output token throughput (tok/s):':<40}{r['output_throughput']:<10.2f}",
        f"{'Total token throughput (tok/s):':<40}{r['total_token_throughput']:<10.2f}",
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        short = key.split("_")[0].upper()
        lines.append(f"{'-' * 15}{title}{'-' * max(1, 35 - len(title))}")
        for stat in ("mean", "median", "p99"):
            lines.append(f"{f'{stat.capitalize()} {short} (ms):':<40}{r[key][stat]:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
