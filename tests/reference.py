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
