"""`kiln serve` against vLLM's CPU build (`vllm serve`), both driven by vLLM's own client
(`vllm bench serve`, a third-party client for kiln), same requests, same window; one table.

    python bench/serve_vs_vllm.py ARTIFACT MODEL_DIR [--vllm build/peers/vllm/bin/vllm]
        [--concurrency 1,8] [--num-prompts 16] [--input-len 128] [--output-len 64] [--threads N]

Each server runs alone while it is measured; the client runs beside it on the same cores (on a
2-core machine it takes CPU from both servers alike). vLLM is installed as ../shared/PEERS.md
says, never into kiln's venv. Full results go to --out-dir as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from serve_vs_hf import start

NAME = "bench-model"


def bench(vllm: str, url: str, model_dir: str, c: int, args, out: Path, env: dict) -> dict:
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", NAME, "--tokenizer", model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency", str(c), "--ignore-eos",
           "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("model_dir")
    ap.add_argument("--vllm", default="build/peers/vllm/bin/vllm")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out-dir", default="build/bench/serve-vllm")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": str(args.threads)}
    servers = {
        "kiln": ([sys.executable, "-m", "kiln.cli", "serve", args.artifact, "--port", "8400", "--kv-memory", "2GiB",
                  "--max-num-seqs", str(max(levels)), "--served-model-name", NAME, "--threads", str(args.threads)],
                 "http://127.0.0.1:8400"),
        "vllm": ([args.vllm, "serve", args.model_dir, "--dtype", args.dtype, "--port", "8401",
                  "--served-model-name", NAME, "--max-num-seqs", str(max(levels)),
                  "--max-model-len", str(4 * (args.input_len + args.output_len))], "http://127.0.0.1:8401"),
    }
    results: dict = {}
    for name, (cmd, url) in servers.items():
        proc = start(cmd, url, env)
        try:
            for c in levels:
                results[(name, c)] = bench(args.vllm, url, args.model_dir, c, args, out_dir / f"{name}-c{c}.json", env)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    print(f"\nvllm bench serve: {args.num_prompts} random prompts of {args.input_len} tokens, {args.output_len} output "
          f"tokens (ignore_eos), {args.threads} threads per server")
    print("| concurrency | server | output tok/s | median TTFT (ms) | median TPOT (ms) | median ITL (ms) | failed |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        for name in servers:
            r = results[(name, c)]
            failed = r.get("num_prompts", args.num_prompts) - r.get("completed", 0)
            print(f"| {c} | {name} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
                  f"{r['median_tpot_ms']:.0f} | {r['median_itl_ms']:.0f} | {failed} |")
        ratio = results[("kiln", c)]["output_throughput"] / results[("vllm", c)]["output_throughput"]
        print(f"| {c} | kiln / vllm | {ratio:.2f}x | | | | |")


if __name__ == "__main__":
    main()
