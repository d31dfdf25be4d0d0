"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as the artifact's tokenizer.json, tokenizer_config.json,
generation_config.json and chat_template.jinja: what the runtime reads for an HF model.

The vocabulary becomes a `tokenizers` model through transformers' GGUF converter (BPE with merges for
`gpt2` vocabularies, with the pre-tokenizer split llama.cpp's `tokenizer.ggml.pre` names; SentencePiece
BPE from the scores for `llama` ones). Two things are set here to do what llama.cpp does with the file:
  - a SentencePiece vocabulary with add_space_prefix (its default) gets a space before the text, always,
    and spaces become ▁ (llama.cpp's tokenizer; the converter's Metaspace skips the prefix before a space);
  - byte-level vocabularies whose `tokenizer.ggml.pre` splits digits off first (SmolLM's, StarCoder's)
    get that split, which the converter leaves out;
  - BOS (and EOS) are added as `tokenizer.ggml.add_bos_token` says (by default for SentencePiece only),
    and generation ends at EOS and at the end-of-turn tokens the file names (eot, eom)."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import KilnError

END_TOKENS = ("eos_token_id", "eot_token_id", "eom_token_id")
# llama.cpp's pre-tokenizers that split every digit off before GPT-2's split (llama-vocab.cpp), which
# transformers' converter does not set (it knows Llama 3's, Qwen's, ... splits, not these)
DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "mellum2")


def _backend(path: Path, metadata: dict):
    """The converter's tokenizer, from the metadata kiln has read (its own GGUF reader would read the file
    again), grouped as transformers' GGUF tokenizer mapping names the keys."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:
        raise KilnError(f"{path}: reading a GGUF tokenizer needs transformers >= 5 (the `import` extra): {e}") from None
    vocab = {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
             if f"tokenizer.{key}" in metadata}
    try:
        return convert_gguf_tokenizer(metadata.get("general.architecture", ""), vocab)[0], vocab
    except (ValueError, KeyError) as e:
        raise KilnError(f"{path}: cannot build its tokenizer ({str(e).splitlines()[0]})") from None


def _space_prefix(tok) -> None:
    from tokenizers import normalizers
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None


def _digits_first(tok) -> None:
    from tokenizers import Regex, pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _special_ends(tok, metadata: dict, add_bos: bool, add_eos: bool) -> None:
    from tokenizers import processors
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def named(key):
        i = metadata.get(f"tokenizer.ggml.{key}")
        return (tokens[i], i) if i is not None and 0 <= i < len(tokens) else None
    bos, eos = named("bos_token_id"), named("eos_token_id")
    front = [bos] if add_bos and bos else []
    back = [eos] if add_eos and eos else []
    single = " ".join([*(t for t, _ in front), "$A", *(t for t, _ in back)])
    pair = " ".join([*(t for t, _ in front), "$A", *(t for t, _ in back), "$B:1", *(t for t, _ in back)])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[*front, *back])


def write_gguf_tokenizer(path: Path, metadata: dict, out_dir: Path) -> list[str]:
    """Write the tokenizer files of the GGUF model at `path` into `out_dir`; return their names."""
    if "tokenizer.ggml.tokens" not in metadata:
        raise KilnError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
    tok, vocab = _backend(path, metadata)
    spm = vocab.get("tokenizer_type") == "llama"
    if spm and metadata.get("tokenizer.ggml.add_space_prefix", True) and metadata.get("general.architecture") not in (
            "gemma2", "gemma3", "phi3"):       # their converters already spell the prefix as the model does
        _space_prefix(tok)
    if vocab.get("tokenizer_type") == "gpt2" and vocab.get("pre_tokenizer_type") in DIGITS_FIRST:
        _digits_first(tok)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", spm))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _special_ends(tok, metadata, add_bos, add_eos)
    tok.save(str(out_dir / "tokenizer.json"))
    names = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    tokens = metadata["tokenizer.ggml.tokens"]
    specials = {f"{name}_token": tokens[metadata[f"tokenizer.ggml.{key}"]]
                for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                                  ("pad", "padding_token_id"))
                if 0 <= metadata.get(f"tokenizer.ggml.{key}", -1) < len(tokens)}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": add_bos, "add_eos_token": add_eos,
         "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    ends = sorted({metadata[f"tokenizer.ggml.{k}"] for k in END_TOKENS if f"tokenizer.ggml.{k}" in metadata})
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"), "eos_token_id": ends}, indent=2) + "\n")
    template = metadata.get("tokenizer.chat_template")
    if template:
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
        names.append("chat_template.jinja")
    return sorted(names)
