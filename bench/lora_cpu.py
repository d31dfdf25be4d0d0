"""Multi-LoRA decode on the CPU: the base model's throughput beside the same batch on adapters.

    python bench/lora_cpu.py [--preset llama-3.2-1b] [--quant q8] [--batch 8] [--rank 16] [--threads N]

Two artifacts of the preset's model (random weights): without adapter slots, and with --max-loras
BATCH --max-lora-rank RANK. Rank-RANK PEFT adapters on q/k/v/o/gate/up/down (random, written here
in PEFT's file format). BATCH sequences of --prompt-len tokens each generate --new-tokens greedily,
in one kiln.LLM.generate; decode tok/s counts the tokens after each sequence's first over the time
from the last first token to the last token (prefill left out). Medians of --repeats. Rows: the base
artifact; the LoRA artifact with no adapter; all sequences on one adapter; each on its own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of the model (config.json's shapes) with random A and B."""
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden, ffn, head_dim = config["hidden_size"], config["intermediate_size"], config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in MODULES:
            out, inp = shapes[module]
            where = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{module}.lora_{{}}.weight"
            tensors[key.format("A")] = (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32)
            tensors[key.format("B")] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(MODULES)}))
    return folder


def decode_rate(llm, prompts, params, loras, repeats: int) -> float:
    rates = []
    for _ in range(repeats + 1):                    # the first run warms up
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        rates.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default="build/bench/lora")
    args = ap.parse_args()
    if args.threads:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from kiln.compiler import compile_model
    from kiln.options import CompileOptions
    from kiln.runtime.llm import LLM
    from kiln.runtime.lora import LoRARequest
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.tiny import preset_model
    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    config = json.loads((model_dir / "config.json").read_text())
    artifacts = {}
    for name, slots in (("base", 0), ("lora", args.batch)):
        out = work / f"{args.quant}-{name}-r{args.rank}"
        if not (out / "manifest.json").exists():
            compile_model(model_dir, out, CompileOptions(quant=args.quant, max_loras=slots, max_lora_rank=args.rank),
                          show=None)
        artifacts[name] = out
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(work / f"adapter-r{args.rank}-{i}", config, args.rank,
                                                                   i)))
                for i in range(args.batch)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config["vocab_size"], args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    base = decode_rate(LLM(artifacts["base"], kv_memory="256MiB"), prompts, params, None, args.repeats)
    rows.append(("base artifact (no slots)", "-", base))
    llm = LLM(artifacts["lora"], kv_memory="256MiB")
    for label, loras in (("LoRA artifact, no adapter", None), ("all on one adapter", [adapters[0]] * args.batch),
                         (f"each on its own ({args.batch} adapters)", adapters)):
        rows.append((label, "1" if loras and len({a.lora_int_id for a in loras}) == 1 else
                     str(args.batch) if loras else "0", decode_rate(llm, prompts, params, loras, args.repeats)))
    threads = os.environ.get("TVM_NUM_THREADS", "all")
    print(f"\n{args.preset} {args.quant}, batch {args.batch}, rank {args.rank} on q/k/v/o/gate/up/down, "
          f"{args.prompt_len} in / {args.new_tokens} out, threads {threads}; decode tok/s, medians of {args.repeats}")
    print("| run | adapters | decode tok/s | vs base |\n|---|---|---|---|")
    for label, count, rate in rows:
        print(f"| {label} | {count} | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
