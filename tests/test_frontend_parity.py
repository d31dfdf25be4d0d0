"""The HF frontend against transformers: the interpreted kiln graph gives the same logits.

Tiny random models of each family (kiln.testing.tiny), fp32, eager attention in
transformers; KV pages that are non-contiguous and shared by a ragged batch.
"""
from __future__ import annotations

import numpy as np
import pytest

from kiln.testing.tiny import FAMILIES
from paging import kv_pages_for, make_step_inputs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kiln.frontend import load_hf_model  # noqa: E402
from kiln.ir import interpret, verify, weight_loader  # noqa: E402

PAGE_SIZE = 16
NUM_PAGES = 8
TOL = 1e-4


class Pair:
    """One model twice: kiln's graph run by the interpreter, and transformers' module."""

    def __init__(self, model_dir):
        self.kiln = load_hf_model(model_dir)
        self.graph = verify(self.kiln.build_graph("float32", page_size=PAGE_SIZE))
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="eager").float().eval()
        self.weights = weight_loader(self.graph, lambda name: self.kiln.weight(name, "float32"))
        self.vocab = self.kiln.config.vocab_size
        self.new_cache()

    def new_cache(self):
        """A fresh pool whose slots hold NaN until written: reading an unwritten slot fails the test."""
        self.kv = kv_pages_for(self.graph.kv_specs, NUM_PAGES, fill=np.nan)

    def step(self, seqs) -> np.ndarray:
        """Run one engine step over self.kv (updated in place); f32[seqs, vocab]."""
        inputs = {**make_step_inputs(seqs, PAGE_SIZE), **self.kv}
        return interpret(self.graph, inputs, self.weights)["logits"]

    def hf_last_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0, -1].numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_pair(request, make_model):
    return Pair(make_model(request.param))


@pytest.fixture
def pair(model_pair):
    model_pair.new_cache()
    return model_pair


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str):
    assert ours.shape == ref.shape, what
    err = float(np.abs(ours - ref).max())
    assert err <= TOL, f"{what}: max |kiln - transformers| = {err:.3g} > {TOL}"


def test_prefill_then_decode(pair):
    pages = [5, 2, 7]                               # out of order, in a pool of 8
    ids = prompt(37, seed=0, vocab=pair.vocab)
    logits = pair.step([(ids, 0, pages)])
    assert logits.shape == (1, pair.vocab) and logits.dtype == np.float32
    assert_close(logits[0], pair.hf_last_logits(ids), "prefill of 37 tokens")
    for i in range(3):
        ids.append(int(logits[0].argmax()))
        logits = pair.step([(ids[-1:], len(ids) - 1, pages)])
        assert_close(logits[0], pair.hf_last_logits(ids), f"decode step {i + 1}")


def test_ragged_batch(pair):
    seqs = [(prompt(n, seed=n, vocab=pair.vocab), 0, pages)
            for n, pages in ((5, [3]), (23, [0, 6]), (40, [7, 1, 4]))]
    logits = pair.step(seqs)
    assert logits.shape == (3, pair.vocab)
    for row, (ids, _, _) in enumerate(seqs):
        assert_close(logits[row], pair.hf_last_logits(ids), f"sequence of {len(ids)} tokens")


def test_chunked_prefill_mixed_with_decode(pair):
    """A prefill split in two chunks, the second sharing a step with another sequence's decode."""
    long, short = prompt(30, seed=1, vocab=pair.vocab), prompt(9, seed=2, vocab=pair.vocab)
    long_pages, short_pages = [6, 0], [4]
    pair.step([(long[:12], 0, long_pages), (short, 0, short_pages)])
    short.append(7)
    logits = pair.step([(short[-1:], len(short) - 1, short_pages), (long[12:], 12, long_pages)])
    assert_close(logits[0], pair.hf_last_logits(short), "decode next to a prefill chunk")
    assert_close(logits[1], pair.hf_last_logits(long), "second prefill chunk")


def test_gemma3_soft_caps_its_logits_but_not_its_scores(tmp_path):
    """Gemma 3's config has attn_logit_softcapping, which transformers' Gemma 3 attention never
    applies; final_logit_softcapping it does. Caps small enough to matter at this size."""
    from kiln.testing.tiny import make_tiny_model
    model_dir = make_tiny_model(tmp_path / "gemma3", "gemma3", attn_logit_softcapping=0.5, final_logit_softcapping=2.0)
    pair = Pair(model_dir)
    assert pair.kiln.config.attn_softcap is None and pair.kiln.config.final_softcap == 2.0
    ids = prompt(21, seed=9, vocab=pair.vocab)
    assert_close(pair.step([(ids, 0, [3, 1])])[0], pair.hf_last_logits(ids), "prefill of 21 tokens")
