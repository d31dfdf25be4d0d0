"""Quantisation error of compiled artifacts against the float32 artifact (which matches
transformers to 1e-4).

    python bench/quant_error.py [--preset llama-3.2-1b] [--prompts 32]        random weights
    python bench/quant_error.py --model DIR [--prompts 32] [--tokens 96]     a trained model

Random weights: the last-token logits of N random prompts. A trained model (bench/train_small.py,
whose DIR/heldout.json holds text it never saw): every next-token prediction over the first
--tokens tokens of N held-out documents, teacher-forced one decode step at a time with all
documents batched; that adds each mode's held-out perplexity.
Prints cosine similarity (min, mean), max relative error (|diff| / max |ref|) and top-1 agreement
per mode. A weight quant quantises the embedding table too (kiln's default); the "+ float embedding"
modes keep it float (--no-quant-embedding), to show what quantising it costs.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from kiln.options import CompileOptions

# mode -> (weight quant, group size, KV cache dtype, quantised embedding, int8 activations); with a
# weight quant the embedding is quantised too (kiln's default) unless the mode says "float
# embedding", and q8/q4 linears take int8 activations where the CPU has the kernel (kiln's default)
# unless the mode says "float activations"
MODES = {"q8": ("q8", 32, None, True, None), "q8 + float embedding": ("q8", 32, None, False, None),
         "q8 + float activations": ("q8", 32, None, True, False),
         "q4 g32": ("q4", 32, None, True, None), "q4 g32 + float embedding": ("q4", 32, None, False, None),
         "q4 g32 + float activations": ("q4", 32, None, True, False),
         "q4 g128": ("q4", 128, None, True, None), "fp8": ("fp8", 32, None, True, None),
         "kv int8": (None, 32, "int8", True, None), "kv fp8": (None, 32, "fp8", True, None),
         "q4 g32 + kv int8": ("q4", 32, "int8", True, None)}


def open_model(artifact: Path, max_tokens: int, seqs: int):
    from kiln.runtime.model import CompiledModel
    from kiln.runtime.threads import set_threads
    set_threads()                       # $TVM_NUM_THREADS, else every core (as kiln.LLM)
    model = CompiledModel(artifact, verify=False)
    model.allocate_kv(seqs * -(-max_tokens // model.page_size) * model.bytes_per_page)
    return model


def last_logits(artifact: Path, prompts: list[list[int]]) -> np.ndarray:
    """[prompts, vocab]: the logits after each prompt, each prefilled alone."""
    from kiln.runtime.step import SeqChunk, step_inputs
    model = open_model(artifact, max(map(len, prompts)), 1)
    out = []
    for ids in prompts:
        pages = list(range(-(-len(ids) // model.page_size)))
        slots = [pages[t // model.page_size] * model.page_size + t % model.page_size for t in range(len(ids))]
        out.append(model.forward(step_inputs([SeqChunk(ids, 0, pages, slots)], model.page_size))[0])
    return np.stack(out)


def teacher_forced_logits(artifact: Path, docs: list[list[int]]) -> np.ndarray:
    """[docs, tokens - 1, vocab]: the logits predicting token t + 1 of each document, one batched
    decode step per position (so every mode reads its own quantised KV cache)."""
    from kiln.runtime.kv_pool import BlockTable, PagePool
    from kiln.runtime.step import SeqChunk, step_inputs
    length = len(docs[0])
    model = open_model(artifact, length, len(docs))
    pool = PagePool(len(docs) * -(-length // model.page_size), model.page_size)
    tables = [BlockTable() for _ in docs]
    steps = []
    for t in range(length - 1):
        chunks = [SeqChunk([d[t]], t, table.pages, pool.grow(table, 1)[0]) for d, table in zip(docs, tables)]
        steps.append(model.forward(step_inputs(chunks, model.page_size)))
    return np.stack(steps, axis=1)


def compare(got: np.ndarray, ref: np.ndarray) -> dict:
    got, ref = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    return {"cos_min": cos.min(), "cos_mean": cos.mean(), "rel": (np.abs(got - ref).max(1) / np.abs(ref).max(1)).max(),
            "top1": (got.argmax(1) == ref.argmax(1)).mean()}


def perplexity(logits: np.ndarray, docs: list[list[int]]) -> float:
    targets = np.array([d[1:] for d in docs])
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return math.exp(-np.take_along_axis(logp, targets[..., None], -1).mean())


def _activation_block(artifact: Path):
    return json.loads((artifact / "manifest.json").read_text())["quantization"].get("activation_block")


def _expected_block(quant, int8_activations) -> int:
    from kiln.targets import target_defaults
    default = target_defaults("cpu").activation_block
    return default if quant in ("q8", "q4") and int8_activations is not False else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--model", type=Path, default=None, help="a trained model dir (bench/train_small.py)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96, help="trained model: tokens per held-out document")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workdir", default="build/bench")
    args = ap.parse_args()
    from kiln.compiler import compile_model
    trained = args.model is not None
    if trained:
        from tokenizers import Tokenizer
        model_dir, work = args.model, Path(args.workdir) / args.model.name
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        encoded = [tok.encode(d).ids for d in json.loads((model_dir / "heldout.json").read_text())]
        docs = [ids[:args.tokens] for ids in encoded if len(ids) >= args.tokens][:args.prompts]
        run = lambda path: teacher_forced_logits(path, docs)   # noqa: E731
        what = f"{len(docs)} held-out documents, every next-token prediction over their first {args.tokens} tokens"
    else:
        from kiln.testing.tiny import preset_model
        work = Path(args.workdir) / args.preset
        model_dir = preset_model(args.preset, work / "model")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 500, int(rng.integers(8, 40))).tolist() for _ in range(args.prompts)]
        run = lambda path: last_logits(path, prompts)            # noqa: E731
        what = f"last-token logits of {args.prompts} random prompts of 8-39 tokens"
    modes = {"f32": (None, 32, None, True, None), **{m: MODES[m] for m in args.modes.split(",")}}
    logits = {}
    for mode, (quant, group, kv, quant_embedding, int8_activations) in modes.items():
        path = work / f"artifact-{mode.replace(' + ', '-').replace(' ', '-')}"
        # an artifact compiled before int8 activations existed (or with other ones) is rebuilt
        if not (path / "manifest.json").exists() or _activation_block(path) != _expected_block(quant, int8_activations):
            options = CompileOptions(target="cpu", quant=quant, group_size=group, kv_dtype=kv,
                                     quant_embedding=quant_embedding, int8_activations=int8_activations)
            compile_model(model_dir, path, options, show=None, force=True)
        logits[mode] = run(path)
    ref = logits["f32"]
    print(f"\n{model_dir.name}: logits against the float32 artifact; {what}")
    print("| mode | cosine min | cosine mean | max relative error | top-1 agreement |"
          + (" held-out perplexity |" if trained else "") + "\n|---|---|---|---|---|" + ("---|" if trained else ""))
    for mode, got in logits.items():
        c = compare(got, ref)
        print(f"| {mode} | {c['cos_min']:.4f} | {c['cos_mean']:.4f} | {c['rel']:.3f} | {c['top1']:.1%} |"
              + (f" {perplexity(got, docs):.2f} |" if trained else ""))


if __name__ == "__main__":
    main()
