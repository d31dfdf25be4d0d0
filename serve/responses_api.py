"""OpenAI's Responses API, the text part: `POST /v1/responses` with `input` (a string or messages),
`instructions`, `max_output_tokens`, sampling fields, `text.format` (plain, any JSON, a JSON schema:
structured output) and `stream`, over the same engine as the chat route.

A response holds one message item with one output_text part. Streamed, it is OpenAI's event
sequence: response.created, response.in_progress, the item and its part added, output_text deltas,
then each done and response.completed (or response.incomplete when max_output_tokens cut it). Not
yet: function tools (refused by name, as on the chat route) and stored responses
(`previous_response_id`).
"""
from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import Field, field_validator

from kiln.runtime.grammar import GrammarSpec

from .protocol import _Sampling


class ResponsesRequest(_Sampling):
    n: Literal[1] = 1                           # one output per response
    stream_options: None = None                 # usage comes in response.completed
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: dict | None = None
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
            if item.get("type", "message") != "message" or item.get("role") not in ("user", "assistant", "system",
                                                                                     "developer"):
                raise ValueError(f"input item {i} must be a message with role user, assistant, system or developer "
                                 f"(function calls and other items are not supported yet)")
            content = item.get("content")
            parts = content if isinstance(content, list) else [{"type": "input_text", "text": content}]
            for part in parts:
                if part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                    raise ValueError(f"input item {i} holds a {part.get('type')!r} part: this model takes text only")
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
        kind = ((v or {}).get("format") or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"text.format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
        return v

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        fmt = (self.text or {}).get("format") or {}
        given = super()._constraints()
        if fmt.get("type") == "json_object":
            given.append(("text.format", GrammarSpec("json_object", param="text.format")))
        elif fmt.get("type") == "json_schema":
            given.append(("text.format", GrammarSpec("json_schema", json.dumps(fmt.get("schema", {})), "text.format")))
        return given

    def messages(self) -> list[dict]:
        """The conversation the chat template renders: instructions as the system message, then input."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for item in self.input:
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p["text"] for p in content)
            out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": text})
        return out


class ResponseFormat:
    """A Responses API answer from the engine's outputs: whole, or as stream events."""

    def __init__(self, body: ResponsesRequest, prompt_ids: list[int]):
        self.body, self.prompt_tokens = body, len(prompt_ids)
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.started = False

    def _response(self, request_id, created, model, status: str, text: str | None, out_tokens: int) -> dict:
        output = [] if text is None else [self._item(text, "completed" if status == "completed" else "incomplete")]
        response = {"id": request_id, "object": "response", "created_at": created, "status": status, "model": model,
                    "output": output, "instructions": self.body.instructions,
                    "max_output_tokens": self.body.max_output_tokens, "temperature": self.body.temperature,
                    "top_p": self.body.top_p, "text": self.body.text or {"format": {"type": "text"}},
                    "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                    "metadata": self.body.metadata or {}}
        if text is not None:
            response["usage"] = {"input_tokens": self.prompt_tokens, "output_tokens": out_tokens,
                                 "total_tokens": self.prompt_tokens + out_tokens,
                                 "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens_details": {"reasoning_tokens": 0}}
        return response

    def _item(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _status(sample) -> str:
        return "incomplete" if sample.finish_reason == "length" else "completed"

    def response(self, finals: list, request_id, created, model) -> dict:
        sample = finals[0].outputs[0]
        return self._response(request_id, created, model, self._status(sample), sample.text, len(sample.token_ids))

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def chunks(self, out, request_id, created, model):
        sample = out.outputs[0]
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.started:
            self.started = True
            yield self._event("response.created", response=self._response(request_id, created, model, "in_progress",
                                                                           None, 0))
            yield self._event("response.in_progress", response=self._response(request_id, created, model,
                                                                               "in_progress", None, 0))
            yield self._event("response.output_item.added", output_index=0,
                              item={**self._item("", "in_progress"), "content": []})
            yield self._event("response.content_part.added", **{k: v for k, v in at.items()},
                              part={"type": "output_text", "text": "", "annotations": []})
        if sample.new_text:
            yield self._event("response.output_text.delta", **at, delta=sample.new_text, logprobs=[])
        if sample.finish_reason is not None:
            status = self._status(sample)
            yield self._event("response.output_text.done", **at, text=sample.text, logprobs=[])
            yield self._event("response.content_part.done", **at,
                              part={"type": "output_text", "text": sample.text, "annotations": []})
            yield self._event("response.output_item.done", output_index=0,
                              item=self._item(sample.text, "completed" if status == "completed" else "incomplete"))
            yield self._event(f"response.{status}", response=self._response(request_id, created, model, status,
                                                                             sample.text, len(sample.token_ids)))

    def usage_chunk(self, finals: list, request_id, created, model) -> dict:
        raise AssertionError("the Responses API streams its usage in response.completed")
