"""Perplexity on real English text, scored as llama.cpp's `llama-perplexity` scores it, for kiln's
artifacts and transformers' models alike (tests and benchmarks compare the two, and llama.cpp).

The text is Python's standard-library docstrings (kiln.testing.tiny.corpus: offline, the same on every
machine). Its tokens are cut into chunks of `n_ctx`, each evaluated on its own from an empty cache; in
each chunk the second half's tokens are scored (each given all before it in the chunk), as llama.cpp
does so that every scored token has at least n_ctx / 2 of context."""
from __future__ import annotations

import math

import numpy as np


def english_text(chars: int = 200_000) -> str:
    from .tiny import corpus
    return "\n\n".join(corpus())[:chars]


def calibration_text(chars: int = 100_000) -> str:
    """Text to calibrate quantisers on: the same docstrings' last `chars` characters, none of which
    english_text's first 200,000 holds (the corpus has some 476,000)."""
    from .tiny import corpus
    text = "\n\n".join(corpus())
    if len(text) < 200_000 + chars:
        raise ValueError(f"the corpus has {len(text)} characters: too few to keep calibration apart")
    return text[-chars:]


def chunks_of(ids: list[int], n_ctx: int, count: int, bos: int | None = None) -> list[list[int]]:
    """The first `count` chunks of n_ctx tokens; with `bos`, each chunk's first token is BOS (llama.cpp
    puts it there when the vocabulary adds one)."""
    chunks = [ids[i * n_ctx:(i + 1) * n_ctx] for i in range(min(count, len(ids) // n_ctx))]
    return [[bos, *c[1:]] if bos is not None else c for c in chunks]


def scored(n_ctx: int) -> range:
    """The positions of a chunk whose tokens are scored."""
    return range(n_ctx // 2 + 1, n_ctx)


def from_logprobs(per_chunk: list[list[float]]) -> float:
    values = [v for chunk in per_chunk for v in chunk]
    return math.exp(-sum(values) / len(values))


def kiln_perplexity(artifact, chunks: list[list[int]]) -> float:
    """Perplexity through kiln's engine: each chunk a prompt whose tokens' log-probabilities it returns."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(str(artifact), max_num_seqs=len(chunks), size_kv_for=len(chunks[0]) + 1)
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    return from_logprobs([[out.prompt_logprobs[t][ids[t]] for t in scored(len(ids))]
                          for out, ids in zip(outs, chunks)])


def torch_perplexity(model, chunks: list[list[int]]) -> float:
    """The same for a transformers causal LM (float32 logits, one chunk at a time)."""
    import torch
    per_chunk = []
    with torch.no_grad():
        for ids in chunks:
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
            z = logits - logits.max(-1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
            per_chunk.append([float(logp[t - 1, ids[t]]) for t in scored(len(ids))])
    return from_logprobs(per_chunk)
