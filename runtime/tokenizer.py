"""Tokenizer and chat template for the runtime, without transformers.

`Tokenizer` reads the files a Hugging Face model directory (or a kiln
artifact) carries: tokenizer.json, tokenizer_config.json, generation_config.json
and the chat template from wherever the checkpoint keeps it (chat_template.jinja,
tokenizer_config.json's "chat_template", or chat_template.json). It reproduces what transformers'
`AutoTokenizer` (the tokenizers-backed class) does with the same files:
encode, decode, and the chat template rendered in a sandboxed jinja2
environment. `IncrementalDetokenizer` turns a stream of generated ids into
text pieces that never split a UTF-8 character.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from kiln.errors import KilnError, NoChatTemplate

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A model's tokenizer, eos ids and chat template, loaded from its directory."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            hint = (" (only a SentencePiece tokenizer.model: `kiln compile` converts it)"
                    if (path / "tokenizer.model").is_file() else "")
            raise KilnError(f"no tokenizer.json in {path}{hint}")
        self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")

        # Special tokens the config names: bos/eos/unk/pad -> their strings (None when unset).
        self.special_tokens: dict[str, str | None] = {
            name: _token_str(config.get(name)) for name in _NAMED_SPECIALS}
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra = [_token_str(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        # As transformers does: named specials missing from tokenizer.json's added tokens are
        # added as special (skip_special_tokens drops them; the pre-tokenizer never splits them).
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [t for t in [*self.special_tokens.values(), *extra] if t and t not in added]
        if missing:
            self._tok.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in missing])

        # tokenizer.json's post-processor alone decides whether bos/eos are added; transformers
        # (v5) likewise ignores tokenizer_config's add_bos_token/add_eos_token when tokenizer.json
        # exists. A rendered chat template already holds bos: encode it with
        # add_special_tokens=False, as transformers' apply_chat_template(tokenize=True) does.
        bos_id = self.token_to_id(self.bos_token)
        self.adds_bos = bos_id is not None and self._tok.encode("").ids[:1] == [bos_id]

        # The cleanup transformers applies on decode is skipped for BPE models, as it does.
        self._byte_level: bool | None = None         # the decoder maps bytes to characters (token_bytes)
        self._clean_up_spaces = (bool(config.get("clean_up_tokenization_spaces", False))
                                 and type(self._tok.model).__name__ != "BPE")

        self.eos_token_ids: set[int] = set()
        if (eos := self.token_to_id(self.special_tokens["eos_token"])) is not None:
            self.eos_token_ids.add(eos)
        gen_eos = gen_config.get("eos_token_id")
        self.eos_token_ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])

        self.chat_template: str | None = _find_template(path, config)
        self._compiled_template: jinja2.Template | None = None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token as tokenizer.json spells it (added tokens too) -> its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def special_ids(self) -> set[int]:
        """The added tokens marked special (bos, eos, pads, chat markers): not text."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def backend_json(self) -> str:
        """tokenizer.json as the tokenizers library holds it (with the specials added on load)."""
        return self._tok.to_str()

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def decode_raw(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decode without the optional space cleanup; what the incremental detokenizer diffs."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token `token` stands for, as OpenAI's logprobs `bytes` give them: a byte-level
        BPE token that holds part of a UTF-8 character is that part, not U+FFFD; a byte-fallback
        token <0xNN> is the byte NN."""
        piece = self._tok.id_to_token(token)
        if piece is None:
            return b""
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self._byte_level is None:
            self._byte_level = _uses_byte_level(json.loads(self._tok.to_str()).get("decoder"))
        special = token in self._tok.get_added_tokens_decoder()
        if self._byte_level and not special and all(ch in _UNICODE_TO_BYTE for ch in piece):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        return self.decode_raw([token], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages with the model's chat template; kwargs (tools=...) reach the template."""
        if self.chat_template is None:
            raise NoChatTemplate("this model has no chat template (none in chat_template.jinja, "
                                 "tokenizer_config.json or chat_template.json); send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _jinja_env().from_string(self.chat_template)
        names = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables = {"tools": None, "documents": None, **names, **kwargs}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def _byte_characters() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, every other
    byte for the character 256 + its rank among those others."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_UNICODE_TO_BYTE = _byte_characters()


def _uses_byte_level(decoder) -> bool:
    """Whether tokenizer.json's decoder (or one in its sequence) is ByteLevel."""
    if not isinstance(decoder, dict):
        return False
    return decoder.get("type") == "ByteLevel" or any(_uses_byte_level(d) for d in decoder.get("decoders") or [])


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text pieces that never split a character.

    Prefix-offset scheme (as in vLLM): keep a short window of recent ids whose
    first `read` are already emitted; decode window[:read] and the whole window,
    emit the difference, then slide the window to start at `read`. Each step
    decodes only a few tokens. A piece is held back while the decoded tail ends
    in U+FFFD (an incomplete UTF-8 sequence). Invariant: the window starts where
    the text so far ended on a whole character, so the pieces plus `flush()`
    concatenate to `decode(ids)` (or, with `prompt_ids`, to the text the ids add
    after the prompt). Not applied here: the WordPiece-only space cleanup.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = (), context: int = 5):
        # A few prompt ids give the first generated token its left context, so decoders that
        # strip a leading space at the start of a decode (SentencePiece) keep it mid-text.
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-context:]) if context > 0 else []  # the window
        self._read = len(self._ids)  # window ids before this are already emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode_raw(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly printable text (often '')."""
        self._ids.append(int(token_id))
        return self._step(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        del self._ids[:self._read]  # slide: the new window starts at the old read offset
        self._read = len(self._ids)
        return text[len(prefix_text):]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _find_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template, looked up as transformers does: chat_template.jinja wins over
    tokenizer_config.json's entry; chat_template.json (a processor's file) is the last resort."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (template := _pick_template(config.get("chat_template"))) is not None:
        return template
    return _pick_template(_read_json(path / "chat_template.json").get("chat_template"))


def _pick_template(value: Any) -> str | None:
    """tokenizer_config.json holds one template, or a list of {name, template}: use "default"."""
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default")
    return value


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Like transformers: jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
