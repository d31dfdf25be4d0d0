"""Speculative decoding at batch 1: kiln's plain decode, n-gram and draft-model speculation, beside
llama.cpp's llama-lookup and llama-speculative on the same models and prompts (on the CPU).

    python bench/speculative.py verify-cost [--presets llama-3.2-1b,llama-3.1-8b] [--mode q4]
    python bench/speculative.py verify-cost --artifacts ART...        # e.g. a GPU kit's CUDA artifacts
    python bench/speculative.py speed --target DIR --draft DIR [--mode f32] [--k 4] [--prompts 6]
                                      [--new-tokens 128] [--repeats 3] [--llama-cpp DIR]

verify-cost: the time of one step that computes k + 1 tokens of one sequence (a verify step) against
a one-token decode step, at a 256-token context: on a preset's shape compiled for this CPU with
seeded random weights (compiled --no-weights, then filled), or on the artifacts given, on their
device. Medians of 9 steps.

speed: TARGET and DRAFT are bench/train_small.py's (`--hidden 512 --layers 8 --draft DRAFT`), trained
together on one tokenizer. Two prompt sets from the held-out docstrings the training never saw, each run with n-gram guesses
and with the draft model:
  * grounded: a docstring, a blank line, then its first 12 tokens again, so that the continuation
    copies text the prompt holds (what summarising or editing a given text does);
  * free: the first 12 tokens of a docstring.
Greedy; each cell is the median over prompts of each prompt's median tok/s of --repeats runs
(decode only: from the first token to the last). kiln's speculative runs must give the plain run's
tokens, which is checked. llama.cpp (with --llama-cpp, a tree built as ../shared/PEERS.md says, with
the llama-lookup and llama-speculative targets): the same checkpoints as f32 or q8 GGUF files, the
same prompt text, --spec-draft-n-max k, the same thread count; its tok/s is what each tool prints for the
generated tokens.
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

from kiln.options import CompileOptions

GGUF_TYPES = {"f32": "f32", "q8": "q8_0", "bf16": "bf16"}
MODES = {"f32": ("float32", None), "bf16": ("bfloat16", None), "q8": ("float32", "q8"), "q4": ("float32", "q4")}


def compiled(model_dir: Path, out: Path, mode: str, weights: bool = True) -> Path:
    from kiln.compiler import compile_model
    if not (out / "manifest.json").exists():
        dtype, quant = MODES[mode]
        options = CompileOptions(target="cpu", dtype=dtype, quant=quant, weights=weights)
        compile_model(model_dir, out, options, show=None, force=True)
    return out


# -- verify cost ----------------------------------------------------------------------------------

def verify_cost(args) -> None:
    import numpy as np
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.step import SeqChunk, step_inputs
    work = Path(args.workdir) / "speculative"
    context, ks = 256, [0, 1, 2, 4, 8]
    artifacts = [Path(a) for a in args.artifacts or []]
    for preset in [] if artifacts else args.presets.split(","):
        from kiln.testing.tiny import PRESETS, make_config_only_model
        family, overrides = PRESETS[preset]
        model_dir = work / preset / "config"
        if not (model_dir / "config.json").exists():
            make_config_only_model(model_dir, family or "llama", **overrides)
        artifact = work / preset / f"artifact-{args.mode}"
        if not (artifact / "manifest.json").exists():
            compiled(model_dir, artifact, args.mode, weights=False)
            subprocess.run([sys.executable, "-m", "kiln.cli", "fill-weights", str(artifact)], check=True)
        artifacts.append(artifact)
    print(f"\nverify step (k + 1 tokens of one sequence at a {context}-token context) / one-token decode step; "
          f"{os.environ['TVM_NUM_THREADS']} CPU threads, median of 9")
    print("| artifact | device | 1-token step ms | " + " | ".join(f"k={k} ×" for k in ks[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(ks) - 1))
    for artifact in artifacts:
        model = CompiledModel(artifact, verify=False)
        pages = model.allocate_kv(((context + 16) // model.page_size + 2) * model.bytes_per_page)
        table = list(range(pages))
        ids = np.random.default_rng(0).integers(3, 1000, context + 16).tolist()
        p = model.page_size
        model.forward(step_inputs([SeqChunk(ids[:context], 0, table[:-(-context // p)],
                                            [table[t // p] * p + t % p for t in range(context)])], p))
        times = {}
        for k in ks:
            n = k + 1
            rows = range(context, context + n)
            chunk = SeqChunk(ids[context:context + n], context, table[:-(-(context + n) // p)],
                             [table[t // p] * p + t % p for t in rows], all_rows=bool(k))
            inputs = step_inputs([chunk], p)
            model.forward(inputs)
            samples = []
            for _ in range(9):
                t0 = time.perf_counter()
                model.forward(inputs)
                samples.append(time.perf_counter() - t0)
            times[k] = statistics.median(samples)
        name = f"{artifact.parent.name}/{artifact.name}"
        print(f"| {name} | {model.manifest.target.name} | {times[0] * 1e3:.2f} | "
              + " | ".join(f"{times[k] / times[0]:.2f}" for k in ks[1:]) + " |", flush=True)


# -- end to end -------------------------------------------------------------------------------------

def prompt_sets(target: Path, count: int, tokenizer) -> dict[str, list[str]]:
    docs = [d for d in json.loads((target / "heldout.json").read_text()) if len(tokenizer.encode(d)) >= 80]
    docs = docs[:count]

    def head(doc, n=12):
        return tokenizer.decode(tokenizer.encode(doc, add_special_tokens=False)[:n])
    return {"grounded": [f"{d[:1500]}\n\n{head(d)}" for d in docs], "free": [head(d) for d in docs]}


def kiln_rates(artifact: Path, prompts: list[str], speculative, new_tokens: int, repeats: int, k: int):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(artifact, kv_memory="256MiB", max_num_seqs=1, speculative=speculative, num_speculative_tokens=k)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)      # warm-up
    rates, tokens = [], []
    for prompt in prompts:
        runs = []
        for _ in range(repeats):
            [out] = llm.generate([prompt], params, use_tqdm=False)
            m = out.metrics
            runs.append((len(out.outputs[0].token_ids) - 1) / (m.finish_time - m.first_token_time))
        rates.append(statistics.median(runs))
        tokens.append(out.outputs[0].token_ids)
    stats = llm.engine.speculator.stats.as_dict() if llm.engine.speculator is not None else None
    return statistics.median(rates), tokens, stats


def gguf(model_dir: Path, llama_cpp: Path, mode: str) -> Path:
    """The checkpoint as a GGUF file. The converter does not know this locally trained tokenizer's
    hash; its pre-tokenizer is GPT-2's byte-level one, which the converter is told."""
    out = model_dir / f"model-{mode}.gguf"
    if out.exists():
        return out
    wrapper = ("import runpy, sys\n"
               f"sys.path[:0] = [{str(llama_cpp)!r}, {str(llama_cpp / 'gguf-py')!r}]\n"
               "import conversion.base\n"
               "conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
               f"sys.argv[0] = {str(llama_cpp / 'convert_hf_to_gguf.py')!r}\n"
               "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    f32 = model_dir / "model-f32.gguf"
    if not f32.exists():
        subprocess.run([sys.executable, "-c", wrapper, str(model_dir), "--outtype", "f32", "--outfile", str(f32)],
                       check=True)
    if mode != "f32":
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f32), str(out), GGUF_TYPES[mode]],
                       check=True, capture_output=True)
    return out


