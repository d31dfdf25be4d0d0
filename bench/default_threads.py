"""`kiln run` as a user runs it (no TVM_NUM_THREADS in the environment) against `--threads 1`,
which is what TVM's own default gave on this 2-vCPU machine before kiln chose the count itself.

    python bench/default_threads.py ARTIFACT [--rounds 5] [--prompt-words 100] [--max-tokens 64]

The two settings alternate, each a fresh `kiln run --json` process; the table gives medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def run_once(artifact: str, prompt: str, max_tokens: int, threads: int | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "kiln.cli", "run", artifact, "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--kv-memory", "256MiB", "--json", *([] if threads is None else ["--threads", str(threads)])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["timings"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9 + 1))
    runs: dict[str, list[dict]] = {"default": [], "--threads 1": []}
    for _ in range(args.rounds):
        for name, threads in (("default", None), ("--threads 1", 1)):
            runs[name].append(run_once(args.artifact, prompt, args.max_tokens, threads))
    print(f"kiln run {args.artifact}: {runs['default'][0]['prefill_tokens']} prompt tokens, {args.max_tokens} new; "
          f"medians of {args.rounds} alternating runs; {len(os.sched_getaffinity(0))} cores available")
    print("| setting | threads | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|")
    for name, ts in runs.items():
        print(f"| {name} | {ts[0]['threads']} | {statistics.median(t['prefill_tokens_per_second'] for t in ts):.1f} | "
              f"{statistics.median(t['decode_tokens_per_second'] for t in ts):.1f} |")
    ratio = (statistics.median(t["decode_tokens_per_second"] for t in runs["default"])
             / statistics.median(t["decode_tokens_per_second"] for t in runs["--threads 1"]))
    print(f"default / one thread, decode: {ratio:.2f}x")


if __name__ == "__main__":
    main()
