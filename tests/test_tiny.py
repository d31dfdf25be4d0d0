"""kiln.testing.tiny: the locally trained tokenizer loads in transformers, and the random models are well conditioned."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.testing.tiny import SPECIAL_TOKENS, train_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_tokenizer_is_deterministic(tmp_path):
    train_tokenizer(tmp_path / "a")
    train_tokenizer(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()


def test_tokenizer_loads_in_transformers(make_model):
    tok = transformers.AutoTokenizer.from_pretrained(make_model("llama"))
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == 512 and (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    text = "def f(x):\n    return x  # naïve 🙂"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    for special in SPECIAL_TOKENS:              # each special token is one id
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special


def test_chat_template(make_model):
    tok = transformers.AutoTokenizer.from_pretrained(make_model("llama"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok(text, add_special_tokens=False).input_ids


def test_generation_config_stops_at_end_of_turn(make_model):
    gen = json.loads((make_model("llama") / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(make_model("llama"))
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]


@pytest.mark.parametrize("family", ["llama", "llama32", "qwen2"])
def test_logits_are_well_separated(make_model, family):
    """Random weights re-drawn so that greedy decoding is well conditioned (see kiln.testing.tiny)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(make_model(family)).float().eval()
    ids = torch.tensor(np.random.default_rng(0).integers(0, 512, (4, 32)))
    with torch.no_grad():
        logits = model(ids).logits                                    # [4, 32, vocab]
    top2 = logits.topk(2, -1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    assert 2.0 < logits.std(-1).mean() < 8.0
    assert (gap > 0.1).float().mean() > 0.8
    assert (logits.argmax(-1) == ids).float().mean() < 0.1             # no token just predicts itself
