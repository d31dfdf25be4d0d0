"""Fuzzing `kiln serve`: no generated request may get a 5xx, and the server stays healthy.

Two generators, both driven by the server's own OpenAPI schema:
- schemathesis (positive and negative cases from the schema, every route);
- an adversarial generator here that fills each body field the schema names with what clients
  and attackers actually send: explicit nulls, negative and 64-bit (and larger) integers,
  non-finite and huge floats, huge lists, unusual unicode (zero-width, RTL, emoji, NUL, unpaired
  surrogates), wrong types and nested garbage; streamed and not.
The model has a 64-token context so every accepted request finishes in well under a second.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from serving import KEY, running_server

from kiln.options import CompileOptions

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)

NUM_REQUESTS = int(os.environ.get("KILN_FUZZ_REQUESTS", "2000"))


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from kiln.compiler import compile_model
    from kiln.testing.tiny import make_tiny_model
    root = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_model(root / "model", "llama", seed=3, max_position_embeddings=64)
    compile_model(model, root / "short-context", CompileOptions(target="cpu"), show=None)
    with running_server(root / "short-context", root / "server.log", "--kv-memory", "16MiB",
                        "--max-num-seqs", "32", "--max-waiting", "4000", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3") as (url, _):
        yield url


# ---------------------------------------------------------------------------- values clients send

INTS = [0, 1, -1, 2, 7, 16, 64, 65, 255, 2**31 - 1, -2**31, 2**53 + 1, 2**63 - 1, -2**63, 2**64, -2**64 - 3,
        10**30]
FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, 2.0, -2.0, 1e-300, 5e-324, 1e308, -1e308, float("inf"), float("-inf"),
          float("nan"), 3.14159]
TEXTS = ["", " ", "Hello", "a" * 5000, "\u200b\u200d\ufeff", "\u202eRTL\u202c", "😀👩‍👩‍👧‍👦🏳️‍🌈", "\x00nul\x00",
         "\ud800", "\udfff tail", "\U0010ffff", "e\u0301" * 50, "<|endoftext|>", "<s></s>", "{{ raise_exception('x') }}",
         "%s%n", "\\u0000", "日本語のテキスト", "\r\n\t"]


def scalar(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice(INTS)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return rng.choice(TEXTS)
    if kind == 4:
        return rng.choice([True, False])
    return rng.randrange(-5, 70)


def garbage(rng: random.Random, depth: int = 0):
    kind = rng.randrange(4 if depth < 2 else 1)
    if kind == 0:
        return scalar(rng)
    if kind == 1:
        return [garbage(rng, depth + 1) for _ in range(rng.choice([0, 1, 3]))]
    if kind == 2:
        return {rng.choice(TEXTS + ["type", "text", "role", "content"]): garbage(rng, depth + 1)
                for _ in range(rng.choice([0, 1, 3]))}
    return [rng.randrange(-3, 600) for _ in range(rng.choice([1, 20, 10_000]))]       # huge lists


def typed_value(rng: random.Random, schema: dict, wild: bool):
    """A value of the field's declared type: a plain one, or (wild) anything from nulls to garbage."""
    types = {t.get("type") for t in schema.get("anyOf", [schema])}
    if wild and rng.random() < 0.4:
        return rng.choice([None, garbage(rng)])
    if "integer" in types:
        return rng.choice(INTS) if wild else rng.randrange(0, 4)
    if "number" in types:
        return rng.choice(FLOATS) if wild else rng.choice([0.0, 0.5, 1.0])
    if "boolean" in types:
        return rng.random() < 0.5
    if "string" in types:
        return rng.choice(TEXTS) if wild else "Hello"
    if "array" in types:
        return [scalar(rng) for _ in range(rng.choice([0, 1, 2, 17, 300]))] if wild else []
    return garbage(rng) if wild else None


def prompt_value(rng: random.Random, wild: bool):
    if not wild:
        return rng.choice(["Hello there", [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]])
    return rng.choice([
        lambda: rng.choice(TEXTS),
        lambda: [rng.randrange(0, 520) for _ in range(rng.randrange(1, 70))],
        lambda: [rng.choice(TEXTS) for _ in range(rng.randrange(1, 4))],
        lambda: [[rng.randrange(-2, 600) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 4))],
        lambda: garbage(rng),
    ])()


