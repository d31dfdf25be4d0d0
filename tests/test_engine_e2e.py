"""The engine end to end on the compiled tiny Llama: concurrency, preemption, prefix caching,
n > 1 with copy-on-write, logprobs against transformers, the offline and async APIs."""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from reference import hf_greedy, random_prompt as prompt  # noqa: E402

pytestmark = pytest.mark.build        # builds with TVM or runs what it built (not in make test-fast)


@pytest.fixture(scope="module")
def llama(llama_cpu):
    """(artifact dir, HF model) for the tiny GQA Llama (tests/conftest.py)."""
    return llama_cpu


def greedy(max_tokens, **kw):
    from kiln.runtime.sampler import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def mixed_requests(count=16):
    rng = np.random.default_rng(5)
    return [(prompt(int(rng.integers(3, 60)), seed=100 + i), int(rng.integers(2, 24))) for i in range(count)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(llama):
    """Each mixed request run alone: the tokens the batched runs must reproduce."""
    from kiln.runtime.llm import LLM
    llm = LLM(llama[0], kv_memory="16MiB", max_num_seqs=1)
    return [tokens(llm.generate([p], greedy(n)))[0] for p, n in mixed_requests()]


def test_sixteen_concurrent_requests_equal_each_alone(llama, alone):
    from kiln.runtime.llm import LLM
    llm = LLM(llama[0], kv_memory="16MiB", max_num_seqs=16, max_batched_tokens=64)
    reqs = mixed_requests()
    outs = llm.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
    assert tokens(outs) == alone
    assert tokens(outs)[0] == hf_greedy(llama[1], reqs[0][0], reqs[0][1])


def test_a_pool_too_small_for_all_preempts_and_still_gives_the_same_tokens(llama, alone):
    from kiln.runtime.llm import LLM
    probe = LLM(llama[0], kv_memory="1MiB")
    page_bytes = probe.model.bytes_per_page
    llm = LLM(llama[0], kv_memory=12 * page_bytes, max_num_seqs=16, max_batched_tokens=64, prefix_caching=False)
    reqs = mixed_requests()
    outs = llm.generate([p for p, _ in reqs], [greedy(n) for _, n in reqs], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == alone


def test_shared_system_prompt_hits_the_prefix_cache_and_keeps_tokens(llama):
    from kiln.runtime.llm import LLM
    system = prompt(70, seed=9)                      # 4 full pages of 16 and a partial one
    asks = [system + prompt(6, seed=10), system + prompt(9, seed=11)]
    runs = {}
    for caching in (False, True):
        llm = LLM(llama[0], kv_memory="16MiB", prefix_caching=caching)
        outs = [llm.generate([a], greedy(10))[0] for a in asks]
        runs[caching] = (tokens(outs), [o.num_cached_tokens for o in outs], llm.engine.pool.stats.hit_tokens)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == [0, 64] and runs[True][2] == 64
    assert runs[False][1] == [0, 0]


def test_n_samples_share_pages_greedy_ones_agree_and_seeded_ones_repeat(llama):
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampler import SamplingParams
    llm = LLM(llama[0], kv_memory="16MiB")
    ids = prompt(21, seed=12)                        # a partial last page: copy-on-write for samples 1, 2
    [one] = llm.generate([ids], greedy(12))
    [three] = llm.generate([ids], greedy(12, n=3))
    assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=12, ignore_eos=True)
    first, again = (llm.generate([ids], params)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


def test_logprobs_match_transformers(llama):
    from kiln.runtime.llm import LLM
    llm = LLM(llama[0], kv_memory="16MiB")
    ids = prompt(9, seed=13)
    [out] = llm.generate([ids], greedy(5, logprobs=3))
    c = out.outputs[0]
    with torch.no_grad():
        logits = llama[1](torch.tensor([ids + c.token_ids])).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1).numpy()
    for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        assert len(lp) == 3 and tok in lp                      # greedy: the token is its own top 1
        for alt, value in lp.items():
            assert abs(value - ref[t, alt]) < 1e-4
        assert sorted(lp, key=lp.get, reverse=True) == np.argsort(-ref[t])[:3].tolist()


def test_text_prompts_and_the_async_api(llama):
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.runtime.llm import LLM
    llm = LLM(llama[0], kv_memory="16MiB")
    [offline] = llm.generate(["The quick brown fox"], greedy(8), use_tqdm=False)
    assert offline.prompt == "The quick brown fox" and len(offline.outputs[0].token_ids) == 8

    async def stream(engine, ids):
        pieces, last = [], None
        async for out in engine.generate(ids, greedy(8)):
            pieces.append(out.outputs[0].new_text)
            last = out
        return "".join(pieces), last

    async def main():
        engine = AsyncEngine(llm.engine)
        ids = llm.tokenizer.encode("The quick brown fox")
        return await asyncio.gather(stream(engine, ids), stream(engine, prompt(12, seed=14)))

    (text, last), (_, other) = asyncio.run(main())
    assert last.finished and text == last.outputs[0].text == offline.outputs[0].text
    assert other.finished and len(other.outputs[0].token_ids) == 8
    assert not any(llm.engine.pool.refcount)       # no page is still held (cached idle pages may stay)


def test_async_consumer_that_leaves_early_aborts_its_request(llama):
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.runtime.llm import LLM
    llm = LLM(llama[0], kv_memory="16MiB", prefix_caching=False)

    async def main():
        engine = AsyncEngine(llm.engine)
        async with contextlib.aclosing(engine.generate(prompt(10, seed=15), greedy(200))) as stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        return engine

    asyncio.run(main())
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_free == llm.engine.pool.num_pages
