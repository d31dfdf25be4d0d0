"""The transformers side of the parity tests: logits and greedy tokens of an HF model on given ids."""
from __future__ import annotations

import numpy as np
import torch


def random_prompt(n: int, seed: int, low: int = 3, high: int = 500) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, n).tolist()


def hf_last_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float().numpy()


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    """Exactly `new_tokens` greedy tokens (eos does not stop it)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_greedy_uncached(hf, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from full forwards over the whole sequence, no KV cache: the model's own
    definition. (transformers 5.23's cached `generate` leaves it on a Qwen2 with full and sliding
    layers: its sliding cache gives other tokens after a few decode steps.)"""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(new_tokens):
            out.append(int(hf(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            seq.append(out[-1])
    return out


def last_logit_cosines(hf, compiled, prompts: int = 8) -> list[float]:
    """Cosine between a compiled model's last-token logits and transformers' over random prompts."""
    from paging import make_step_inputs
    cosines = []
    for seed in range(prompts):
        ids = random_prompt(20 + seed, 100 + seed)
        got = compiled.forward(make_step_inputs([(ids, 0, [seed, 9])], compiled.page_size))[0]
        ref = hf_last_logits(hf, ids)
        cosines.append(float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref)))
    return cosines
