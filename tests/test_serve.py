"""`kiln serve` on loopback, driven by the official `openai` client and by raw HTTP: answers equal
the offline API's, every bad input gets its 4xx, disconnects free pages (fuzzing: test_serve_fuzz.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from serving import KEY, running_server

from kiln.options import CompileOptions

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

server_pids: dict[str, int] = {}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.fixture(scope="module")
def artifact(llama_cpu, tmp_path_factory):
    """The tiny Llama's CPU artifact under the name the server serves it by (its folder's name)."""
    link = tmp_path_factory.mktemp("serve") / "tiny-llama"
    link.symlink_to(llama_cpu[0], target_is_directory=True)
    return link


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with running_server(artifact, log, "--kv-memory", "64MiB", "--max-num-seqs", "16", "--max-waiting", "200") \
            as (url, proc):
        server_pids[url] = proc.pid
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)


@pytest.fixture(scope="module")
def offline(artifact):
    from kiln.runtime.llm import LLM
    return LLM(artifact, kv_memory="16MiB")


def post(server, path, body=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=60, **kw)


def used_pages(server) -> float:
    text = httpx.get(f"{server}/metrics").text
    return float(re.search(r"^kiln_kv_pages_used (\S+)$", text, re.M).group(1))


# ---------------------------------------------------------------------------- answers

def test_completion_equals_the_offline_api(client, offline, artifact):
    from kiln.runtime.sampler import SamplingParams
    got = client.completions.create(model="tiny-llama", prompt="The quick brown fox", max_tokens=12, temperature=0)
    want = offline.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_equals_the_offline_api_streaming_or_not(client, offline):
    from kiln.runtime.sampler import SamplingParams
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert whole.choices[0].message.content == want.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids) and not chunks[-1].choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_n_seed_stop_and_logprobs(client):
    kw = dict(model="tiny-llama", prompt="Once upon", max_tokens=8, temperature=1.0, seed=11, n=3)
    first, again = (client.completions.create(**kw) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    greedy = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=16, temperature=0)
    text = greedy.choices[0].text
    stop = text[3:6]
    stopped = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=16, temperature=0,
                                        stop=[stop])
    assert stopped.choices[0].text == text[:text.find(stop)] and stopped.choices[0].finish_reason == "stop"
    lp = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2)
    p = lp.choices[0].logprobs
    assert len(p.tokens) == 4 and all(v <= 0 for v in p.token_logprobs) and all(len(t) >= 2 for t in p.top_logprobs)
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)


def test_models_health_version_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    card = client.models.retrieve("tiny-llama")
    assert card.id == "tiny-llama" and card.owned_by == "kiln"
    missing = httpx.get(f"{server}/v1/models/gpt-9", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server}/version").json()
    text = httpx.get(f"{server}/metrics").text
    for name in ("kiln_requests_running", "kiln_requests_waiting", "kiln_kv_cache_usage_ratio",
                 "kiln_prefix_cache_hit_rate", "kiln_prompt_tokens_total", "kiln_generation_tokens_total",
                 "kiln_time_to_first_token_seconds_bucket", "kiln_inter_token_latency_seconds_bucket",
                 "kiln_e2e_request_latency_seconds_bucket", "kiln_requests_finished_total"):
        assert name in text, name
    # vLLM's names for the same quantities, labelled with the model, for dashboards and routers built for vLLM
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="tiny-llama"', text, re.M), name
    ours = float(re.search(r"^kiln_generation_tokens_total (\S+)$", text, re.M).group(1))
    theirs = float(re.search(r'^vllm:generation_tokens_total{model_name="tiny-llama"} (\S+)$', text, re.M).group(1))
    assert ours == theirs


# ---------------------------------------------------------------------------- bad input

BAD = [
    ("malformed json", dict(content=b'{"prompt": "x", '), 400, None),
    ("wrong type", dict(json={"prompt": "x", "max_tokens": "many"}), 400, "max_tokens"),
    ("negative max_tokens", dict(json={"prompt": "x", "max_tokens": -3}), 400, "max_tokens"),
    ("huge max_tokens", dict(json={"prompt": "x", "max_tokens": 10**9}), 400, "max_tokens"),
    ("empty prompt", dict(json={"prompt": ""}), 400, "prompt"),
    ("prompt over the context", dict(json={"prompt": [5] * 5000}), 400, "prompt"),
    ("token outside the vocabulary", dict(json={"prompt": [10**6]}), 400, "prompt"),
    ("unknown model", dict(json={"prompt": "x", "model": "gpt-9"}), 404, "model"),
    ("invalid utf-8", dict(content=b'{"prompt": "\xff\xfe"}'), 400, None),
    ("temperature out of range", dict(json={"prompt": "x", "temperature": 7}), 400, "temperature"),
    ("bad logit_bias", dict(json={"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias"),
    ("min_tokens above max_tokens", dict(json={"prompt": "x", "max_tokens": 2, "min_tokens": 9}), 400, None),
    ("10 MB body", dict(content=b'{"prompt": "' + b"a" * (10 << 20) + b'"}'), 413, None),
    ("best_of other than n", dict(json={"prompt": "x", "best_of": 3}), 400, "best_of"),
]


@pytest.mark.parametrize("name,kw,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_4xx_and_the_server_keeps_serving(server, client, name, kw, status, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
    assert "Value error" not in err["message"], err          # pydantic's wording stays out of it
    if name == "malformed json":                             # no character offset posing as a parameter
        assert err["param"] is None and "not valid JSON" in err["message"], err
    assert client.completions.create(model="tiny-llama", prompt="ok", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_key_is_401(server, key):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_empty_chat_is_400(server):
    r = post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------------------- the OpenAI surface clients use

def test_several_prompts_give_one_choice_per_prompt_and_sample_in_order(client, offline):
    from kiln.runtime.sampler import SamplingParams
    prompts = ["The quick brown fox", "Once upon a time"]
    ids = [offline.tokenizer.encode(p) for p in prompts]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for prompt in (prompts, ids):                        # strings, or token-id lists
        got = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, n=2)
        assert [c.index for c in got.choices] == [0, 1, 2, 3]
        assert [c.text for c in got.choices] == [w.outputs[0].text for w in want for _ in range(2)]
        assert got.usage.prompt_tokens == sum(len(i) for i in ids)
        assert got.usage.completion_tokens == 2 * sum(len(w.outputs[0].token_ids) for w in want)
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {k: w.outputs[0].text for k, w in enumerate(want)}
    assert chunks[-1].usage.prompt_tokens == sum(len(i) for i in ids)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, make_model):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(make_model("llama")).eval()
    ids = [1, 57, 203, 88, 411, 9, 300, 17, 250, 33, 120, 64]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for stream in (False, True):
        r = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                                             "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            [choice] = [c for e in events for c in e["choices"] if c["logprobs"]]
        else:
            [choice] = r.json()["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [ref[t - 1, ids[t]] for t in range(1, len(ids))]
        assert np.allclose(lp["token_logprobs"][1:], want, atol=1e-3), (lp["token_logprobs"], want)
        assert all(max(top.values()) == pytest.approx(ref[t].max(), abs=1e-3)
                   for t, top in enumerate(lp["top_logprobs"][1:]))
        assert choice["finish_reason"] == "length"
    # with generation: the prompt's entries, then the generated tokens'
    r = post(server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3,
                                         "temperature": 0}).json()
    assert len(r["choices"][0]["logprobs"]["tokens"]) == len(ids) + 3
    assert r["usage"]["completion_tokens"] == 3


NULLABLE = [
    ("temperature null", {"temperature": None}),
    ("max_tokens null", {"max_tokens": None}),
    ("every optional field null", {k: None for k in (
        "temperature", "top_p", "n", "stream", "stop", "seed", "presence_penalty", "frequency_penalty",
        "logit_bias", "logprobs", "user", "echo", "suffix", "stream_options", "best_of", "tools")}),
    ("negative seed", {"seed": -1}),
    ("64-bit seed", {"seed": 2**63 - 1}),
    ("seed past 64 bits", {"seed": -(2**70)}),
]


@pytest.mark.parametrize("name,fields", NULLABLE, ids=[n[0] for n in NULLABLE])
def test_nulls_mean_defaults_and_any_int_seeds(server, name, fields):
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                 "max_tokens": 3})):
        r = post(server, path, {**body, **fields})
        assert r.status_code == 200, r.text
    if fields.get("seed") is not None:
        again = [post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 1, **fields})
                 .json()["choices"][0]["text"] for _ in range(2)]
        assert again[0] == again[1]


UNSUPPORTED = [
    ("image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "image_url"),
    ("audio part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "messages.0.content",
     "input_audio"),
    ("suffix", "/v1/completions", {"prompt": "def f(", "suffix": "return 1"}, "suffix", "suffix"),
    ("tools, no tool-call format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "--tool-call-parser"),
    ("tool_choice without tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                           "tool_choice": "required"}, None, "needs tools"),
    ("legacy functions", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "functions": [{"name": "f"}]}, "functions", "tools"),
    ("unknown response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "response_format": {"type": "xml"}},
     "response_format", "xml"),
    ("two constraints", "/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["b"]},
     None, "guided_regex and guided_choice"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800abc"}', "prompt", "surrogate"),
]


@pytest.mark.parametrize("name,path,body,param,word", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_what_kiln_does_not_support_is_refused_by_name(server, name, path, body, param, word):
    if isinstance(body, bytes):             # JSON text the client library would not encode
        r = httpx.post(f"{server}{path}", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


def test_structured_output_through_the_openai_sdk(client):
    """`chat.completions.parse` sends a strict json_schema response_format and parses the reply into
    the model class: it must, from a random-weight model."""
    from typing import Literal
    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        answer: Literal["yes", "no", "maybe"]
        score: int = Field(ge=0, le=10)
        tags: list[Literal["a", "b c"]] = Field(max_length=2)

    for seed in range(3):
        done = client.chat.completions.parse(model="tiny-llama", messages=[{"role": "user", "content": "Judge."}],
                                             response_format=Verdict, temperature=1, seed=seed, max_tokens=200)
        assert isinstance(done.choices[0].message.parsed, Verdict), done.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("field,value,check", [
    ("guided_choice", ["alpha", "beta gamma"], lambda t: t in ("alpha", "beta gamma")),
    ("structured_outputs", {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("structured_outputs", {"json": {"type": "object", "required": ["n"], "additionalProperties": False,
                                     "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}}},
     lambda t: 1 <= json.loads(t)["n"] <= 9),
], ids=["choice", "regex", "json"])
def test_vllm_constraint_fields(server, field, value, check, stream):
    body = {"prompt": "Say:", "max_tokens": 60, "temperature": 1, "seed": 4, "n": 2, field: value, "stream": stream}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        texts = ["", ""]
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    else:
        texts = [c["text"] for c in r.json()["choices"]]
    assert all(check(t) for t in texts), texts


def test_responses_api_through_the_openai_sdk(client, offline):
    """client.responses.create, whole and streamed: the same greedy text as the offline API on the
    same chat-template rendering (instructions as the system message)."""
    from kiln.runtime.sampler import SamplingParams
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = offline.tokenizer.apply_chat_template(messages)
    ids = offline.tokenizer.encode(text, add_special_tokens=False)
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    whole = client.responses.create(model="tiny-llama", input="Hello", instructions="Be brief.", temperature=0,
                                    max_output_tokens=8)
    assert whole.output_text == want and whole.usage.input_tokens == len(ids)
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens <= 8
    events = list(client.responses.create(model="tiny-llama", input=[{"role": "user", "content": "Hello"}],
                                          instructions="Be brief.", temperature=0, max_output_tokens=8,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_text_format_json_schema(client):
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    done = client.responses.create(model="tiny-llama", input="Fine?", temperature=1, max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert isinstance(json.loads(done.output_text)["ok"], bool)


@pytest.mark.parametrize("body,param,word", [
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "tool"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "xml"),
])
def test_responses_api_refuses_by_name(server, body, param, word):
    r = post(server, "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and word in r.json()["error"]["message"], r.text


ENGINE_REJECTS = [       # requests the protocol layer lets through and the engine refuses
    ("token outside the vocabulary", {"prompt": [3, 10**6]}, "prompt"),
    ("min_tokens above max_tokens", {"prompt": "x", "max_tokens": 2, "min_tokens": 9}, "min_tokens"),
    ("negative stop token id", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [-4]}, "stop_token_ids"),
    ("one bad prompt of two", {"prompt": [[5, 6], [7, 10**7]], "max_tokens": 2}, "prompt"),
    ("a schema xgrammar cannot compile", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ("a regex that does not parse", {"prompt": "x", "structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name,body,param", ENGINE_REJECTS, ids=[e[0] for e in ENGINE_REJECTS])
def test_engine_rejections_are_400s_before_any_byte_streamed_or_not(server, name, body, param, stream):
    r = post(server, "/v1/completions", {**body, "stream": stream})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["error"]["param"] == param, r.text
    assert used_pages(server) == 0          # nothing of the refused request was admitted


def test_metrics_count_requests_and_aborts(server):
    def metric(name):
        m = re.search(rf"^{name} (\S+)$", httpx.get(f"{server}/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0
    aborts = metric('kiln_requests_finished_total{reason="abort"}')
    body = {"prompt": "Count:", "max_tokens": 300, "n": 4, "temperature": 1, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
        assert metric("kiln_requests_running") == 1.0         # one request, four sequences
    deadline = time.time() + 10
    while metric('kiln_requests_finished_total{reason="abort"}') == aborts and time.time() < deadline:
        time.sleep(0.1)
    assert metric('kiln_requests_finished_total{reason="abort"}') == aborts + 4    # each unfinished choice


# ---------------------------------------------------------------------------- disconnects, fuzzing, load

def test_client_that_disconnects_mid_stream_frees_its_pages(server):
    body = {"prompt": "A long story:", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.time() + 10
    while used_pages(server) and time.time() < deadline:
        time.sleep(0.1)
    assert used_pages(server) == 0


def test_sixty_four_streaming_clients_with_disconnects(server):
    """64 concurrent streaming clients for a bounded time, a quarter of them hanging up early:
    no 5xx, every accepted request completes or ends with an explicit error, no page left held."""
    import asyncio
    import random
    duration = float(os.environ.get("KILN_LOAD_SECONDS", "60")) / 3
    results = {"done": 0, "dropped": 0, "errors": 0, "5xx": 0, "incomplete": 0}

    async def one_client(i, http):
        rng = random.Random(i)
        end = time.time() + duration
        while time.time() < end:
            body = {"prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 80))],
                    "max_tokens": rng.randrange(4, 64), "stream": True, "temperature": 0.8}
            hang_up = rng.random() < 0.25
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code >= 500:
                        results["5xx"] += 1
                        continue
                    if r.status_code != 200:
                        results["errors"] += 1
                        continue
                    n, done = 0, False
                    async for line in r.aiter_lines():
                        n += 1
                        if hang_up and n > 3:
                            results["dropped"] += 1
                            break
                        done = done or line == "data: [DONE]"
                    else:
                        results["done" if done else "incomplete"] += 1
            except httpx.HTTPError:
                results["errors"] += 1

    async def main():
        async with httpx.AsyncClient(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                                     limits=httpx.Limits(max_connections=128)) as http:
            await asyncio.gather(*(one_client(i, http) for i in range(64)))

    rss = [rss_mib(server_pids[server])]
    for _ in range(3):                      # three equal rounds: memory may grow while warming up, then not
        asyncio.run(main())
        rss.append(rss_mib(server_pids[server]))
    assert results["5xx"] == 0 and results["incomplete"] == 0, results     # every stream ends in [DONE] or an error
    assert results["done"] > 64 and results["dropped"] > 0, results
    print(f"server RSS (MiB) before and after each round: {rss}; {results}")
    assert rss[3] - rss[2] < max(20.0, 0.25 * (rss[2] - rss[0])), rss    # memory stays flat after warm-up
    deadline = time.time() + 20
    while used_pages(server) and time.time() < deadline:
        time.sleep(0.2)
    assert used_pages(server) == 0
    assert httpx.get(f"{server}/health").status_code == 200


def test_bench_serve_reports_against_the_server(server, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "kiln.cli", "bench", "serve", "--url", server, "--api-key", KEY,
                           "--num-prompts", "12", "--max-concurrency", "4", "--request-rate", "50",
                           "--input-len", "20", "--output-len", "8", "--dataset", "sharegpt-like",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Median TTFT (ms):", "P99 TPOT (ms):", "Mean ITL (ms):", "Median E2EL (ms):"):
        assert line in proc.stdout, line
    report = json.loads(out.read_text())
    assert report["successful_requests"] == 12 and report["failed_requests"] == 0
    assert report["total_output_tokens"] > 12 and report["total_input_tokens"] > 12
    assert 0 < report["ttft_ms"]["median"] <= report["e2el_ms"]["median"]


def test_bench_prompts_can_share_a_prefix():
    """--prefix-len: every prompt starts with the same words (what prefix caching serves), then its own."""
    from kiln.serve.bench import make_requests
    shared = make_requests(4, 20, 8, "random", seed=3, prefix_len=50)
    prefix = shared[0][0].split()[:50]
    assert all(p.split()[:50] == prefix and len(p.split()) == 50 + 19 and n == 8 for p, n in shared)
    assert len({" ".join(p.split()[50:]) for p, _ in shared}) == 4
    assert make_requests(4, 20, 8, "random", seed=3) == make_requests(4, 20, 8, "random", seed=3, prefix_len=0)


@pytest.mark.build
def test_chat_on_a_model_without_a_template_is_a_400_naming_it(make_model, tmp_path):
    """A checkpoint that has no chat template anywhere: chat is a 400, plain completions still work."""
    from fastapi.testclient import TestClient
    from kiln.compiler import compile_model
    from kiln.serve.app import ServerConfig, create_app
    model = tmp_path / "no-template"
    shutil.copytree(make_model("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    compile_model(model, tmp_path / "artifact", CompileOptions(target="cpu"), show=None)
    app = create_app(ServerConfig.of(str(tmp_path / "artifact"), kv_memory="8MiB"), load_now=True)
    with TestClient(app) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            assert "chat template" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_full_queue_is_a_429_and_the_server_keeps_serving(artifact):
    """--max-waiting N (ServerConfig.max_waiting): a request that would leave more than N waiting is a
    429 rate_limit_error, in OpenAI's error object; the next one that fits is served."""
    from fastapi.testclient import TestClient
    from kiln.serve.app import ServerConfig, create_app
    app = create_app(ServerConfig.of(str(artifact), kv_memory="8MiB", max_waiting=1), load_now=True)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
