"""Mixture-of-experts and MLA decode on the CPU: kiln beside llama.cpp and HF transformers, same run.

    python bench/moe_mla.py [--presets deepseek-v2-lite-4l,mixtral-small] [--threads 2] [--new-tokens 32]
                            [--repeats 3] [--llama-cpp build/peers/llama_cpp_python-*/vendor/llama.cpp]

Per preset (random bf16 weights written tensor by tensor, testing/tiny.py PRESETS): decode tok/s at
batch 1 and 8 for kiln (bf16), llama.cpp (the same checkpoint converted to a bf16 GGUF; llama-bench
tg for batch 1, llama-batched-bench's S_TG for 8 parallel sequences) and HF transformers (bf16,
`generate`), all with the same thread count; and the KV bytes per token kiln stores against what
an expanded cache (K and V of every head) would take. Medians of --repeats.
llama.cpp is built as ../shared/PEERS.md says; its converter wants a tokenizer it knows, so the GGUF
gets a small SentencePiece vocabulary (speed does not depend on the tokenizer) and, for DeepSeek,
whose converter only takes BPE vocabularies, that one is written through the SentencePiece path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from big_model import built_llama_cpp, gguf_source  # noqa: E402
from decode_cpu import decode_rate  # noqa: E402

from kiln.options import CompileOptions  # noqa: E402

# DeepSeek's converter reads only BPE vocabularies; route it through the SentencePiece path.
CONVERT_SHIM = """
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import runpy, conversion.deepseek as d
d.DeepseekV2Model.set_vocab = lambda self: self._set_vocab_sentencepiece()
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def expanded_kv_bytes(config: dict, itemsize: int = 2) -> int:
    """Bytes per token of K and V of every head and layer, as a cache without MLA stores them."""
    layers, heads = config["num_layers"], config["num_heads"]
    mla = config.get("mla")
    if mla:
        per_head = mla["nope_dim"] + mla["rope_dim"] + mla["v_dim"]
    else:
        per_head = 2 * config["head_dim"]
        heads = config["num_kv_heads"]
    return layers * heads * per_head * itemsize


def gguf(model_dir: Path, work: Path, llama_cpp: Path) -> Path:
    out = work / "bf16.gguf"
    if out.exists():
        return out
    source = gguf_source(model_dir, work)
    cmd = [sys.executable, "-c", CONVERT_SHIM, str(llama_cpp / "convert_hf_to_gguf.py"), str(source),
           "--outtype", "bf16", "--outfile", str(out)]
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"convert_hf_to_gguf failed:\n{proc.stderr[-3000:]}")
    return out


def llama_cpp_rates(llama_cpp: Path, model: Path, threads: int, new_tokens: int, repeats: int) -> dict:
    bins = llama_cpp / "build" / "bin"
    one = subprocess.run([str(bins / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(new_tokens),
                          "-t", str(threads), "-r", str(repeats), "-o", "json"], capture_output=True, text=True)
    if one.returncode:
        raise SystemExit(f"llama-bench failed:\n{one.stderr[-3000:]}")
    rates = {1: json.loads(one.stdout)[0]["avg_ts"]}
    eight = []
    for _ in range(repeats):
        proc = subprocess.run([str(bins / "llama-batched-bench"), "-m", str(model), "-c", "2048", "-npp", "32",
                               "-ntg", str(new_tokens), "-npl", "8", "-t", str(threads)],
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"llama-batched-bench failed:\n{proc.stderr[-3000:]}")
        row = next(line for line in proc.stdout.splitlines() if re.match(r"\|\s+32\s+\|", line))
        eight.append(float(row.strip("|").split("|")[7]))          # S_TG t/s
    rates[8] = statistics.median(eight)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="deepseek-v2-lite-4l,mixtral-small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", default=None, help="default: build/peers/llama_cpp_python-*/vendor/llama.cpp")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    llama_cpp = built_llama_cpp(args.llama_cpp)

    import numpy as np
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    from kiln.compiler import compile_model
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.tiny import preset_model

    batches = (1, 8)
    prompts = [np.random.default_rng(i).integers(3, 500, args.prompt_len).tolist() for i in range(max(batches))]
    rows, kv_rows = [], []
    for preset in args.presets.split(","):
        work = Path(args.workdir) / preset
        model_dir = preset_model(preset, work / "model")
        t0 = time.perf_counter()
        options = CompileOptions(target="cpu", dtype="bfloat16")
        manifest = compile_model(model_dir, work / "artifact-bf16", options, show=None, force=True).to_json()
        compile_s = time.perf_counter() - t0
        llm = LLM(work / "artifact-bf16", kv_memory="256MiB", max_num_seqs=8)

        def generate(batch, new_tokens, llm=llm):
            reqs = llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                ignore_eos=True), use_tqdm=False)
            return max(r.metrics.first_token_time for r in reqs), max(r.metrics.finish_time for r in reqs)
        generate(1, 4)
        kiln = {b: decode_rate(generate, b, args.new_tokens, args.repeats) for b in batches}
        config = manifest["model"]["config"]
        kv_rows.append([preset, llm.model.bytes_per_token, expanded_kv_bytes(config),
                        f"{expanded_kv_bytes(config) / llm.model.bytes_per_token:.1f}x"])
        del llm
        llama = llama_cpp_rates(llama_cpp, gguf(model_dir, work, llama_cpp), args.threads, args.new_tokens,
                                args.repeats)
        hf = {}
        if not args.no_hf:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                def hf_generate(batch, new_tokens):
                    ids = torch.tensor(prompts[:batch])
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
                    prefill = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=0)
                    return t0 + prefill, time.perf_counter()
                hf_generate(1, 2)
                hf = {b: decode_rate(hf_generate, b, args.new_tokens, args.repeats) for b in batches}
            del model
        for b in batches:
            rows.append([preset, b, f"{compile_s:.0f}", f"{kiln[b]:.2f}", f"{llama[b]:.2f}",
                         f"{kiln[b] / llama[b]:.2f}x", f"{hf[b]:.2f}" if hf else "-",
                         f"{kiln[b] / hf[b]:.2f}x" if hf else "-"])

    print(f"\n{args.threads} threads, bf16, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
          f"median of {args.repeats}")
    print("| model | batch | kiln compile (s) | kiln tok/s | llama.cpp tok/s | kiln / llama.cpp | HF tok/s | kiln / HF |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    print("\n| model | kiln KV bytes/token | expanded K+V bytes/token (bf16) | expanded / kiln |")
    print("|---|---|---|---|")
    for r in kv_rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