def messages_value(rng: random.Random, wild: bool):
    if not wild:
        return [{"role": "user", "content": rng.choice(["Hi", "Name a colour.", "日本語"])}]

    def content():
        return rng.choice([
            lambda: rng.choice(TEXTS),
            lambda: [{"type": "text", "text": rng.choice(TEXTS)}],
            lambda: [{"type": rng.choice(["image_url", "input_audio", "file", "text", None, 3]),
                      "text": scalar(rng), "image_url": {"url": "http://127.0.0.1/x.png"}}],
            lambda: garbage(rng),
        ])()
    roles = ["system", "user", "assistant", "tool", "developer", "wizard", None]
    return [{"role": rng.choice(roles), "content": content()} for _ in range(rng.choice([0, 1, 2, 5]))]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


def special_value(name: str, rng: random.Random, wild: bool):
    """Plausible or broken values of the fields that constrain the output or call tools."""
    plausible = {
        "response_format": lambda: rng.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]),
        "structured_outputs": lambda: rng.choice([{"regex": "[a-c]{1,4}"}, {"choice": ["yes", "no"]},
                                                  {"json": {"type": "boolean"}}, {"grammar": 'root ::= "x"'}]),
        "guided_choice": lambda: ["red", "blue"],
        "guided_regex": lambda: "[0-9]{2}",
        "tools": lambda: [TOOL],
        "tool_choice": lambda: rng.choice(["none", "auto", "required",
                                           {"type": "function", "function": {"name": "get_weather"}}]),
    }
    broken = [lambda: {"type": rng.choice(["json_schema", "json_object", "xml", None])},
              lambda: {"json_schema": {"schema": {"type": rng.choice(["strin", "object", 3]), "$ref": "#/x"}}},
              lambda: {"regex": rng.choice(["([a-", "", "\\", None])}, lambda: {"choice": rng.choice([[], [3], "x"])},
              lambda: [{"type": "function", "function": {"name": rng.choice(["", "a b", "f" * 80, None])}}],
              lambda: {"type": "function", "function": {"name": "missing"}}, lambda: garbage(rng)]
    return rng.choice(broken)() if wild else plausible[name]()


def input_value(rng: random.Random, wild: bool):
    """The Responses API's input: text, messages, function calls and their outputs, or garbage."""
    if not wild:
        return rng.choice(["Hello there", [{"role": "user", "content": "Name a colour."}]])
    return rng.choice([
        lambda: rng.choice(TEXTS),
        lambda: messages_value(rng, True),
        lambda: [{"type": "function_call", "call_id": scalar(rng), "name": "f", "arguments": rng.choice(TEXTS)},
                 {"type": "function_call_output", "call_id": "c", "output": scalar(rng)}],
        lambda: [{"role": "user", "content": [{"type": rng.choice(["input_text", "input_image"]), "text": "x"}]}],
        lambda: garbage(rng),
    ])()


def resolve(schema: dict, ref_or_schema: dict) -> dict:
    ref = ref_or_schema.get("$ref")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else ref_or_schema


