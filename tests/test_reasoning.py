"""--reasoning-parser (serve/reasoning.py): thinking split from the answer, whole and streamed in any
pieces, and end to end through `kiln serve` with a regex that makes a random model think."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.serve.reasoning import ReasoningStream, split

CASES = [   # parser, output, (reasoning, content)
    ("deepseek_r1", "plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
    ("deepseek_r1", "<think>plan</think>ok", ("plan", "ok")),
    ("deepseek_r1", "still thinking, cut short", ("still thinking, cut short", "")),
    ("qwen3", "<think>\nplan\n</think>\n\nok", ("\nplan\n", "\n\nok")),
    ("qwen3", "no thinking here </think> at all", (None, "no thinking here </think> at all")),
    ("qwen3", "<thin is not the marker", (None, "<thin is not the marker")),
    ("qwen3", "<think>cut short", ("cut short", "")),
]


@pytest.mark.parametrize("parser,text,want", CASES)
def test_split(parser, text, want):
    assert split(parser, text) == want


@pytest.mark.parametrize("parser,text,want", CASES)
def test_streamed_in_any_pieces_adds_up_to_the_split(parser, text, want):
    rng = np.random.default_rng(0)
    for _ in range(20):
        cuts = sorted(rng.choice(np.arange(1, len(text)), size=min(5, len(text) - 1), replace=False).tolist())
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, reasoning, content = ReasoningStream(parser), "", ""
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + r, content + c
            assert "</think>" not in reasoning + content or parser == "qwen3" and want[0] is None
        assert (reasoning, content) == (want[0] or "", want[1])


@pytest.mark.build
def test_served_reasoning_content_whole_and_streamed(llama_cpu, tmp_path):
    """A regex makes the random model write <think>…</think> and an answer; the server splits them."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("xgrammar")
    from serving import KEY, running_server
    body = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 60, "temperature": 1,
            "seed": 2, "structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}"}}
    headers = {"Authorization": f"Bearer {KEY}"}
    with running_server(llama_cpu[0], tmp_path / "server.log", "--kv-memory", "16MiB",
                        "--reasoning-parser", "deepseek_r1") as (url, _):
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"].isalpha() and message["content"].isalpha(), message
        streamed = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                              timeout=60)
        parts = {"reasoning_content": "", "content": ""}
        for line in streamed.text.splitlines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                for key in parts:
                    parts[key] += delta.get(key, "")
        assert parts == {"reasoning_content": message["reasoning_content"], "content": message["content"]}
        # chat_template_kwargs reach the template: the tiny template writes bos_token first
        plain = {"messages": body["messages"], "max_tokens": 1}
        usage = [httpx.post(f"{url}/v1/chat/completions", json={**plain, **extra}, headers=headers, timeout=60)
                 .json()["usage"]["prompt_tokens"] for extra in ({}, {"chat_template_kwargs": {"bos_token": ""}})]
        assert usage[1] == usage[0] - 1
