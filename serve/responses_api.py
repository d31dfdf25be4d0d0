"""OpenAI's Responses API, minimal: `POST /v1/responses` with `input` (a string, or messages,
function calls and their outputs), `instructions`, `max_output_tokens`, sampling fields,
`text.format` (plain, any JSON, a JSON schema: structured output), function `tools` with
`tool_choice`, and `stream`, over the same engine as the chat route.

A response holds a message item (one output_text part) when the reply has text, then a
function_call item per call. Streamed, it is OpenAI's event sequence: response.created,
response.in_progress, the message item and its part added, output_text deltas, each done, then per
call its item added, its arguments' delta and done, the item done, and response.completed (or
response.incomplete when max_output_tokens cut it, unless it cut a required or named tool_choice's
reply after whole calls: tool_calls.calls_ended). Not yet: built-in tools and stored responses
(`previous_response_id`).
"""
from __future__ import annotations

import json
import uuid
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kiln.runtime.grammar import GrammarSpec

from .protocol import _Sampling, nested, template_arguments
from .tool_calls import ToolCall, ToolFormat, calls_ended, held_back, parse
from .tool_fields import RESPONSES, ToolShape


class ResponsesRequest(_Sampling):
    TOOLS: ClassVar[ToolShape] = RESPONSES
    n: Literal[1] = 1                           # one output per response
    stream_options: None = None                 # usage comes in response.completed
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: dict | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("input is empty")
            return v
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                raise ValueError(f"input item {i} is not an object")
            kind = item.get("type", "message")
            if kind == "function_call":
                if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                    raise ValueError(f"input item {i}: a function_call needs call_id, name and arguments")
                continue
            if kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                    raise ValueError(f"input item {i}: a function_call_output needs call_id and output")
                continue
            if kind != "message" or item.get("role") not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"input item {i} must be a message with role user, assistant, system or developer, "
                                 "a function_call or a function_call_output")
            content = item.get("content")
            parts = content if isinstance(content, list) else [{"type": "input_text", "text": content}]
            for part in parts:
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                        or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"input item {i} holds a {kind!r} part: this model takes text only")
        return v

    @field_validator("previous_response_id")
    @classmethod
    def _not_stored(cls, v):
        if v:
            raise ValueError("previous_response_id is not supported by kiln yet (responses are not stored)")
        return v

    @field_validator("text")
    @classmethod
    def _text_format(cls, v):
        kind = nested(v, "format", "type") or "text"
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"text.format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
        return v

    def chat_tools(self) -> list[dict]:
        """The tools in the chat API's shape, which chat templates and the tool formats read."""
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in self.tools or []]

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        fmt = nested(self.text, "format") or {}
        given = super()._constraints()
        if fmt.get("type") == "json_object":
            given.append(("text.format", GrammarSpec("json_object", param="text.format")))
        elif fmt.get("type") == "json_schema":
            given.append(("text.format", GrammarSpec("json_schema", json.dumps(fmt.get("schema", {})), "text.format")))
        return given

    def messages(self) -> list[dict]:
        """The conversation the chat template renders: instructions as the system message, then
        input; function calls join an assistant turn's tool_calls, their outputs are tool turns."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "function_call":
                if not (out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]):
                    out.append({"role": "assistant", "content": "", "tool_calls": []})
                out[-1]["tool_calls"].append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": template_arguments(item["arguments"])}})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            else:
                content = item["content"]
                text = content if isinstance(content, str) else "".join(p["text"] for p in content)
                out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": text})
        return out


class ResponseFormat:
    """A Responses API answer from the engine's outputs: whole, or as stream events. With tools in
    force the reply's calls become function_call items after its message (if it has text)."""

    def __init__(self, body: ResponsesRequest, prompt_ids: list[int], tool_format: ToolFormat | None = None):
        self.body, self.prompt_tokens, self.tool_format = body, len(prompt_ids), tool_format
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.started = self.message_open = False
        self.held, self.sent = "", 0            # the reply so far, and how much of it was streamed as text

    def _split(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.tool_format is None:
            return text, []
        content, calls = parse(self.tool_format, text)
        return content or "", calls

    def _items(self, content: str, calls: list[ToolCall], status: str) -> list[dict]:
        items = [self._message(content, status)] if content or not calls else []
        return items + [self._call_item(call) for call in calls]

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _call_item(call: ToolCall, arguments: str | None = None) -> dict:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments if arguments is None else arguments,
                "status": "completed" if arguments is None else "in_progress"}

    def _response(self, request_id, created, model, status: str, output: list[dict] | None, out_tokens: int) -> dict:
        response = {"id": request_id, "object": "response", "created_at": created, "status": status, "model": model,
                    "output": output or [], "instructions": self.body.instructions,
                    "max_output_tokens": self.body.max_output_tokens, "temperature": self.body.temperature,
                    "top_p": self.body.top_p, "text": self.body.text or {"format": {"type": "text"}},
                    "tools": self.body.tools or [], "tool_choice": self.body.tool_choice or "auto",
                    "parallel_tool_calls": self.body.parallel_tool_calls, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "metadata": self.body.metadata or {}}
        if output is not None:
            response["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": out_tokens,
                                 "total_tokens": self.prompt_tokens + out_tokens,
                                 "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens_details": {"reasoning_tokens": 0}}
        return response

    def _status(self, sample, calls: list[ToolCall]) -> str:
        """completed, or incomplete where max_output_tokens cut the reply (but not after whole calls
        under a required or named tool_choice: tool_calls.calls_ended)."""
        ended = calls and calls_ended(self.body, sample.finish_reason)
        return "incomplete" if sample.finish_reason == "length" and not ended else "completed"

    def response(self, finals: list, request_id, created, model) -> dict:
        sample = finals[0].outputs[0]
        content, calls = self._split(sample.text)
        status = self._status(sample, calls)
        return self._response(request_id, created, model, status, self._items(content, calls, status),
                              len(sample.token_ids))

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _open_message(self):
        self.message_open = True
        yield self._event("response.output_item.added", output_index=0,
                          item={**self._message("", "in_progress"), "content": []})
        yield self._event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})

    def chunks(self, out, request_id, created, model):
        sample = out.outputs[0]
        final = sample.finish_reason is not None
        if not self.started:
            self.started = True
            for kind in ("response.created", "response.in_progress"):
                yield self._event(kind, response=self._response(request_id, created, model, "in_progress", None, 0))
        self.held += sample.new_text
        calls = self._split(self.held)[1] if final else []
        end = held_back(self.tool_format, self.held) if self.tool_format and (calls or not final) else len(self.held)
        piece, self.sent = self.held[self.sent:max(end, self.sent)], max(end, self.sent)
        if piece and not self.message_open:
            yield from self._open_message()
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if piece:
            yield self._event("response.output_text.delta", **at, delta=piece, logprobs=[])
        if not final:
            return
        status = self._status(sample, calls)
        content = self._split(self.held)[0] if calls else self.held
        if not self.message_open and not calls:
            yield from self._open_message()
        if self.message_open:
            yield self._event("response.output_text.done", **at, text=content, logprobs=[])
            yield self._event("response.content_part.done", **at,
                              part={"type": "output_text", "text": content, "annotations": []})
            yield self._event("response.output_item.done", output_index=0, item=self._message(content, status))
        for index, call in enumerate(calls, start=int(self.message_open)):
            item = self._call_item(call)
            yield self._event("response.output_item.added", output_index=index, item=self._call_item(call, ""))
            yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=call.arguments)
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=call.arguments)
            yield self._event("response.output_item.done", output_index=index, item=item)
        output = ([self._message(content, status)] if self.message_open else []) + [self._call_item(c) for c in calls]
        yield self._event(f"response.{status}", response=self._response(request_id, created, model, status, output,
                                                                         len(sample.token_ids)))

    def usage_chunk(self, finals: list, request_id, created, model) -> dict:
        raise AssertionError("the Responses API streams its usage in response.completed")
