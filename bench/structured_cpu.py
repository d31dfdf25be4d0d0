"""Structured output's cost on the CPU: decode tok/s with a JSON schema beside the same artifact
unconstrained, in the same run, at batch 1 and 8; the grammar's compile time and the mask time per
token.

    python bench/structured_cpu.py [--preset llama-3.2-1b] [--mode q8] [--vocab 128000]
                                   [--batches 1,8] [--new-tokens 64] [--repeats 3]

The preset's random-weight model gets a byte-level BPE tokenizer of up to --vocab tokens trained
here on the Python sources of this interpreter's library (stdlib and site-packages), so xgrammar
masks a vocabulary of a real model's size; the model's embedding keeps the preset's rows. Both
runs are greedy. The constrained one asks for a JSON array of --items integers (0-999): random
weights fill it to the end, so it decodes about as many tokens as the free run, which ignores EOS.
tok/s counts decode tokens (after the first) over the decode time, median of --repeats. The mask
time is each output's tokens replayed through a fresh matcher, timing the mask alone (fill,
unpack, the barred specials).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from kiln.options import CompileOptions

MODES = {"f32": ("float32", None), "bf16": ("bfloat16", None), "q8": ("float32", "q8"), "q4": ("float32", "q4")}


def library_sources(limit_bytes: int = 60 << 20):
    """The .py files under this interpreter's library directories, up to `limit_bytes` of text."""
    import sysconfig
    seen = 0
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib")}
    for root in sorted(roots):
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            seen += len(text)
            if seen > limit_bytes:
                return
            yield text


def main() -> None:
    ap = argparse.ArgumentParser()
    from kiln.testing.tiny import PRESETS
    ap.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--mode", default="q8", choices=sorted(MODES))
    ap.add_argument("--vocab", type=int, default=128000, help="tokens of the trained tokenizer (at most)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--items", type=int, default=24, help="integers in the constrained JSON array")
    ap.add_argument("--new-tokens", type=int, default=64, help="the free run's tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.runtime.threads import resolve_threads
    args.threads = resolve_threads(args.threads)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    from kiln.compiler import compile_model
    from kiln.runtime.grammar import GrammarSpec
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    from kiln.testing.tiny import preset_model, train_tokenizer

    work = Path(args.workdir) / args.preset
    model_dir = preset_model(args.preset, work / "model")
    vocab_dir = work / f"model-vocab{args.vocab}"
    if not (vocab_dir / "tokenizer.json").exists():
        shutil.copytree(model_dir, vocab_dir, dirs_exist_ok=True)
        train_tokenizer(vocab_dir, args.vocab, library_sources())
    dtype, quant = MODES[args.mode]
    artifact = work / f"artifact-{args.mode}-vocab{args.vocab}"
    if not (artifact / "manifest.json").exists():
        options = CompileOptions(target="cpu", dtype=dtype, quant=quant)
        compile_model(vocab_dir, artifact, options, show=None, force=True)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(artifact, kv_memory="512MiB", max_num_seqs=max(batches), overlap=False)
    tokens = llm.tokenizer.vocab_size
    prompts = [llm.tokenizer.encode(f"Write {args.items} numbers, set {i}:") for i in range(max(batches))]
    schema = {"type": "array", "minItems": args.items, "maxItems": args.items,
              "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    runs = {"free": SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True),
            "schema": SamplingParams(temperature=0.0, max_tokens=8 * args.items + 8, structured=spec)}

    def decode_rate(params, batch):
        reqs = llm.generate(prompts[:batch], params, use_tqdm=False)
        first = max(r.metrics.first_token_time for r in reqs)
        last = max(r.metrics.finish_time for r in reqs)
        counted = sum(len(r.outputs[0].token_ids) - 1 for r in reqs)
        return counted / (last - first), reqs

    t0 = time.perf_counter()
    llm.engine.grammars.compile(spec)
    compile_seconds = time.perf_counter() - t0
    for params in runs.values():                                      # warm-up
        llm.generate(prompts[:1], SamplingParams(**{**params.__dict__, "max_tokens": 4}), use_tqdm=False)
    rows, outputs = [], []
    for batch in batches:
        rates = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, params in runs.items():
                rate, reqs = decode_rate(params, batch)
                rates[name].append(rate)
                if name == "schema":
                    outputs += [r.outputs[0] for r in reqs]
        free, constrained = (statistics.median(rates[n]) for n in ("free", "schema"))
        rows.append((batch, free, constrained))

    valid = sum(o.finish_reason == "stop" and len(json.loads(o.text)) == args.items for o in outputs)
    mask_us = []
    for out in outputs[:8]:
        matcher = llm.engine.grammars.matcher(spec)
        for tok in out.token_ids[:-1]:
            t0 = time.perf_counter()
            matcher.allowed()
            mask_us.append((time.perf_counter() - t0) * 1e6)
            matcher.accept(tok)

    print(f"\n{args.preset} {args.mode}, {args.threads} threads; tokenizer of {tokens} tokens (model vocab "
          f"{llm.model.vocab_size}); greedy, median of {args.repeats}")
    print(f"schema: a JSON array of {args.items} integers in [0, 999]; grammar compile {compile_seconds * 1e3:.0f} ms; "
          f"mask {statistics.median(mask_us):.0f} µs per token (median of {len(mask_us)}); "
          f"{valid}/{len(outputs)} outputs parsed with {args.items} items")
    print("| batch | free tok/s | JSON schema tok/s | schema / free |")
    print("|---|---|---|---|")
    for batch, free, constrained in rows:
        print(f"| {batch} | {free:.2f} | {constrained:.2f} | {constrained / free:.2f}x |")


if __name__ == "__main__":
    main()
