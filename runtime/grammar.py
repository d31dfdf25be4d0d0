"""Structured output: what a constrained sequence may generate, as a grammar xgrammar compiles.

A request names its constraint with a `GrammarSpec`: a JSON schema, any JSON object, a regex, one
of a list of strings, an EBNF grammar, or an xgrammar structural tag (what tool calls compile to,
serve/tool_calls.py). `Grammars` compiles each spec once against the model's
vocabulary (cached by spec) and hands each constrained sequence a `TokenMatcher`: before a draw it
gives the tokens that keep the output a prefix of the language, after it accepts the drawn token.
The sampler masks the others to -inf (runtime/sampler.py), so what a sequence generates always
parses, whatever the weights.

xgrammar 0.2.8 imports torch and transformers when it loads (its matcher and Hugging Face helpers
do), so it is imported on the first constrained request only: an engine that serves none never
loads them (`kiln run` and `kiln serve` keep torch out of their process until then). It is the
`grammar` extra (pyproject.toml).
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import ParamError

CACHED_GRAMMARS = 256      # compiled grammars an engine keeps (least recently used go first)
KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")
# A JSON string's characters as xgrammar 0.2.8 writes them in EBNF: a length-bounded string's
# class lets raw control characters in, which JSON forbids, and neither keeps out UTF-8-encoded
# surrogates (U+D800-U+DFFF), which are no characters: decoded, each becomes three U+FFFD, and a
# maxLength the grammar counted is broken. Compiled grammars take the class below instead.
XGRAMMAR_STRING_CHARACTERS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\0-\x1f]')
JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


@dataclass(frozen=True)
class GrammarSpec:
    kind: str                  # one of KINDS
    source: str = ""           # the schema's JSON text, the regex, the EBNF, the choices or structural tag as JSON
    param: str = field(default="structured_outputs", compare=False)   # the request field, named in errors

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ParamError(self.param, f"unknown constraint {self.kind!r} (one of {', '.join(KINDS)})")

    @staticmethod
    def choice(options: list[str], param: str = "structured_outputs") -> "GrammarSpec":
        if not options or not all(isinstance(o, str) for o in options):
            raise ParamError(param, "choice needs a non-empty list of strings")
        return GrammarSpec("choice", json.dumps(options), param)


def _xgrammar(param: str = "response_format"):
    if "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]         # `kiln run` and `kiln serve` keep torch out until xgrammar needs it
    try:
        import xgrammar
    except ImportError as e:
        raise ParamError(param, f"structured output needs xgrammar (pip install 'kiln[grammar]'): {e}") from None
    return xgrammar


def _json_strings(ebnf: str) -> str:
    for written in XGRAMMAR_STRING_CHARACTERS:
        ebnf = ebnf.replace(written, JSON_STRING_CHARACTER)
    return ebnf


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar reads JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _reason(error: Exception) -> str:
    """xgrammar's message without its log prefix ("[hh:mm:ss] file.cc:83: ")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1])


class Grammars:
    """The compiled grammars of one engine's vocabulary, by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler = None
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()     # least recently used first
        self._lock = threading.Lock()          # the server checks requests off the engine's thread
        self.compile_seconds: dict[GrammarSpec, float] = {}
        # special tokens other than the stop tokens are not text: no grammar's output holds one
        self.barred = np.array(sorted(i for i in tokenizer.special_ids() if i not in self.stop_ids and i < vocab_size),
                               np.int64)

    def tokenizer_info(self):
        """xgrammar's view of the vocabulary: each id's token as tokenizer.json spells it, and how
        those spellings encode bytes (byte-level, byte fallback or raw), read from the same file."""
        xgr = _xgrammar()
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(self.tokenizer.backend_json())
        encoded = [""] * self.vocab_size
        for token, index in self.tokenizer.vocab().items():
            if index < self.vocab_size:
                encoded[index] = token
        return xgr.TokenizerInfo(encoded, metadata["vocab_type"], vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_ids or None, add_prefix_space=metadata["add_prefix_space"])

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec`, compiled on first use; a ParamError naming the request's
        field when xgrammar cannot compile it."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            if self._compiler is None:
                self._compiler = _xgrammar(spec.param).GrammarCompiler(self.tokenizer_info())
            t0 = time.perf_counter()
            try:
                compiled = self._compile(spec)
            except (RuntimeError, ValueError, TypeError) as e:
                raise ParamError(spec.param, f"cannot compile the {spec.kind.replace('_', ' ')}: {_reason(e)}") \
                    from None
            self.compile_seconds[spec] = time.perf_counter() - t0
            self._compiled[spec] = compiled
            if len(self._compiled) > CACHED_GRAMMARS:          # a server sees schemas without end
                evicted, _ = self._compiled.popitem(last=False)
                self.compile_seconds.pop(evicted, None)
            return compiled

    def _compile(self, spec: GrammarSpec):
        c = self._compiler
        grammar = _xgrammar().Grammar
        if spec.kind == "json_object":                  # an object, as OpenAI's json_object mode promises
            return c.compile_grammar(_json_strings(str(grammar.from_json_schema('{"type": "object"}',
                                                                               any_whitespace=False))))
        if spec.kind == "json_schema":
            try:
                json.loads(spec.source)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not JSON: {e}") from None
            return c.compile_grammar(_json_strings(str(grammar.from_json_schema(spec.source, any_whitespace=False))))
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "structural_tag":
            return c.compile_grammar(_json_strings(str(grammar.from_structural_tag(spec.source))))
        if spec.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(o) for o in json.loads(spec.source)))
        return c.compile_grammar(spec.source)

    def matcher(self, spec: GrammarSpec) -> "TokenMatcher":
        return TokenMatcher(self.compile(spec), self.vocab_size, self.barred)


class TokenMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, compiled, vocab_size: int, barred: np.ndarray):
        self.compiled, self.vocab_size, self.barred = compiled, vocab_size, barred
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        self._bits = np.zeros((1, (vocab_size + 31) // 32), np.int32)
        self.stop_ids = np.array([i for i in self._matcher.stop_token_ids if i < vocab_size], np.int64)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that may come next (never a barred one)."""
        if self._matcher.fill_next_token_bitmask(self._bits):
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        else:
            mask = np.ones(self.vocab_size, bool)
        mask[self.barred] = False
        return mask

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and no move) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The output is complete and its stop token accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())

    @property
    def completed(self) -> bool:
        """The output so far is a whole sentence of the grammar (more may follow it, or not)."""
        return bool(self._matcher.is_completed())

    def only_stops(self, allowed: np.ndarray) -> bool:
        """Whether `allowed` (this matcher's mask now) lets nothing but a stop token come next."""
        others = allowed.copy()
        others[self.stop_ids] = False
        return not others.any()

    def fresh(self) -> "TokenMatcher":
        """A matcher of the same grammar at its start (another sample of the request)."""
        return TokenMatcher(self.compiled, self.vocab_size, self.barred)
