"""The OpenAI request bodies kiln accepts (pydantic), and their translation to SamplingParams.

Field names and ranges follow OpenAI's API; the extensions vLLM users expect (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority) sit beside them, and kiln's
`speculative: false` keeps a request out of speculative decoding where the server runs it. As in
OpenAI's schema every optional field is nullable: an explicit `null` means the default. Unknown
fields are ignored, as OpenAI's server does; fields kiln knows but does not implement (`suffix`,
the legacy `functions`, image or audio content, ...) are refused by name rather than silently
dropped. A JSON `response_format`, vLLM's `structured_outputs` and its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar` constrain the output (runtime/grammar.py); a
body gives one. `tools` and `tool_choice` are checked by serve/tool_fields.py in the shape of each
route's API (the completions route takes none); serve/tool_calls.py turns them into calls. A value
out of range fails validation, which the app turns into a 400 naming the parameter.
"""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.runtime.grammar import GrammarSpec
from kiln.runtime.sampler import SamplingParams

from .tool_fields import CHAT, ToolShape, valid_tool_choice, valid_tools


def _no_lone_surrogates(value: Any) -> None:
    """JSON may carry unpaired UTF-16 surrogates ("\\ud800"); they are not text a tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("holds an unpaired surrogate (\\ud800-\\udfff): not valid Unicode text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k)
            _no_lone_surrogates(v)
    elif isinstance(value, list):
        for v in value:
            _no_lone_surrogates(v)


# vLLM's structured_outputs keys: a JSON schema, a regex, a choice of strings, an EBNF grammar, any JSON
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _spec(kind: str, value, param: str) -> GrammarSpec:
    """A structured_outputs / guided_* constraint as a GrammarSpec."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{param}: the schema is not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{param}: a JSON schema is an object")
        return GrammarSpec("json_schema", json.dumps(value), param)
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{param}: choice is a non-empty list of non-empty strings")
        return GrammarSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{param}: {kind} is a non-empty string")
    return GrammarSpec("regex" if kind == "regex" else "ebnf", value, param)


def template_arguments(text: str):
    """A call's arguments as chat templates read them (transformers' convention): an object where
    the text is JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def nested(value, *keys):
    """value[k1][k2]... where each level is an object, else None (request bodies may hold anything)."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _unsupported(name: str, what: str) -> ValueError:
    return ValueError(f"{name} is not supported by kiln yet ({what})")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_unicode(cls, v):
        _no_lone_surrogates(v)
        return v


class _Sampling(_Request):
    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None                       # any integer: the sampler folds it into range
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    # extensions: vLLM's structured output, and its older guided_* names
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    speculative: bool = True           # false: never speculate for this request
    TOOLS: ClassVar[ToolShape | None] = None      # how the route spells tools (serve/tool_fields.py); None: it has none

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop must be up to 16 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return {}
        out = {}
        for key, bias in v.items():
            if not key.lstrip("-").isdigit() or int(key) < 0 or not -100 <= bias <= 100:
                raise ValueError("logit_bias maps token ids (as strings) to values in [-100, 100]")
            out[int(key)] = bias
        return out

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, v, info):
        return valid_tools(cls.TOOLS, info.field_name, v)

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _tool_choice(cls, v, info):
        return valid_tool_choice(cls.TOOLS, info.field_name, v)

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        kind = (v or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', not {kind!r}")
        if kind == "json_schema" and not isinstance(nested(v, "json_schema", "schema") or {}, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured(cls, v):
        given = [k for k in STRUCTURED_KINDS if (v or {}).get(k) not in (None, False)]
        if v is not None and len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}"
                             f"{f' (got {given})' if given else ''}")
        return v

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self._constraints()
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(name for name, _ in given)}")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        self.check_tool_choice(self.TOOLS.names(self.tools) if self.TOOLS else [])
        return self

    def _constraints(self) -> list[tuple[str, GrammarSpec]]:
        """(request field, its constraint) for every constraint the body gives."""
        out = []
        fmt = self.response_format or {}
        if fmt.get("type") == "json_object":
            out.append(("response_format", GrammarSpec("json_object", param="response_format")))
        elif fmt.get("type") == "json_schema":
            schema = nested(fmt, "json_schema", "schema") or {}
            out.append(("response_format", GrammarSpec("json_schema", json.dumps(schema), "response_format")))
        if self.structured_outputs:
            kind, value = next((k, v) for k, v in self.structured_outputs.items()
                               if k in STRUCTURED_KINDS and v not in (None, False))
            out.append(("structured_outputs", _spec(kind, value, "structured_outputs")))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                out.append((f"guided_{kind}", _spec(kind, value, f"guided_{kind}")))
        return out

    def tools_in_force(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool(self) -> str | None:
        """The function tool_choice names, if it names one."""
        return self.TOOLS.chosen(self.tool_choice) if self.TOOLS else None

    def check_tool_choice(self, names: list[str]) -> None:
        """tool_choice against the tools' `names`: a named one among them, required with some, and
        either as the body's only output constraint."""
        if self.forced_tool() is not None and self.forced_tool() not in names:
            raise ValueError(f"tool_choice names {self.forced_tool()!r}, which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.tools_in_force() and self.tool_choice not in (None, "auto") and self._constraints():
            raise ValueError("a required or named tool_choice is itself an output constraint: give no other")

    def structured(self) -> GrammarSpec | None:
        """What the output must match, if the body constrains it."""
        given = self._constraints()
        return given[0][1] if given else None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported")
        return v

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, n=self.n, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias or {}, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured=self.structured(), speculative=self.speculative)


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or several: one choice per prompt x n, in that order
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)    # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt is empty")
        if len(prompts) > 256:
            raise ValueError("at most 256 prompts per request")
        return prompts

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise _unsupported("suffix", "no fill-in-the-middle")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt                          # normalised to a list by the validator


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None       # an assistant turn's calls
    tool_call_id: str | None = None            # a tool turn: the call it answers
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v):
        for i, call in enumerate(v or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                    or not isinstance(function.get("arguments", "{}"), str):
                raise ValueError(f"tool_calls[{i}] needs function.name and function.arguments (a JSON string)")
        return v

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' convention): a call's arguments as
        an object where they are JSON."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{**call, "type": "function", "function": {
                **call["function"], "arguments": template_arguments(call["function"].get("arguments") or "{}")}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        for i, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}: this model takes text only "
                                 "(no image, audio or file parts)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} has no 'text' string")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    TOOLS: ClassVar[ToolShape] = CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None       # vLLM's: variables for the template (enable_thinking, ...)
    audio: dict | None = None
    modalities: list[str] | None = None

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise _unsupported("audio", "text output only")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v):
        if v and set(v) != {"text"}:
            raise _unsupported("modalities", "text only")
        return v


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): an adapter's served name and its PEFT folder."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
