"""Tool calling (serve/tool_calls.py): each family's parser on transcripts, whole and streamed in any
pieces (and the JSON calls of a model without a format); required and named tool_choice as grammars
that random logits cannot break; `kiln serve` with the openai SDK (without a format:
test_tool_calls_json.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.serve.responses import Chat
from kiln.serve.tool_calls import FORMATS, JSON, held_back, json_calls, parse, structural_tag

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 7}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
TOOLS = [WEATHER, NOW]
# parameters that refer to their own $defs: the JSON calls' schema must keep the reference working
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "required": ["who"], "additionalProperties": False,
    "properties": {"who": {"$ref": "#/$defs/Person"}},
    "$defs": {"Person": {"type": "object", "required": ["age"], "additionalProperties": False,
                         "properties": {"age": {"type": "integer", "minimum": 3, "maximum": 5}}}}}}}
CALLS = [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]

TRANSCRIPTS = {       # family -> (reply with content and two calls, content)
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "Let me check."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                    '{"name": "now", "parameters": {}}', None),
    "mistral": ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                '{"name": "now", "arguments": {}}]', "Sure."),
    "deepseek_v3": ("On it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now'
                    "\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "On it."),
    "json": ('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "now", "parameters": {}}]',
             None),
}
FORMAT = {**FORMATS, "json": JSON}          # json: a model without a format of its own (tool_calls.json_calls)


@pytest.mark.parametrize("family", sorted(TRANSCRIPTS))
def test_each_family_parses_its_transcript(family):
    text, content = TRANSCRIPTS[family]
    got_content, calls = parse(FORMAT[family], text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_mistral_v11_calls_and_plain_replies():
    _, calls = parse(FORMATS["mistral"], '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}'
                                         '[TOOL_CALLS]now[ARGS]{}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for family in FORMATS:
        assert parse(FORMATS[family], "Just words { not a call") == ("Just words { not a call", [])
    assert parse(FORMATS["hermes"], "<tool_call>\n{broken\n</tool_call>")[1] == []


def sample(text, new_text, finished, finish="stop"):
    return SimpleNamespace(index=0, text=text, new_text=new_text, new_token_ids=[1] if new_text else [],
                           token_ids=[1] * len(text), logprobs=None, stop_reason=None,
                           finish_reason=finish if finished else None)


def stream(family, pieces, reasoning_parser=None, tool_choice=None, finish="stop"):
    body = SimpleNamespace(n=1, top_logprobs=None, tool_choice=tool_choice)
    fmt = Chat(None, body, [[1]], ["p"], ["r0"], reasoning_parser=reasoning_parser, tool_format=FORMAT[family])
    text, chunks = "", []
    for i, piece in enumerate(pieces):
        text += piece
        out = SimpleNamespace(request_id="r0", outputs=[sample(text, piece, i == len(pieces) - 1, finish)])
        chunks += [chunk["choices"][0] for chunk in fmt.chunks(out, "id", 0, "m")]
    whole = fmt.choice(SimpleNamespace(request_id="r0"), sample(text, "", True, finish))
    return chunks, whole


@pytest.mark.parametrize("family", ["deepseek_v3", "hermes", "json", "mistral"])
def test_a_reply_cut_after_whole_calls_keeps_them(family):
    """max_tokens cutting a reply in its second call: the first is kept. Under a required tool_choice
    (the grammar let the model write only calls) it ends with tool_calls; under auto it was cut."""
    text, content = TRANSCRIPTS[family]
    cut = text[:text.rindex("now") + 2]
    for choice, finish in (("required", "tool_calls"), ("auto", "length")):
        chunks, whole = stream(family, [cut[:20], cut[20:]], tool_choice=choice, finish="length")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
                whole["message"]["tool_calls"]] == CALLS[:1] and whole["message"]["content"] == content
        streamed = [d["function"] for c in chunks for d in c["delta"].get("tool_calls", [])]
        assert [(f["name"], json.loads(a["arguments"])) for f, a in zip(streamed[::2], streamed[1::2])] == CALLS[:1]
        assert whole["finish_reason"] == chunks[-1]["finish_reason"] == finish


@pytest.mark.parametrize("family", sorted(TRANSCRIPTS))
def test_streamed_calls_in_any_pieces_match_the_whole_reply(family):
    text, content = TRANSCRIPTS[family]
    rng = np.random.default_rng(1)
    for _ in range(10):
        cuts = sorted(rng.choice(np.arange(1, len(text)), size=8, replace=False).tolist())
        chunks, whole = stream(family, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
        streamed = "".join(c["delta"].get("content") or "" for c in chunks)
        assert streamed.strip() == (content or "")
        calls = {}
        for c in chunks:
            for d in c["delta"].get("tool_calls", []):
                entry = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                entry["name"] = d["function"].get("name") or entry["name"]
                entry["arguments"] += d["function"]["arguments"]
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == CALLS
        assert chunks[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"
        assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert whole["message"]["content"] == content


def test_a_reply_without_calls_streams_whole_text():
    chunks, whole = stream("hermes", ["Plain ", "<tool", " words"])
    assert "".join(c["delta"]["content"] for c in chunks) == "Plain <tool words" == whole["message"]["content"]
    assert chunks[-1]["finish_reason"] == "stop" and "tool_calls" not in whole["message"]


def test_json_calls_of_a_named_function_and_replies_without_a_whole_call():
    """A named tool_choice without a format: the reply is the arguments. A reply without a whole call
    (max_tokens cut it first) is text, and nothing of a JSON reply streams as text before it ends."""
    named, _ = json_calls(TOOLS, "get_weather", parallel=True)
    content, calls = parse(named, ' {"city": "Oslo", "days": 2}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS[:1]
    for fmt, text in ((JSON, '[{"name": "now", "param'), (named, '{"city": "Os'), (JSON, '[{"nam": "now"}]'),
                      (named, "[]"), (JSON, "[]"), (JSON, '{"name": "now", "parameters": {}}')):
        assert parse(fmt, text) == (text, []) and held_back(fmt, text) == 0


def tool_grammar(family, tools, named, parallel):
    """(format, grammar) of a required or named tool_choice, as serve/app.py picks them."""
    if family == "json":
        return json_calls(tools, named, parallel)
    return FORMATS[family], structural_tag(FORMATS[family], tools, named, parallel)


@pytest.mark.parametrize("family", sorted(FORMAT))
@pytest.mark.parametrize("named", [None, "get_weather"])
def test_required_and_named_choices_always_give_valid_calls(make_model, family, named):
    pytest.importorskip("xgrammar")
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from fake_runner import FakeRunner
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampler import SamplingParams
    from kiln.runtime.tokenizer import Tokenizer
    tok = Tokenizer(make_model("llama"))
    eng = Engine(FakeRunner(512, vocab_size=512), num_pages=512, eos_ids=tok.eos_token_ids, tokenizer=tok)
    tools = TOOLS + [BOOK]
    schemas = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in tools}
    for parallel in (False, True) if family == "json" else (False,):
        fmt, spec = tool_grammar(family, tools, named, parallel)
        outs = eng.generate([tok.encode("x")] * 6, [SamplingParams(temperature=1, seed=s, max_tokens=400,
                                                                   structured=spec, skip_special_tokens=False)
                                                    for s in range(6)])
        counts = []
        for out in outs:
            reply = out.outputs[0]
            content, calls = parse(fmt, reply.text)
            assert reply.finish_reason == "stop" and content is None and calls, reply.text
            for call in calls:
                assert named in (None, call.name) and schemas[call.name].is_valid(json.loads(call.arguments))
            counts.append(len(calls))
        assert set(counts) == {1} if named or not parallel else max(counts) > 1      # parallel calls: some make several


@pytest.mark.build
def test_tools_through_kiln_serve_and_the_openai_sdk(llama_cpu, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("xgrammar")
    from serving import KEY, running_server
    with running_server(llama_cpu[0], tmp_path / "server.log", "--kv-memory", "16MiB",
                        "--tool-call-parser", "hermes") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        ask = dict(model=llama_cpu[0].name, messages=messages, tools=TOOLS, temperature=1, seed=3, max_tokens=200,
                   parallel_tool_calls=False)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = client.chat.completions.create(**ask, tool_choice=choice)
            call = reply.choices[0].message.tool_calls[0]
            assert reply.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            assert call.function.name == "now" or (call.function.name == "get_weather" and 1 <= args["days"] <= 7)
            streamed = client.chat.completions.create(**ask, tool_choice=choice, stream=True)
            name, arguments = None, ""
            for chunk in streamed:
                for d in chunk.choices[0].delta.tool_calls or []:
                    name = d.function.name or name
                    arguments += d.function.arguments or ""
            assert (name, json.loads(arguments)) == (call.function.name, args)     # same seed, same reply
        # the SDK's tool helpers: a pydantic model as a strict function tool, its arguments parsed back
        from pydantic import BaseModel, Field

        class GetWeather(BaseModel):
            city: str = Field(max_length=8)
            days: int = Field(ge=1, le=7)
        parsed = client.chat.completions.parse(
            model=llama_cpu[0].name, messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice="required", parallel_tool_calls=False, temperature=1, seed=4, max_tokens=200)
        assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)
        # the call and its result go back into the conversation
        follow = client.chat.completions.create(
            model=llama_cpu[0].name, tools=TOOLS, max_tokens=4, messages=messages + [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}])
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")

        # the Responses API: function tools in its flat shape, function_call items out and back in
        flat = [{"type": "function", **t["function"]} for t in TOOLS]
        ask = dict(model=llama_cpu[0].name, input="Weather in Oslo?", tools=flat, tool_choice="required",
                   parallel_tool_calls=False, temperature=1, max_output_tokens=200, extra_body={"seed": 5})
        done = client.responses.create(**ask)
        calls = [item for item in done.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].call_id.startswith("call_") and done.status == "completed"
        assert isinstance(json.loads(calls[0].arguments), dict)
        events = list(client.responses.create(**ask, stream=True))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
        streamed = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert streamed.arguments == calls[0].arguments                  # same seed, same reply
        again = client.responses.create(model=llama_cpu[0].name, tools=flat, max_output_tokens=4, input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
             "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 3}'}])
        assert again.status in ("completed", "incomplete")
