"""Agent and extraction libraries, unmodified, against `kiln serve`: langchain-openai's
with_structured_output and bind_tools, and litellm's completion with a response_format and tools.
A random-weight model answers: what is checked is that every reply parses into what was asked."""
from __future__ import annotations

import json
import os

import pytest
from pydantic import BaseModel, Field

from serving import KEY, running_server

pytestmark = pytest.mark.build


class Verdict(BaseModel):
    answer: bool
    score: int = Field(ge=0, le=10)


class GetWeather(BaseModel):
    """The weather in a city."""
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(llama_cpu, tmp_path_factory):
    pytest.importorskip("xgrammar")
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(llama_cpu[0], log, "--kv-memory", "16MiB", "--tool-call-parser", "hermes") as (url, _):
        yield url, llama_cpu[0].name


def test_langchain_structured_output_and_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    url, name = server
    chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key=KEY, model=name, temperature=1, max_tokens=200,
                                       seed=1)
    verdict = chat.with_structured_output(Verdict).invoke(
        "Return a JSON object with answer (a boolean) and score (an integer from 0 to 10).")
    assert isinstance(verdict, Verdict)
    reply = chat.bind_tools([GetWeather], tool_choice="required", parallel_tool_calls=False).invoke("Oslo weather?")
    assert [c["name"] for c in reply.tool_calls] == ["GetWeather"]
    GetWeather(**reply.tool_calls[0]["args"])


def test_litellm_response_format_and_tools(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # no network at import
    litellm = pytest.importorskip("litellm")
    url, name = server
    ask = dict(model=f"openai/{name}", api_base=f"{url}/v1", api_key=KEY, temperature=1, max_tokens=200, seed=2,
               messages=[{"role": "user", "content": "Judge and call tools."}])
    reply = litellm.completion(**ask, response_format=Verdict)
    Verdict.model_validate_json(reply.choices[0].message.content)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": GetWeather.model_json_schema()}}
    reply = litellm.completion(**ask, tools=[tool], tool_choice="required", parallel_tool_calls=False)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    GetWeather(**json.loads(call.function.arguments))
