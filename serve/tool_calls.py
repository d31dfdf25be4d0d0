"""Tool calling: OpenAI's `tools` over each model family's own tool-call syntax.

A family's format says how the model writes a call; the parser reads calls back out of the text,
and for `tool_choice` "required" or a named function the same format becomes a structural tag
(xgrammar's, compiled as a GrammarSpec) that lets the output be nothing but well-formed calls whose
arguments validate against the function's parameters.

  hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Hermes, Qwen 2.5/3)
  llama3_json  {"name": "f", "parameters": {...}}, several joined by "; "      (Llama 3.1-3.3)
  mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           (also [TOOL_CALLS]f[ARGS]{...})
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...

`kiln serve --tool-call-parser NAME` picks one; otherwise the chat template's own markers decide.
A model whose template shows none still takes a required or named tool_choice, as vLLM's does: its
reply is JSON (`json_calls`), an array of {"name": ..., "parameters": {...}} calls, or for a named
function that function's arguments object.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from kiln.runtime.grammar import GrammarSpec


@dataclass(frozen=True)
class ToolFormat:
    name: str
    begin: str                  # before a call's function name
    middle: str                 # between the name and the arguments
    end: str                    # after the arguments
    separator: str              # between calls
    opening: str = ""           # before the first call
    closing: str = ""           # after the last
    markers: tuple[str, ...] = ()     # what in a chat template shows this format
    special: bool = False       # its markers are special tokens: the text keeps them
    named: str | None = None    # "json" only: the function a named tool_choice forces (the reply is its arguments)

    @property
    def start(self) -> str:
        """What a reply's tool calls open with."""
        return self.opening or self.begin


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n",
               markers=("<tool_call>",)),
    ToolFormat("mistral", '{"name": "', '", "arguments": ', "}", ", ", opening="[TOOL_CALLS][", closing="]",
               markers=("[TOOL_CALLS]",), special=True),
    ToolFormat("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>",
               "\n", opening="<｜tool▁calls▁begin｜>", closing="<｜tool▁calls▁end｜>",
               markers=("<｜tool▁calls▁begin｜>",), special=True),
    ToolFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ", markers=("<|python_tag|>",),
               special=True),
)}
JSON = ToolFormat("json", "", "", "", "")      # json_calls; not in FORMATS: no template shows it, no flag names it


def detect(chat_template: str | None) -> ToolFormat | None:
    """The format whose markers the chat template writes, if one does."""
    for fmt in FORMATS.values():
        if chat_template and any(m in chat_template for m in fmt.markers):
            return fmt
    return None


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def structural_tag(fmt: ToolFormat, tools: list[dict], named: str | None, parallel: bool) -> GrammarSpec:
    """The grammar of a reply that is only tool calls: one of `named`, or at least one of `tools`."""
    def tag(tool):
        return {"type": "tag", "begin": fmt.begin + tool["function"]["name"] + fmt.middle, "end": fmt.end,
                "content": {"type": "json_schema", "json_schema": _parameters(tool), "max_whitespace_cnt": 1}}
    if named is not None:
        calls = tag(next(t for t in tools if t["function"]["name"] == named))
    else:
        calls = {"type": "tags_with_separator", "tags": [tag(t) for t in tools], "separator": fmt.separator,
                 "at_least_one": True, "stop_after_first": not parallel}
    parts = [{"type": "const_string", "value": fmt.opening}] if fmt.opening else []
    parts += [calls] + ([{"type": "const_string", "value": fmt.closing}] if fmt.closing else [])
    tag_format = parts[0] if len(parts) == 1 else {"type": "sequence", "elements": parts}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": tag_format}), "tool_choice")


def _rebased(schema, at: str):
    """`schema` moved to the JSON pointer `at`: its local $refs ("#/$defs/X") made to point there."""
    if isinstance(schema, dict):
        return {k: at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, at)
                for k, v in schema.items()}
    return [_rebased(v, at) for v in schema] if isinstance(schema, list) else schema


