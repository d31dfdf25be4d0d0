"""`kiln bench serve` against `kiln serve` and against the HF one-request-at-a-time baseline
(bench/hf_server.py), same client, same requests, same run; one table of ratios.

    python bench/serve_vs_hf.py ARTIFACT MODEL_DIR [--concurrency 1,8,32] [--num-prompts 32]
                                [--input-len 64] [--output-len 32] [--threads N]

Each server runs alone on the machine while it is measured. The full reports go to
--out-dir as JSON (one file per server and concurrency).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kiln.serve.bench import format_report, make_requests, run_benchmark


def start(cmd: list[str], url: str, env: dict, log: Path | None = None) -> subprocess.Popen:
    """The server `cmd` once `url` answers /v1/models; its output goes to `log` (a file: a pipe could
    fill and block), whose end a failure to come up quotes."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2)
            if models.status_code == 200:
                return proc
            if "failed to load" in models.text:              # kiln serve's 503 after a failed load
                proc.terminate()
                raise RuntimeError(f"{cmd[:3]}: {models.text[:3000]}")
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise RuntimeError(f"{cmd[:3]} exited with {proc.returncode}\n{tail}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not come up")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("model_dir")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="default: $TVM_NUM_THREADS, else every core")
    ap.add_argument("--out-dir", default="build/bench/serve")
    args = ap.parse_args()
    from kiln.runtime.threads import resolve_threads
    args.threads = resolve_threads(args.threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TVM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = {
        "kiln": ([sys.executable, "-m", "kiln.cli", "serve", args.artifact, "--port", "8100", "--kv-memory", "1GiB",
                  "--max-num-seqs", str(max(levels))], "http://127.0.0.1:8100"),
        "hf": ([sys.executable, str(Path(__file__).with_name("hf_server.py")), args.model_dir, "--port", "8101",
                "--threads", str(args.threads)], "http://127.0.0.1:8101"),
    }
    results: dict = {}
    for name, (cmd, url) in servers.items():
        proc = start(cmd, url, env)
        try:
            asyncio.run(run_benchmark(url, None, make_requests(2, 8, 4, "random", 99), float("inf"), 2))   # warm-up
            for c in levels:
                requests = make_requests(args.num_prompts, args.input_len, args.output_len, "random", seed=c)
                report = asyncio.run(run_benchmark(url, None, requests, float("inf"), c))
                results[(name, c)] = report
                (out_dir / f"{name}-c{c}.json").write_text(json.dumps(report, indent=2))
                print(f"\n{name}, concurrency {c}\n{format_report(report)}", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    print(f"\n{args.num_prompts} requests per level, input ~{args.input_len} words, output {args.output_len} tokens, "
          f"{args.threads} threads")
    print("| concurrency | server | req/s | output tok/s | median TTFT (ms) | median TPOT (ms) | p99 E2EL (ms) | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        for name in servers:
            r = results[(name, c)]
            print(f"| {c} | {name} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                  f"{r['ttft_ms']['median']:.0f} | {r['tpot_ms']['median']:.0f} | {r['e2el_ms']['p99']:.0f} | "
                  f"{r['failed_requests']} |")
        ratio = results[("kiln", c)]["output_throughput"] / results[("hf", c)]["output_throughput"]
        print(f"| {c} | kiln / hf | | {ratio:.2f}x | | | | |")


if __name__ == "__main__":
    main()
