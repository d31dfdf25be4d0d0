"""`kiln serve` on a CUDA artifact under load: kiln's client (`kiln bench serve`) and, where it is
installed, vLLM's (`vllm bench serve`, the client alone), same requests; one table.

    python bench/serve_gpu.py ARTIFACT [--concurrency 1,8,32,128] [--num-prompts 0] [--kv-memory 0.4]
                              [--workloads random,sharegpt-like,shared-prefix] [--vllm vllm]
                              [--port 8765] [--out-dir $OUT or build/bench/serve-gpu]

Workloads, in tokens of the artifact's tokenizer (serve/bench.py's prompts are random words: their
count is scaled by the words a token takes there; "in tok" in the table is the server's count):
  random          1024 tokens in, 128 out
  sharegpt-like   lengths drawn around those means, long-tailed, capped at 4x (serve/bench.py)
  shared-prefix   one 2048-token system prompt that every request of a run starts with, then a
                  256-token question, 128 out: measured with prefix caching on, then again on a
                  server started with --no-prefix-caching
Each concurrency level sends other prompts (seeded by the level), so no run hits the cache on the last's.
--num-prompts 0 sends 4 x concurrency (at least 16) per run. Each row is printed as it is measured
(a run cut short keeps the rows before it) and each report is saved as JSON in --out-dir, beside the
servers' logs. The server runs alone on the GPU; the clients run on the same machine's CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from serve_vs_hf import start

# name -> (serve/bench.py dataset, input tokens, output tokens, shared prefix tokens)
WORKLOADS = {"random": ("random", 1024, 128, 0), "sharegpt-like": ("sharegpt-like", 1024, 128, 0),
             "shared-prefix": ("random", 256, 128, 2048)}
HEADER = ("| workload | prefix cache | concurrency | client | ok | failed | in tok | output tok/s "
          "| TTFT median ms | TTFT p99 ms | TPOT median ms | TPOT p99 ms |\n|" + "---|" * 12)


def words_per_token(artifact: str) -> float:
    """How many of serve/bench.py's random words one token of the artifact's tokenizer holds."""
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.serve.bench import make_requests
    [(text, _)] = make_requests(1, 2000, 1, "random", seed=1)
    return len(text.split()) / len(Tokenizer(artifact).encode(text))


def kiln_client(url: str, workload: str, words: float, prompts: int, concurrency: int) -> dict:
    from kiln.serve.bench import make_requests, run_benchmark
    dataset, input_len, output_len, prefix_len = WORKLOADS[workload]
    requests = make_requests(prompts, round(input_len * words), output_len, dataset, seed=concurrency,
                             prefix_len=round(prefix_len * words))
    return asyncio.run(run_benchmark(url, None, requests, float("inf"), concurrency))


def vllm_client(vllm: str, url: str, model: str, tokenizer: str, input_len: int, output_len: int, prompts: int,
                concurrency: int, out: Path) -> dict:
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def kiln_row(r: dict) -> list:
    """(ok, failed, in tok, output tok/s, TTFT median, p99, TPOT median, p99) of a kiln bench serve report."""
    ok = r["successful_requests"]
    return [ok, r["failed_requests"], r["total_input_tokens"] / max(ok, 1), r["output_throughput"],
            r["ttft_ms"]["median"], r["ttft_ms"]["p99"], r["tpot_ms"]["median"], r["tpot_ms"]["p99"]]


def vllm_row(v: dict, n: int) -> list:
    """The same columns from vllm bench serve's saved result (p99s where it measured them)."""
    ok = v["completed"]
    return [ok, n - ok, v["total_input_tokens"] / max(ok, 1), v["output_throughput"], v["median_ttft_ms"],
            v.get("p99_ttft_ms", float("nan")), v["median_tpot_ms"], v.get("p99_tpot_ms", float("nan"))]


def print_row(workload: str, caching: str, c: int, client: str, cols: list) -> None:
    ok, failed, in_tok, tps, ttft, ttft99, tpot, tpot99 = cols
    print(f"| {workload} | {caching} | {c} | {client} | {ok} | {failed} | {in_tok:.0f} | {tps:.0f} | {ttft:.0f} "
          f"| {ttft99:.0f} | {tpot:.1f} | {tpot99:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--num-prompts", type=int, default=0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {', '.join(WORKLOADS)}")
    ap.add_argument("--vllm", default="vllm")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--kv-memory", default="0.4", help="kiln serve's --kv-memory (default: 0.4 of free GPU memory)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "build/bench/serve-gpu"))
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    vllm = shutil.which(args.vllm)
    words = words_per_token(args.artifact)
    # the shared-prefix workload runs again on a server without prefix caching: what the cache gives
    servers = [("on", workloads)] + ([("off", ["shared-prefix"])] if "shared-prefix" in workloads else [])
    print(f"{args.artifact}, kiln serve, all requests at once under each concurrency cap\n{HEADER}", flush=True)
    for caching, names in servers:
        cmd = [sys.executable, "-m", "kiln.cli", "serve", args.artifact, "--port", str(args.port), "--max-num-seqs",
               str(max(levels)), "--kv-memory", args.kv_memory, f"--{'' if caching == 'on' else 'no-'}prefix-caching"]
        server = start(cmd, url, dict(os.environ), out_dir / f"server-prefix-caching-{caching}.log")
        try:
            model = __import__("httpx").get(f"{url}/v1/models").json()["data"][0]["id"]
            for name in names:
                for c in levels:
                    n = args.num_prompts or max(16, 4 * c)
                    r = kiln_client(url, name, words, n, c)
                    (out_dir / f"kiln-{name}-cache-{caching}-c{c}.json").write_text(json.dumps(r, indent=2))
                    print_row(name, caching, c, "kiln bench serve", kiln_row(r))
                    if r["errors"]:
                        print(f"<!-- errors: {r['errors']} -->", flush=True)
                    if vllm and name == "random":
                        _, input_len, output_len, _ = WORKLOADS[name]
                        v = vllm_client(vllm, url, model, args.artifact, input_len, output_len, n, c,
                                        out_dir / f"vllm-client-c{c}.json")
                        print_row(name, caching, c, "vllm bench serve", vllm_row(v, n))
        finally:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
