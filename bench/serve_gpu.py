"""`kiln serve` on a CUDA artifact under load: kiln's client (`kiln bench serve`) and, where it is
installed, vLLM's (`vllm bench serve`, the client alone), same requests; one table.

    python bench/serve_gpu.py ARTIFACT [--concurrency 1,8,32,128] [--num-prompts 0] [--kv-memory 0.4]
                              [--vllm vllm] [--port 8765] [--out-dir $OUT or build/bench/serve-gpu]

Workloads: random 1024 tokens in / 128 out, and a ShareGPT-like mix (lognormal lengths with those
means, capped at 4x; serve/bench.py). --num-prompts 0 sends 4 x concurrency (at least 16) per run.
The server runs alone on the GPU; the clients run on the same machine's CPU.
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

WORKLOADS = {"random 1024/128": ("random", 1024, 128), "sharegpt-like": ("sharegpt-like", 1024, 128)}


def kiln_client(url: str, dataset: str, input_len: int, output_len: int, prompts: int, concurrency: int) -> dict:
    from kiln.serve.bench import make_requests, run_benchmark
    requests = make_requests(prompts, input_len, output_len, dataset, seed=0)
    return asyncio.run(run_benchmark(url, None, requests, float("inf"), concurrency))


def vllm_client(vllm: str, url: str, model: str, tokenizer: str, input_len: int, output_len: int, prompts: int,
                concurrency: int, out: Path) -> dict:
    cmd = [vllm, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--num-prompts", type=int, default=0)
    ap.add_argument("--vllm", default="vllm")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--kv-memory", default="0.4", help="kiln serve's --kv-memory (default: 0.4 of free GPU memory)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "build/bench/serve-gpu"))
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    levels = [int(c) for c in args.concurrency.split(",")]
    server = start([sys.executable, "-m", "kiln.cli", "serve", args.artifact, "--port", str(args.port),
                    "--max-num-seqs", str(max(levels)), "--kv-memory", args.kv_memory], url, dict(os.environ))
    rows = []
    try:
        model = __import__("httpx").get(f"{url}/v1/models").json()["data"][0]["id"]
        vllm = shutil.which(args.vllm)
        for name, (dataset, input_len, output_len) in WORKLOADS.items():
            for c in levels:
                n = args.num_prompts or max(16, 4 * c)
                r = kiln_client(url, dataset, input_len, output_len, n, c)
                rows.append(f"| {name} | {c} | kiln bench serve | {r['successful_requests']}/{n} | "
                            f"{r['output_throughput']:.0f} | {r['ttft_ms']['median']:.0f} | "
                            f"{r['tpot_ms']['median']:.1f} |")
                if vllm and dataset == "random":
                    v = vllm_client(vllm, url, model, args.artifact, input_len, output_len, n, c,
                                    out_dir / f"vllm-client-c{c}.json")
                    rows.append(f"| {name} | {c} | vllm bench serve | {v['completed']}/{n} | "
                                f"{v['output_throughput']:.0f} | {v['median_ttft_ms']:.0f} | "
                                f"{v['median_tpot_ms']:.1f} |")
    finally:
        server.terminate()
        server.wait(60)
    print(f"\n{args.artifact}, kiln serve, all requests at once under each concurrency cap")
    print("| workload | concurrency | client | ok | output tok/s | median TTFT ms | median TPOT ms |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
