"""A GGUF file's tokenizer, as kiln writes it into an artifact, gives llama.cpp's token ids: llama.cpp's
own tokenizer test vectors (models/ggml-vocab-*.gguf with their .inp texts and the .out ids llama.cpp
produced: code, Unicode, numbers, runs of whitespace) for the vocabularies of the families kiln compiles."""
from __future__ import annotations

import pytest
from gguf_files import llama_cpp_tree

pytest.importorskip("transformers")

from kiln.frontend.gguf_file import read_metadata  # noqa: E402
from kiln.frontend.gguf_tokenizer import write_gguf_tokenizer  # noqa: E402
from kiln.runtime.tokenizer import Tokenizer  # noqa: E402

# The vocabularies of the families kiln imports from GGUF (SentencePiece: Llama 2 / Mistral, Phi-3;
# byte-level BPE: Llama 3, Qwen, GPT-2's, and StarCoder's, whose pre-tokenizer SmolLM's shares), and the
# texts (by their first characters) where llama.cpp's tokenizer and HF's tokenizers library split
# differently: llama.cpp's Llama 3 split keeps 'ửa' whole where the regex engine cuts it at the combining
# mark. (The DeepSeek and Command-R vocabularies differ on '½' too: a number to llama.cpp's Unicode
# tables, not to Oniguruma's.)
KNOWN_DIFFERENCES = {"llama-spm": set(), "llama-bpe": {"Cửa Việt"}, "qwen2": set(), "phi-3": set(), "gpt-2": set(),
                     "starcoder": set()}       # digits split off first, as SmolLM's


@pytest.mark.parametrize("vocab", sorted(KNOWN_DIFFERENCES))
def test_token_ids_equal_llama_cpp(vocab, tmp_path):
    path = llama_cpp_tree() / "models" / f"ggml-vocab-{vocab}.gguf"
    write_gguf_tokenizer(path, read_metadata(path), tmp_path)
    tok = Tokenizer(tmp_path)
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    wanted = path.with_name(path.name + ".out").read_text(encoding="utf-8").strip("\n").split("\n")
    assert len(wanted) >= 40
    differ = set()
    for text, ids in zip(texts, wanted):
        if tok.encode(text, add_special_tokens=False) != [int(i) for i in ids.split()]:
            differ.add(text[:14])
    assert differ == KNOWN_DIFFERENCES[vocab]