def llama_rate(cmd: list[str]) -> tuple[float, dict]:
    """Run a llama.cpp example; its decode tok/s and acceptance, from what it prints."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    speed = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    info = {"drafted": int(drafted.group(1)) if drafted else None,
            "accepted": int(accepted.group(1)) if accepted else None}
    if speed is None:
        raise SystemExit(f"no speed in the output of {cmd[0]}:\n{text[-3000:]}")
    return float(speed.group(3)), info


def llama_rates(llama_cpp: Path, target: Path, draft: Path | None, prompts: list[str], args) -> tuple[float, dict]:
    bin_dir = llama_cpp / "build" / "bin"
    rates, drafted, accepted = [], 0, 0
    for prompt in prompts:
        common = ["-m", str(target), "-p", prompt, "-n", str(args.new_tokens), "-t", str(args.threads), "--temp", "0",
                  "--spec-draft-n-max", str(args.k), "--ignore-eos", "-c", "2048"]
        cmd = ([str(bin_dir / "llama-speculative"), "-md", str(draft), "--spec-draft-n-min", "0", *common] if draft else
               [str(bin_dir / "llama-lookup"), *common])
        runs = [llama_rate(cmd) for _ in range(args.repeats)]
        rates.append(statistics.median(r for r, _ in runs))
        drafted += runs[-1][1]["drafted"] or 0
        accepted += runs[-1][1]["accepted"] or 0
    return statistics.median(rates), {"drafted": drafted, "accepted": accepted}


def llama_plain(llama_cpp: Path, target: Path, args) -> float:
    cmd = [str(llama_cpp / "build" / "bin" / "llama-bench"), "-m", str(target), "-p", "0", "-n",
           str(args.new_tokens), "-t", str(args.threads), "-r", str(args.repeats), "-o", "json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)[0]["avg_ts"]


def speed(args) -> None:
    from kiln.runtime.tokenizer import Tokenizer
    target_dir, draft_dir = Path(args.target), Path(args.draft)
    work = Path(args.workdir) / "speculative"
    target = compiled(target_dir, work / f"target-{args.mode}", args.mode)
    draft = compiled(draft_dir, work / f"draft-{args.mode}", args.mode)
    tokenizer = Tokenizer(target)
    sets = prompt_sets(target_dir, args.prompts, tokenizer)
    rows, plain = [], {}
    llama_cpp = Path(args.llama_cpp) if args.llama_cpp else None
    if llama_cpp:
        t_gguf, d_gguf = gguf(target_dir, llama_cpp, args.mode), gguf(draft_dir, llama_cpp, args.mode)
        llama_plain_rate = llama_plain(llama_cpp, t_gguf, args)
    for name, method in (("grounded", "ngram"), ("grounded", f"draft:{draft}"), ("free", "ngram"),
                         ("free", f"draft:{draft}")):
        prompts = sets[name]
        if name not in plain:
            plain[name] = kiln_rates(target, prompts, None, args.new_tokens, args.repeats, args.k)
        spec, spec_tokens, stats = kiln_rates(target, prompts, method, args.new_tokens, args.repeats, args.k)
        row = {"prompts": name, "method": method.split(":")[0], "plain": plain[name][0], "spec": spec,
               "same": spec_tokens == plain[name][1], "stats": stats}
        if llama_cpp:
            row["llama_plain"] = llama_plain_rate
            row["llama"], row["llama_stats"] = llama_rates(llama_cpp, t_gguf, d_gguf if method != "ngram" else None,
                                                           prompts, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nbatch 1, greedy, {args.mode}, k = {args.k}, {args.new_tokens} new tokens, {args.threads} threads; "
          f"median over {args.prompts} prompts of each one's median of {args.repeats}")
    head = "| prompts | method | kiln plain tok/s | kiln speculative tok/s | speedup | acceptance | tokens / verify step | same tokens |"
    if args.llama_cpp:
        head += " llama.cpp plain tok/s | llama.cpp speculative tok/s | its acceptance | kiln / llama.cpp |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        s = r["stats"]
        line = (f"| {r['prompts']} | {r['method']} | {r['plain']:.1f} | {r['spec']:.1f} | **{r['spec'] / r['plain']:.2f}x** | "
                f"{s['acceptance_rate']:.0%} | {s['mean_accepted_length']:.2f} | {'yes' if r['same'] else 'NO'} |")
        if args.llama_cpp:
            ls = r["llama_stats"]
            acc = f"{ls['accepted'] / ls['drafted']:.0%}" if ls["drafted"] else "–"
            line += f" {r['llama_plain']:.1f} | {r['llama']:.1f} | {acc} | **{r['spec'] / r['llama']:.2f}x** |"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify-cost")
    v.add_argument("--presets", default="llama-3.2-1b,llama-3.1-8b")
    v.add_argument("--mode", default="q4", choices=sorted(MODES))
    v.add_argument("--artifacts", nargs="*", help="measure these artifacts (any device) instead of the presets")
    s = sub.add_parser("speed")
    s.add_argument("--target", required=True)
    s.add_argument("--draft", required=True)
    s.add_argument("--mode", default="f32", choices=sorted(GGUF_TYPES))
    s.add_argument("--k", type=int, default=4)
    s.add_argument("--prompts", type=int, default=6)
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--llama-cpp", default=None)
    for p in (v, s):
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.runtime.threads import resolve_threads
    args.threads = resolve_threads(args.threads)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    verify_cost(args) if args.command == "verify-cost" else speed(args)


if __name__ == "__main__":
    main()
