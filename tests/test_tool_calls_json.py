"""Tool calls from a model whose chat template shows no tool-call syntax, served without
--tool-call-parser (the tiny Llama's template has none): a required or named tool_choice is answered
with JSON calls the grammar keeps valid (serve/tool_calls.json_calls), on the chat route and the
Responses API, whole and streamed; "auto" still needs a format."""
from __future__ import annotations

import json

import pytest

from test_tool_calls import BOOK, TOOLS

pytest.importorskip("xgrammar")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

ALL = TOOLS + [BOOK]
SCHEMAS = {t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in ALL}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": ALL, "temperature": 1, "max_tokens": 200}


@pytest.fixture(scope="module")
def http(llama_cpu):
    from fastapi.testclient import TestClient
    from kiln.serve.app import ServerConfig, create_app
    app = create_app(ServerConfig.of(str(llama_cpu[0]), served_model_name="tiny", kv_memory="16MiB"), load_now=True)
    with TestClient(app) as client:
        yield client


def events(r) -> list[dict]:
    """The JSON payloads of a server-sent event stream, [DONE] left out."""
    assert r.status_code == 200, r.text
    return [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def check_calls(calls: list[tuple[str, str]], named: str | None = None) -> None:
    """At least one call, each to one of the tools (the named one, if one is), its arguments JSON
    that validates against that function's parameters."""
    assert calls
    for name, arguments in calls:
        assert name in SCHEMAS and named in (None, name), name
        assert SCHEMAS[name].is_valid(json.loads(arguments)), (name, arguments)


@pytest.mark.parametrize("choice,named,parallel", [("required", None, True), ("required", None, False),
                                                   (NAMED, "get_weather", True)], ids=["required", "one", "named"])
def test_chat_answers_with_valid_calls_whole_and_streamed(http, choice, named, parallel):
    """Allowed one call, the reply ends with it, long before max_tokens. Allowed several, the random
    model calls on until max_tokens cuts it: the whole calls before the cut are its reply."""
    counts = []
    for seed in range(3):
        body = {**ASK, "tool_choice": choice, "parallel_tool_calls": parallel, "seed": seed}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice_ = r.json()["choices"][0]
        message, calls = choice_["message"], choice_["message"]["tool_calls"]
        assert choice_["finish_reason"] == "tool_calls" and message["content"] is None, choice_
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        assert len({c["id"] for c in calls}) == len(calls)
        check_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls], named)
        if named or not parallel:        # the grammar ended the reply with its call: max_tokens was far off
            assert len(calls) == 1 and r.json()["usage"]["completion_tokens"] < ASK["max_tokens"]
        counts.append(len(calls))
        chunks = [c["choices"][0] for c in events(http.post("/v1/chat/completions", json={**body, "stream": True}))]
        streamed: dict[int, dict] = {}
        for chunk in chunks:
            for d in chunk["delta"].get("tool_calls", []):
                entry = streamed.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = d.get("id") or entry["id"]
                entry["name"] = d["function"].get("name") or entry["name"]
                entry["arguments"] += d["function"].get("arguments") or ""
        assert "".join(c["delta"].get("content") or "" for c in chunks) == ""      # no call leaks as text
        assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]      # same seed, same reply
        assert all(e["id"].startswith("call_") for e in streamed.values())
        assert chunks[-1]["finish_reason"] == "tool_calls"
    if parallel and not named:
        assert max(counts) > 1                  # several calls, kept whole from a cut reply


@pytest.mark.parametrize("choice,named,parallel", [("required", None, True), ("required", None, False),
                                                   ({"type": "function", "name": "book"}, "book", True)],
                         ids=["required", "one", "named"])
def test_responses_api_gives_function_call_items_whole_and_streamed(http, choice, named, parallel):
    flat = [{"type": "function", **t["function"]} for t in ALL]
    body = {"input": "Weather in Oslo?", "tools": flat, "tool_choice": choice, "temperature": 1, "seed": 5,
            "max_output_tokens": 200, "parallel_tool_calls": parallel}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    done = r.json()
    items = done["output"]
    assert done["status"] == "completed" and items and all(i["type"] == "function_call" for i in items), done
    assert all(i["call_id"].startswith("call_") and i["status"] == "completed" for i in items)
    check_calls([(i["name"], i["arguments"]) for i in items], named)
    if named or not parallel:
        assert len(items) == 1 and done["usage"]["output_tokens"] < body["max_output_tokens"]
    streamed = events(http.post("/v1/responses", json={**body, "stream": True}))
    kinds = [e["type"] for e in streamed]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" not in kinds
    assert [(e["item"]["name"], e["item"]["arguments"]) for e in streamed if e["type"] == "response.output_item.done"] \
        == [(i["name"], i["arguments"]) for i in items]                  # same seed, same reply


@pytest.mark.parametrize("path,body,short", [
    ("/v1/chat/completions", ASK, {"max_tokens": 4}),
    ("/v1/chat/completions", {**ASK, "tool_choice": "auto"}, {"max_tokens": 4}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "now"}], "tool_choice": "auto"},
     {"max_output_tokens": 4}),
], ids=["chat default", "chat auto", "responses auto"])
def test_auto_still_needs_a_format(http, path, body, short):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "--tool-call-parser" in error["message"], error
    assert http.post(path, json={**body, **short, "tool_choice": "none"}).status_code == 200     # the server goes on


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parameters_xgrammar_cannot_compile_are_a_400(http, stream):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    r = http.post("/v1/chat/completions", json={**ASK, "tools": bad, "tool_choice": "required", "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "strin" in r.json()["error"]["message"]