def request_bodies(schema: dict, n: int, seed: int = 0):
    """(path, body) pairs: every field the schema declares for the route may appear."""
    rng = random.Random(seed)
    routes = []
    for path, item in schema["paths"].items():
        post = item.get("post")
        if post and "requestBody" in post:
            body_schema = resolve(schema, post["requestBody"]["content"]["application/json"]["schema"])
            routes.append((path, body_schema["properties"]))
    # the LoRA routes too: on a server without adapter slots (or runtime updating) they are 404s, never 5xx
    assert {p for p, _ in routes} == {"/v1/completions", "/v1/chat/completions", "/v1/responses",
                                      "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}, routes
    generating = [r for r in routes if "lora" not in r[0]]
    adapters = [r for r in routes if "lora" in r[0]]
    for i in range(n):                       # one request in ten to the adapter routes
        path, props = adapters[i // 10 % 2] if i % 10 == 9 else generating[i % len(generating)]
        wild = rng.random() < 0.5            # half the requests are plausible, half adversarial
        body = {}
        for name, prop in props.items():
            if name == "prompt":
                body[name] = prompt_value(rng, wild)
            elif name == "messages":
                body[name] = messages_value(rng, wild)
            elif name == "input":
                body[name] = input_value(rng, wild)
            elif name in ("response_format", "structured_outputs", "guided_choice", "guided_regex", "tools",
                          "tool_choice") and rng.random() < 0.15:
                body[name] = special_value(name, rng, wild)
            elif rng.random() < (0.3 if wild else 0.1):
                body[name] = typed_value(rng, resolve(schema, prop), wild)
        if rng.random() < 0.3:
            body["max_tokens"] = rng.choice([None, 0, 1, 5, 64, -1, 2**63] if wild else [1, 5, 64])
        if rng.random() < 0.05:
            body[rng.choice(TEXTS)] = garbage(rng)             # unknown fields are ignored
        yield path, body


def test_adversarial_requests_from_the_schema_get_no_5xx(fuzz_server):
    assert_no_5xx_under_fuzzing(fuzz_server, NUM_REQUESTS)


def assert_no_5xx_under_fuzzing(url: str, count: int) -> None:
    """`count` adversarial requests from the server's schema (16 at a time): no 5xx, no stream that
    errs or ends without [DONE], both 2xx and 4xx among the answers, and afterwards the server
    healthy with every KV page back. tests/gpu/test_cuda_serve.py runs it on a CUDA artifact."""
    fuzz_server = url
    schema = httpx.get(f"{fuzz_server}/openapi.json").json()
    tally: dict[str, int] = {}
    failures: list[str] = []

    async def send(http, path, body):
        text = json.dumps(body)              # NaN and Infinity go out as JSON extensions, as some clients do
        try:
            async with http.stream("POST", path, content=text, headers={"Content-Type": "application/json"}) as r:
                payload = (await r.aread()).decode("utf-8", "replace")
        except httpx.HTTPError as e:
            failures.append(f"{path} {text[:300]}: {type(e).__name__} {e}")
            return
        status = f"{r.status_code // 100}xx"
        tally[status] = tally.get(status, 0) + 1
        streamed_error = r.status_code == 200 and 'data: {"error"' in payload
        if r.status_code >= 500 or streamed_error or (r.status_code == 200 and body.get("stream") is True
                                                      and not payload.rstrip().endswith("data: [DONE]")):
            failures.append(f"{path} {r.status_code} {text[:300]} -> {payload[:300]}")

    async def main():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=fuzz_server, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=120, limits=limits) as http:
            bodies = list(request_bodies(schema, count))
            for start in range(0, len(bodies), 16):
                await asyncio.gather(*(send(http, p, b) for p, b in bodies[start:start + 16]))

    asyncio.run(main())
    print(f"statuses over {count} requests: {tally}")
    assert not failures, "\n".join(failures[:10])
    assert sum(tally.values()) == count
    assert tally.get("2xx", 0) > count // 10 and tally.get("4xx", 0) > count // 10, tally
    assert httpx.get(f"{fuzz_server}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{fuzz_server}/metrics").text
    assert float(re.search(r"^kiln_kv_pages_used (\S+)$", metrics, re.M).group(1)) == 0


def schemathesis_cli() -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(schemathesis_cli() is None, reason="schemathesis is not installed")
def test_schemathesis_finds_no_5xx_on_any_route(fuzz_server, tmp_path):
    proc = subprocess.run([schemathesis_cli(), "run", f"{fuzz_server}/openapi.json", "--checks", "not_a_server_error",
                           "--mode", "all", "-n", "60", "--seed", "1", "-H", f"Authorization: Bearer {KEY}",
                           "--request-timeout", "120", "--phases", "examples,coverage,fuzzing"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)   # its cache goes there
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    tested = re.search(r"Selected: (\d+)/\d+\s+Tested: (\d+)", proc.stdout)
    assert tested and int(tested.group(2)) == int(tested.group(1)) >= 6, proc.stdout[-2000:]   # every route
    assert httpx.get(f"{fuzz_server}/health").status_code == 200
