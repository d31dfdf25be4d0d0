"""`kiln serve` on the tiny model's CUDA artifact, driven by the official `openai` client: chat, streamed
and n > 1 completions and their logprobs give transformers' greedy tokens, alone or 24 at once, and no
request gets a 5xx. Token ids are compared through the text of each token the server's logprobs name
(the tokenizer's own text of each id: equal ids give equal lists)."""
from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy, hf_greedy_uncached, random_prompt  # noqa: E402
from serving import KEY, running_server  # noqa: E402

MODEL = "tiny-cuda"
GREEDY = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(gpu_bundle, tmp_path_factory):
    """(client, server log) of `kiln serve` on cuda-float32. The client never retries: a 5xx fails the call."""
    log = tmp_path_factory.mktemp("cuda-serve") / "server.log"
    with running_server(gpu_bundle / "cuda-float32", log, "--kv-memory", "64MiB", "--max-num-seqs", "16",
                        "--served-model-name", MODEL) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0), log, url


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def hf(gpu_bundle):
    return transformers.AutoModelForCausalLM.from_pretrained(gpu_bundle / "model", attn_implementation="eager",
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def texts(gpu_bundle):
    """texts(ids): each token's text as the server's logprobs give it."""
    from kiln.runtime.tokenizer import Tokenizer
    tok = Tokenizer(gpu_bundle / "cuda-float32")
    return lambda ids: [tok.decode_raw([t], skip_special_tokens=False) for t in ids]


def hf_logprobs(hf, ids: list[int]) -> tuple[np.ndarray, float]:
    """([positions, vocab] log-softmax of transformers' logits, the largest |logit|: the scale of its error)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy(), float(logits.abs().max())


def test_completion_tokens_and_logprobs_are_transformers(client, hf, texts):
    ids = random_prompt(23, 1)
    want = hf_greedy(hf, ids, 16)
    r = client.completions.create(prompt=ids, max_tokens=16, logprobs=2, **GREEDY)
    [choice] = r.choices
    assert choice.logprobs.tokens == texts(want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16
    ref, scale = hf_logprobs(hf, ids + want)
    expected = [ref[len(ids) - 1 + i, t] for i, t in enumerate(want)]
    assert np.allclose(choice.logprobs.token_logprobs, expected, atol=1e-3 * scale)
    assert all(max(top.values()) <= lp + 1e-6          # greedy: no token above the chosen one
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))


def test_prompt_scoring_with_echo_is_transformers(client, hf):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    ids = random_prompt(30, 2)
    ref, scale = hf_logprobs(hf, ids)
    lp = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0).choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert np.allclose(lp.token_logprobs[1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-3 * scale)


def test_chat_streamed_or_not_gives_transformers_greedy_tokens(client, hf, texts, gpu_bundle):
    from kiln.runtime.tokenizer import Tokenizer
    tok = Tokenizer(gpu_bundle / "cuda-float32")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    want = hf_greedy_uncached(hf, ids, 12)     # not generate(): its pad id 0 is bos here, which it would mask
    whole = client.chat.completions.create(messages=messages, max_tokens=12, logprobs=True, **GREEDY)
    assert [c.token for c in whole.choices[0].logprobs.content] == texts(want)
    assert whole.usage.prompt_tokens == len(ids) and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=12, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(s.delta.content or "" for s in streamed) == whole.choices[0].message.content
    assert [e.token for s in streamed if s.logprobs for e in s.logprobs.content] == texts(want)
    assert chunks[-1].usage.completion_tokens == 12 and streamed[-1].finish_reason == "length"


def test_streamed_completion_gives_transformers_greedy_tokens(client, hf, texts):
    ids = random_prompt(40, 3)
    want = hf_greedy(hf, ids, 20)
    whole = client.completions.create(prompt=ids, max_tokens=20, **GREEDY).choices[0].text
    chunks = list(client.completions.create(prompt=ids, max_tokens=20, logprobs=1, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(s.text for s in streamed) == whole
    assert [t for s in streamed if s.logprobs for t in s.logprobs.tokens] == texts(want)
    assert chunks[-1].usage.completion_tokens == 20


def test_n_greedy_samples_of_two_prompts_and_seeded_samples(client, hf, texts):
    """n = 2 for each of two prompts: choice k * n + i is prompt k's; greedy samples are transformers';
    seeded sampling at temperature 1 gives the same samples twice."""
    prompts = [random_prompt(17, 4), random_prompt(33, 5)]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    r = client.completions.create(prompt=prompts, max_tokens=10, n=2, logprobs=1, **GREEDY)
    choices = sorted(r.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert [c.logprobs.tokens for c in choices] == [texts(w) for w in want for _ in range(2)]
    assert r.usage.completion_tokens == 40
    kw = dict(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=1.0, seed=7, n=3)
    first, again = (client.completions.create(**kw) for _ in range(2))
    assert [c.text for c in first.choices] == [c.text for c in again.choices] and len(first.choices) == 3


def test_twenty_four_streams_at_once_each_get_their_greedy_tokens(client, hf, texts):
    """More requests than --max-num-seqs (16), ragged: batches of every size, some waiting their turn."""
    prompts = [random_prompt(5 + 3 * i, 300 + i) for i in range(24)]

    def stream(ids):
        chunks = client.completions.create(prompt=ids, max_tokens=10, logprobs=1, stream=True, **GREEDY)
        return [t for c in chunks for s in c.choices if s.logprobs for t in s.logprobs.tokens]
    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(stream, prompts))
    assert got == [texts(hf_greedy(hf, p, 10)) for p in prompts]


def test_fuzzing_gets_no_5xx_and_leaves_the_server_healthy(served):
    """The fuzzing suite's adversarial requests (tests/test_serve_fuzz.py), on the CUDA artifact."""
    from test_serve_fuzz import assert_no_5xx_under_fuzzing
    assert_no_5xx_under_fuzzing(served[2], int(os.environ.get("KILN_FUZZ_REQUESTS", "400")))


def test_no_request_got_a_5xx(served):
    """Last in this file: the server's access log over every test above (/health is 503 while it loads)."""
    text = served[1].read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in text
    assert not re.search(r'"POST [^"]*" 5\d\d', text) and "Traceback" not in text, text[-3000:]
