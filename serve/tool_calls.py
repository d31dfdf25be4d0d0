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
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

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


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values `text` holds one after another (separated by `separators` characters and
    whitespace), or None when anything else is there."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: the text before the calls (None if empty) and each call.
    A reply whose calls do not parse is all content."""
    if fmt.name == "hermes":
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


def held_back(fmt: ToolFormat, text: str) -> int:
    """Where the tail of a streamed reply that may open tool calls begins: from there on the text
    waits for the whole reply (len(text): none of it)."""
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