def json_calls(tools: list[dict], named: str | None, parallel: bool) -> tuple[ToolFormat, GrammarSpec]:
    """The format and grammar of a reply that is only tool calls, as JSON, for a model without a
    tool-call syntax: the named function's arguments object, or an array of at least one (exactly one
    without parallel calls) {"name": ..., "parameters": {...}} whose parameters fit that function's."""
    if named is not None:
        tool = next(t for t in tools if t["function"]["name"] == named)
        return replace(JSON, named=named), GrammarSpec("json_schema", json.dumps(_parameters(tool)), "tool_choice")
    # each function's parameters sit under $defs by its name (xgrammar's $refs cannot pass through
    # an array's index), so a schema's own $defs and $refs still resolve inside the whole
    names = [t["function"]["name"] for t in tools]
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
              "required": ["name", "parameters"], "additionalProperties": False} for name in names]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1}),
              "$defs": {name: _rebased(_parameters(t), f"#/$defs/{name}") for name, t in zip(names, tools)}}
    return JSON, GrammarSpec("json_schema", json.dumps(schema), "tool_choice")


@dataclass
class ToolCall:
    name: str
    arguments: str              # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str, cut: bool = False) -> list | None:
    """The JSON values `text` holds one after another (separated by `separators` characters and
    whitespace), or None when anything else is there; with `cut`, the values before it instead."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return values if cut else None
        values.append(value)


def _parse_json(fmt: ToolFormat, text: str) -> list[ToolCall]:
    """The calls of a json_calls reply. An array max_tokens cut keeps the calls it completed (as the
    families' parsers keep the whole calls of a cut reply); a cut arguments object is no call."""
    if fmt.named is not None:
        values = _json_values(text, "")
        whole = values is not None and len(values) == 1 and isinstance(values[0], dict)
        return [ToolCall(fmt.named, json.dumps(values[0], ensure_ascii=False))] if whole else []
    body = text.strip()
    if not body.startswith("["):
        return []
    calls = [_call(v, "parameters") for v in _json_values(body[1:].removesuffix("]"), ",", cut=True)]
    return calls if all(calls) else []


def parse(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: the text before the calls (None if empty) and each call.
    A reply whose calls do not parse is all content."""
    if fmt.name == "json":
        calls, head = _parse_json(fmt, text), ""
    elif fmt.name == "hermes":
        calls = []
        for found in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            values = _json_values(found.group(1), "")
            call = _call(values[0]) if values else None
            if call:
                calls.append(call)
        head = text.split("<tool_call>", 1)[0]
    elif fmt.name == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        values = _json_values(body, ";") if body.lstrip().startswith("{") else None
        calls = [c for c in map(lambda v: _call(v, "parameters"), values or []) if c]
        if not values or len(calls) != len(values):
            return text, []
        head = ""
    elif fmt.name == "mistral":
        head, marker, rest = text.partition("[TOOL_CALLS]")
        values = _json_values(rest, "") if marker else None
        if values and isinstance(values[0], list):
            calls = [c for c in map(_call, values[0]) if c]
        elif marker and rest.lstrip().startswith("["):     # a list max_tokens cut: the calls it completed
            calls = [c for c in map(_call, _json_values(rest.strip()[1:], ",", cut=True)) if c]
        else:                                      # v11 and later: NAME[ARGS]{...}, repeated
            calls = [ToolCall(m.group(1), m.group(2)) for m in
                     re.finditer(r"\s*([\w.-]+)\[ARGS\](\{.*?\})(?=\s*(?:\[TOOL_CALLS\]|$))", rest, re.S)]
    else:
        pattern = r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```\s*<｜tool▁call▁end｜>"
        calls = [ToolCall(name.strip(), args.strip()) for name, args in re.findall(pattern, text, re.S)]
        head = text.split("<｜tool▁calls▁begin｜>", 1)[0]
    if not calls:
        return text, []
    return head.strip() or None, calls


def calls_ended(body, finish_reason: str | None) -> bool:
    """Whether a reply that made calls is done calling: it stopped, or a required or named tool_choice
    made it nothing but calls and max_tokens cut the one after its last whole call (which the parser
    leaves out). A model the grammar lets call on and on must not lose the calls it made."""
    return finish_reason == "stop" or finish_reason == "length" and body.tool_choice not in (None, "auto")


def held_back(fmt: ToolFormat, text: str) -> int:
    """Where the tail of a streamed reply that may open tool calls begins: from there on the text
    waits for the whole reply (len(text): none of it)."""
    if fmt.name == "json":                    # the grammar lets the reply be nothing but calls
        return 0
    if fmt.name == "llama3_json":             # bare JSON calls: a reply opening with "{" (or the tag) waits
        stripped = text.lstrip()
        return len(text) - len(stripped) if not stripped or stripped[0] in "{<" else len(text)
    marker = fmt.markers[0]
    at = text.find(marker)
    if at >= 0:
        return at
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)
